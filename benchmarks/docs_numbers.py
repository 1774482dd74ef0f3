"""Rewrite the benchmark numbers of docs/performance.md and README.md from benchmarks/results.json.

A number that comes from a benchmark is written in the Markdown as a marked region::

    the lean mode costs <!-- bench: leave_on/lean/A/overhead_pct .1f -->2.3<!-- /bench --> % per step

``leave_on/lean/A/overhead_pct`` is a path into results.json (``/`` between keys, a list index as
a number, ``@median`` / ``@min`` / ``@max`` of a list of numbers; keys may hold dots, as
``torch.save`` does), and the optional format is a
``format()`` spec (``.1f``, ``,.0f``), ``verdict`` (true -> pass, false -> FAIL, null -> n/a) or
``pct`` (a ratio shown as a signed percentage: 1.011 -> +1.1%). Paths and number literals joined by
`` / ``, `` - `` or `` * `` show that arithmetic, left to right (a ratio or a difference the page
derives, a unit conversion)::

    <!-- bench: run/workloads/A/sd-gradlog/ms_per_step - run/workloads/A/none/ms_per_step +.0f -->
The text between the markers is what this script renders; tests/test_docs_numbers.py fails when it
differs from what the committed results.json renders, so a number cannot drift from its data.

Usage: ``python benchmarks/docs_numbers.py`` rewrites the regions (after ``make bench``);
``--check`` only reports the regions that differ (exit 1).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGES = (ROOT / "docs" / "performance.md", ROOT / "README.md")
REGION = re.compile(r"<!-- bench: (?P<path>\S+?(?: [-/*] \S+?)*)(?: (?P<fmt>\S+))? -->(?P<value>.*?)<!-- /bench -->",
                    re.S)
OPS = {"/": lambda a, b: a / b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
REDUCE = {"@median": statistics.median, "@min": min, "@max": max}  # of a list of numbers (a benchmark's repeats)

sys.path.insert(0, str(HERE))
from results_json import DEFAULT, load  # noqa: E402


class MissingNumber(KeyError):
    """A region names a path that results.json does not hold."""


def lookup(data: Any, path: str) -> Any:
    """The value at ``a/b/0/c`` in ``data``."""
    node = data
    for part in path.split("/"):
        if part in REDUCE and isinstance(node, list) and node and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in node):
            node = REDUCE[part](node)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise MissingNumber(f"results.json has no {path!r} (stopped at {part!r}); run `make bench`, or fix the "
                                "marker")
    return node


def value_of(data: Any, expr: str) -> Any:
    """The value of ``path``, or of ``term OP term OP ...`` evaluated left to right (OP one of / - *;
    a term is a path or a number literal such as ``1e6``)."""
    parts = expr.split(" ")
    if len(parts) == 1:
        return lookup(data, expr)

    def term(t: str) -> float:
        try:
            return float(t)
        except ValueError:
            v = lookup(data, t)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise MissingNumber(f"{expr!r}: {t!r} is {v!r}, not a number")
        return v

    value = term(parts[0])
    for op, t in zip(parts[1::2], parts[2::2]):
        value = OPS[op](value, term(t))
    return value


def show(value: Any, spec: str | None) -> str:
    if spec == "pct":
        return format((value - 1) * 100, "+.1f") + "%"
    if spec == "verdict":
        return "n/a" if value is None else "pass" if value else "FAIL"
    if isinstance(value, (dict, list)):
        raise MissingNumber(f"a region renders one value, not a {type(value).__name__}")
    return format(value, spec or "")


def render(text: str, data: Any) -> str:
    """``text`` with every marked region's value rendered from ``data``; the rest unchanged."""
    def one(m: re.Match[str]) -> str:
        fmt = f" {m['fmt']}" if m["fmt"] else ""
        return f"<!-- bench: {m['path']}{fmt} -->{show(value_of(data, m['path']), m['fmt'])}<!-- /bench -->"

    return REGION.sub(one, text)


def stale(page: Path, data: Any) -> list[str]:
    """``path: shown -> rendered`` for each region of ``page`` that differs from the data."""
    out = []
    for m in REGION.finditer(page.read_text()):
        want = show(value_of(data, m["path"]), m["fmt"])
        if m["value"] != want:
            out.append(f"{page.name}: {m['path']}: {m['value']!r} -> {want!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=DEFAULT, help="results file (default benchmarks/results.json)")
    ap.add_argument("--check", action="store_true", help="only list the regions that differ; exit 1 if any")
    args = ap.parse_args(argv)
    data = load(args.json)
    if args.check:
        diffs = [d for page in PAGES for d in stale(page, data)]
        print("\n".join(diffs) or "every marked number matches results.json")
        return 1 if diffs else 0
    for page in PAGES:
        text = page.read_text()
        new = render(text, data)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
