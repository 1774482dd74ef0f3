"""Every example of ``stepdump --help``, of each ``stepdump CMD --help`` and README's demo block runs
on the demo run: `stepdump demo --out demo-run` then the example, as a person new to stepdump tries them.

The demo runs once for the module, with a small ``--steps`` (every example uses steps below it); a
``stepdump demo`` example is run with that ``--steps`` too. Each example is run in this process
through ``stepdump.cli.main.main``, in the folder holding ``demo-run`` (and ``demo-run-2`` to
``demo-run-4``, the same training again, which diff's examples compare it with), in the order its help lists them; what follows the stepdump command (``|
grep ...``, ``> file``, ``&& echo ...``) runs in bash on what it printed. An example must exit 0 and
its last stage must print something (or write a non-empty file): a ``grep`` that matches nothing on
the demo run is an example that shows nothing. ``report --watch`` serves until stopped: it runs
as a process, and the page it serves is fetched once.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from docs_blocks import ROOT, blocks

from stepdump.cli.main import COMMANDS, EPILOG, build_parser

STEPS = 20  # the demo's optimizer steps here; the examples use steps 0..STEPS


def help_examples(command: str | None) -> list[str]:
    """The ``stepdump ...`` lines under "examples:" of ``stepdump [COMMAND] --help``, as printed."""
    parser = build_parser(command)
    if command is not None:
        sub = next(a for a in parser._actions if a.dest == "command")
        parser = sub.choices[command]  # type: ignore[attr-defined]
    text = parser.format_help()
    assert "examples:" in text, f"stepdump {command or ''} --help shows no examples"
    out: list[str] = []
    for line in text.split("examples:", 1)[1].split("\n")[1:]:
        if not line.strip():
            break
        if line.strip().startswith("stepdump "):
            out.append(line.strip())
    assert out, f"stepdump {command or ''} --help: no example under 'examples:'"
    return out


def readme_examples() -> list[str]:
    """README's shell lines that use the demo run."""
    lines = [ln for b in blocks(ROOT / "README.md") if b.kind == "shell" for ln in b.code.split("\n")]
    return [ln for ln in lines if "demo-run" in ln]


def _unquoted(line: str, token: str) -> int:
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif line.startswith(token, i):
            return i
    return -1


def split_example(line: str) -> tuple[list[str], str]:
    """``(stepdump's argv, what follows it in the shell)`` of one example line, comment removed."""
    hash_ = _unquoted(line, " #")
    line = line[:hash_].rstrip() if hash_ != -1 else line
    cut = min((i for i in (_unquoted(line, t) for t in (" | ", " > ", " && ")) if i != -1), default=len(line))
    return shlex.split(line[:cut])[1:], line[cut:].strip()


def _demo_argv(argv: list[str]) -> list[str]:
    """A ``stepdump demo`` example with this module's ``--steps``."""
    if "--steps" in argv:
        i = argv.index("--steps")
        return [*argv[:i + 1], str(STEPS), *argv[i + 2:]]
    return [*argv, "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``demo-run`` to ``demo-run-4``: `stepdump demo` four times, ``STEPS`` steps each."""
    from stepdump.cli.main import main

    folder = tmp_path_factory.mktemp("demo")
    for out in ("demo-run", "demo-run-2", "demo-run-3", "demo-run-4"):
        assert main(["demo", "--out", str(folder / out), "--steps", str(STEPS), "--no-report"]) == 0
    return folder


def run_example(line: str, folder: Path, cli) -> None:  # type: ignore[no-untyped-def]
    argv, rest = split_example(line)
    if argv[:1] == ["demo"]:
        argv = _demo_argv(argv)
    if "--watch" in argv:
        _watch(argv, folder)
        return
    res = cli(*argv, ok=None)
    assert res.code == 0, f"`{line}` exited {res.code}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    if not rest:
        assert res.stdout.strip(), f"`{line}` printed nothing"
        return
    if rest.startswith(">"):
        target = folder / rest[1:].strip()
        target.write_text(res.stdout)
        assert res.stdout.strip(), f"`{line}` wrote an empty {target.name}"
        return
    script = rest[2:].strip() if rest.startswith("&&") else rest[1:].strip()
    done = subprocess.run(["bash", "-o", "pipefail", "-c", script], input=res.stdout, capture_output=True,
                          text=True, cwd=folder, timeout=60, check=False)
    assert done.returncode == 0, f"`{line}`: `{script}` exited {done.returncode}: {done.stderr}"
    assert done.stdout.strip(), f"`{line}` printed nothing: `{script}` on stepdump's output\n{res.stdout[-2000:]}"


def _watch(argv: list[str], folder: Path) -> None:
    """``report --watch``: serve on a free port, fetch the page once, stop."""
    if "--port" in argv:
        i = argv.index("--port")
        argv = [*argv[:i], *argv[i + 2:]]
    exe = Path(sys.executable).with_name("stepdump")
    proc = subprocess.Popen([str(exe), *argv, "--port", "0"], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://\S+", line)
        assert url, f"stepdump {' '.join(argv)} printed {line!r}, no URL"
        with urllib.request.urlopen(url.group(0), timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read(4096).lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("command", [None, *COMMANDS], ids=lambda c: c or "stepdump")
def test_every_help_example_runs_on_the_demo_run(command: str | None, demo_folder: Path, cli,  # type: ignore[no-untyped-def]
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(demo_folder)
    for line in help_examples(command):
        run_example(line, demo_folder, cli)


def test_readme_demo_examples_run_on_the_demo_run(demo_folder: Path, cli,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(demo_folder)
    lines = readme_examples()
    assert len(lines) >= 5, "README shows the demo run's commands"
    for line in lines:
        run_example(line, demo_folder, cli)


def test_main_epilog_is_what_help_prints() -> None:
    """The examples of ``stepdump --help`` are the ones in main.EPILOG (the test above reads the help)."""
    assert all(line in EPILOG for line in help_examples(None))


@pytest.mark.parametrize("line, argv, rest", [
    ("stepdump ls demo-run | grep x | cut -f2", ["ls", "demo-run"], "| grep x | cut -f2"),
    ("stepdump check demo-run --csv > f.csv   # note", ["check", "demo-run", "--csv"], "> f.csv"),
    ("stepdump verify demo-run && echo intact", ["verify", "demo-run"], "&& echo intact"),
    ("stepdump scalars demo-run | awk -F'\\t' '$2 > 2'", ["scalars", "demo-run"], "| awk -F'\\t' '$2 > 2'"),
    ("stepdump show demo-run 'a #b' --step 1", ["show", "demo-run", "a #b", "--step", "1"], ""),
])
def test_split_example(line: str, argv: list[str], rest: str) -> None:
    assert split_example(line) == (argv, rest)


def test_format_versions_said_are_the_real_ones(demo_folder: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """README names stepdump.FORMAT_VERSION as it is, and `info` prints the store's own version."""
    import json

    import stepdump

    readme = (ROOT / "README.md").read_text()
    assert f"`stepdump.FORMAT_VERSION` is {stepdump.FORMAT_VERSION}" in readme
    assert "version 1." not in readme  # the old, wrong "the on-disk format, version 1."
    with stepdump.open(demo_folder / "demo-run") as run:
        own = run.format_version
    assert json.loads(cli("info", demo_folder / "demo-run", "--json").stdout)["format_version"] == own
    assert f"store format\t{own}\n" in cli("info", demo_folder / "demo-run").stdout
