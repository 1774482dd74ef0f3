"""Find the runnable blocks of the Markdown docs (README.md, FORMAT.md, docs/**.md) for tests/test_docs.py.

What counts as a block, and the two markers a page may carry (docs/architecture.md, "Docs are
tests"):

* every fenced ```` ```python ```` block;
* every ``stepdump ...`` line (or ``$ stepdump ...``) inside any other fenced block: a shell line,
  run through the CLI in-process; a ``| tail`` after it runs in ``bash`` on what it printed.
* ``<!-- not run: REASON -->`` on the line right before a fence: the block is not run, and is
  counted and listed with its reason (``python tests/docs_blocks.py`` prints the list). A
  marker without a reason is an error.
* ``<!-- setup: NAME[, NAME] -->`` on the line right before a fence: this block starts from a fresh
  namespace of the named fixtures (tests/docs_fixtures.py); without it a block continues the
  namespace of the page's blocks before it, and a page starts from ``plain-loop``.

Run as a script it lists every block and the ones not run, with their reasons.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(not run|setup)\s*:(.*?)-->\s*$")
SHELL = re.compile(r"^\s*(?:\$ )?(stepdump\s.*)$")


@dataclass
class Block:
    """One runnable unit of a page: a python block, or the shell lines of one fenced block."""

    page: str
    line: int  # 1-based line of the opening fence
    kind: str  # "python" or "shell"
    code: str  # python source, or the shell lines joined by newlines
    not_run: str | None = None  # the reason, when marked
    setup: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every Markdown page the docs test reads."""
    return [ROOT / "README.md", ROOT / "FORMAT.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The runnable blocks of one page, in order. Raises ValueError on a malformed marker."""
    lines = (path.read_text() if text is None else text).split("\n")
    name = str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not re.match(rf"^{indent}```\s*$", lines[j]):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
        not_run, setup = _markers(lines, i, name)
        if lang == "python":
            out.append(Block(name, i + 1, "python", "\n".join(body), not_run, setup))
        else:
            shell = shell_lines(body)
            if shell:
                out.append(Block(name, i + 1, "shell", "\n".join(shell), not_run, setup))
            elif not_run is not None:
                raise ValueError(f"{name}:{i + 1}: a not-run marker before a block with nothing to run")
        i = j + 1
    return out


def shell_lines(body: list[str]) -> list[str]:
    """The ``stepdump ...`` lines of a non-python block; a line whose single quotes are not closed
    (an awk program) goes on over the next lines."""
    out: list[str] = []
    k = 0
    while k < len(body):
        m = SHELL.match(body[k])
        k += 1
        if not m:
            continue
        line = m.group(1)
        while line.count("'") % 2 and k < len(body):
            line += "\n" + body[k]
            k += 1
        out.append(line)
    return out


def _markers(lines: list[str], fence: int, page: str) -> tuple[str | None, list[str]]:
    """The markers on the lines right above the fence at ``fence`` (blank lines end the search)."""
    not_run: str | None = None
    setup: list[str] = []
    k = fence - 1
    while k >= 0 and (m := MARKER.match(lines[k])):
        what, arg = m.group(1), m.group(2).strip()
        if not arg:
            raise ValueError(f"{page}:{k + 1}: '<!-- {what}: -->' needs a {'reason' if what == 'not run' else 'fixture'}")
        if what == "not run":
            not_run = arg
        else:
            setup = [s.strip() for s in arg.split(",") if s.strip()]
        k -= 1
    return not_run, setup


def main() -> int:
    total = skipped = 0
    for page in pages():
        for b in blocks(page):
            total += 1
            if b.not_run is not None:
                skipped += 1
                print(f"not run  {b.where:45} {b.kind:6} {b.not_run}")
    print(f"{total} blocks, {total - skipped} run, {skipped} not run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
