"""Every python block and every ``stepdump ...`` shell line of README.md, FORMAT.md and docs/**.md runs.

One test per page: the page's blocks run in order, in this process, in a fresh working folder that
holds the fixture runs (tests/docs_fixtures.py), each block continuing the namespace of the ones
before it. A block marked ``<!-- not run: REASON -->`` is counted, not run; the test fails on the
first unmarked block that raises, and on a shell line that exits with a usage or error code
(2 and above; 1 is a verdict: runs differ, findings found) or whose pipe fails. The markers are
described in tests/docs_blocks.py and docs/architecture.md; `python tests/docs_blocks.py` lists the
blocks that are not run, with their reasons.
"""

from __future__ import annotations

import contextlib
import gc
import io
import re
import shlex
import shutil
import subprocess
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest

import docs_fixtures
from docs_blocks import ROOT, Block, blocks, pages, shell_lines

PAGES = [str(p.relative_to(ROOT)) for p in pages()]
RECORDS_TO = re.compile(r"Recorder\(\s*[\"']([^\"']+)[\"']")


@pytest.fixture(scope="session")
def fixture_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``get(name)``: the folder holding fixture ``name``'s runs, recorded on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            root = tmp_path_factory.mktemp(f"docs-{name}")
            docs_fixtures.build(name, root)
            built[name] = root
        return built[name]

    return get


class Page:
    """The state of one page being run: its folder, namespace and the fixture runs not yet replaced."""

    def __init__(self, folder: Path, fixture_runs: Any) -> None:
        self.folder, self.fixture_runs = folder, fixture_runs
        self.ns: dict[str, Any] = {}
        self.setup: list[str] = []
        self.from_fixture: set[str] = set()
        kinds = stepdump_recorder_types()
        self.before = {id(o) for o in gc.get_objects() if type(o) in kinds}
        self.start(["plain-loop"])

    def start(self, names: list[str]) -> None:
        """A fresh namespace of fixtures ``names`` (plain-loop's runs always lie underneath)."""
        self.close()
        self.setup = names
        for name in ["plain-loop", *[n for n in names if n != "plain-loop"]]:
            src = self.fixture_runs(name)
            for run in sorted((src / "runs").glob("*")) if (src / "runs").exists() else []:
                dst = self.folder / "runs" / run.name
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(run, dst)
                self.from_fixture.add(f"runs/{run.name}")
        if "plain-loop" not in self.setup or self.setup == ["plain-loop"]:
            for alias, target in docs_fixtures.ALIASES.items():
                link = self.folder / "runs" / alias
                if not link.exists():
                    link.symlink_to(target)
                    self.from_fixture.add(f"runs/{alias}")
        # The blocks run as the body of a module (a dataclass looks its module up in sys.modules).
        module = types.ModuleType("docs_page")
        sys.modules["docs_page"] = module
        module.__dict__.update(docs_fixtures.namespace(names))
        self.ns = module.__dict__
        # `stepdump reexecute --entry train:make_step` imports the user's factory from the current folder.
        (self.folder / "train.py").write_text("from docs_fixtures import make_step\n")

    def python(self, block: Block) -> None:
        code = self.rewrite(block.code)
        # A block that records into a fixture run's folder records that run itself: the copy goes
        # (unless it resumes it).
        for target in RECORDS_TO.findall(code):
            if target in self.from_fixture and "resume=True" not in code:
                found = self.folder / target
                found.unlink() if found.is_symlink() else shutil.rmtree(found)
                self.from_fixture.discard(target)
        exec(compile(code, block.where, "exec"), self.ns)

    def shell(self, line: str) -> None:
        from stepdump.cli.main import main

        command, rest = split_pipe(strip_comment(self.rewrite(line)))
        argv = shlex.split(command)[1:]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if code not in (0, 1):
            raise AssertionError(f"`{line}` exited {code}:\n{out.getvalue()[-2000:]}")
        if rest:
            done = subprocess.run(["bash", "-c", rest], input=out.getvalue(), capture_output=True, text=True,
                                  cwd=self.folder, timeout=30)
            if done.returncode != 0:
                raise AssertionError(f"`{line}`: `{rest}` exited {done.returncode} printing {done.stdout!r} "
                                     f"{done.stderr!r} from stepdump's output:\n{out.getvalue()[-2000:]}")

    def rewrite(self, code: str) -> str:
        return code.replace("s3://", "memory://") if "remote" in self.setup else code

    def close(self) -> None:
        """Close what the blocks left open (a Recorder's writer thread must not outlive the page),
        also a Recorder no name holds (``stepdump.Recorder(...)`` as an expression)."""
        kinds = stepdump_recorder_types()
        for value in gc.get_objects():
            if type(value) in kinds and id(value) not in self.before:
                with contextlib.suppress(Exception):
                    value.close()
        sys.modules.pop("docs_page", None)
        if "remote" in self.setup:
            from fsspec.implementations.memory import MemoryFileSystem

            MemoryFileSystem.store.clear()
            MemoryFileSystem.pseudo_dirs[:] = [""]


def stepdump_recorder_types() -> tuple[type, ...]:
    from stepdump.capture.joint import JointRecorder
    from stepdump.capture.recorder import Recorder

    return (Recorder, JointRecorder)


def _unquoted(line: str, ch: str, after_space: bool = False) -> int:
    """Index of the first ``ch`` outside quotes (only one after whitespace if ``after_space``), or -1."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == ch and (not after_space or (i and line[i - 1].isspace())):
            return i
    return -1


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    i = _unquoted(line, "#", after_space=True)
    return (line[:i] if i != -1 else line).rstrip()


def split_pipe(line: str) -> tuple[str, str]:
    """``(the stepdump command, the rest of the pipeline or "")``, split at the first unquoted ``|``."""
    i = _unquoted(line, "|")
    return (line, "") if i == -1 else (line[:i].rstrip(), line[i + 1:].strip())


def run_page(page: str, folder: Path, fixture_runs: Any, text: str | None = None) -> tuple[list[str], list[Block]]:
    """Run one page's blocks in ``folder``: ``(failures, blocks not run)``. Stops at the first failure
    of a page (later blocks would fail only because they continue its namespace)."""
    p = Page(folder, fixture_runs)
    skipped: list[Block] = []
    try:
        for block in blocks(ROOT / page if text is None else Path(page), text):
            if block.not_run is not None:
                skipped.append(block)
                continue
            if block.setup:
                p.start(block.setup)
            try:
                if block.kind == "python":
                    p.python(block)
                else:
                    for line in shell_lines(block.code.split("\n")):
                        p.shell(line)
            except Exception:
                return [f"{block.where}: {traceback.format_exc(limit=-3)}"], skipped
        return [], skipped
    finally:
        p.close()


@pytest.mark.parametrize("page", PAGES)
def test_doc_page_runs(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_runs: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    failures, _ = run_page(page, tmp_path, fixture_runs)
    assert failures == [], "\n".join(failures)


def test_every_not_run_marker_has_a_reason_and_a_block() -> None:
    """A bare marker is refused, and a not-run marker over a fence with nothing to run too."""
    for bad in ("<!-- not run: -->\n```python\nx = 1\n```\n", "<!-- not run: prose -->\n```\nRUN/\n```\n",
                "<!-- setup: -->\n```python\nx = 1\n```\n"):
        with pytest.raises(ValueError):
            blocks(Path("bad.md"), bad)
    listed = [b for page in pages() for b in blocks(page) if b.not_run is not None]
    assert all(b.not_run for b in listed)


@pytest.mark.parametrize("text, fails", [
    ("```python\nimport stepdump\nrun = stepdump.open('runs/exp1')\nrun.tensor('fc1.weight', 10, 'grads')\n```\n", False),
    ("```python\nrun = stepdump.open('runs/exp1')\nrun.export(10, 'ckpt', format='hf-trainer', trainer={})\n```\n", True),
    ("```\nstepdump show runs/exp1 fc1.weight --step 10\n```\n", False),
    ("```\nstepdump show runs/exp1 fc9.weight --step 10\n```\n", True),  # no such tensor: exit 3
    ("```\nstepdump stats runs/exp1 --kind grads | grep -c fc1.weight\n```\n", False),
    ("```\nstepdump stats runs/exp1 --kind grads | grep no.such.tensor\n```\n", True),  # the pipe finds nothing
    ("<!-- not run: a reason -->\n```python\nraise RuntimeError\n```\n", False),
    ("```python\nx = 1\n```\n\n```python\nassert x == 1\n```\n", False),  # blocks continue a namespace
    ("```python\nx = 1\n```\n<!-- setup: plain-loop -->\n```python\nassert 'x' not in dir()\n```\n", False),
    ("```python\nwith stepdump.Recorder('runs/exp1', model, opt) as rec:\n    ...\n```\n", False),
])
def test_the_harness_catches_what_it_should(text: str, fails: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            fixture_runs: Any) -> None:
    """Each kind of problem the docs had fails a page; marked and correct blocks pass."""
    monkeypatch.chdir(tmp_path)
    failures, _ = run_page("synthetic.md", tmp_path, fixture_runs, text)
    assert bool(failures) == fails, failures
