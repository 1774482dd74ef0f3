"""Shared pytest setup for the stepdump tests."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

# Let test files import tests/helpers.py whatever the import mode.
sys.path.insert(0, os.path.dirname(__file__))


def _scratch_in_memory(root: str = "/dev/shm", need: int = 2 << 30) -> None:
    """Put pytest's tmp_path directories on tmpfs when there is room (``PYTEST_DEBUG_TEMPROOT``,
    which pytest reads when a test first asks for a tmp_path; one set by the caller wins).

    The tests record hundreds of throwaway runs: a 5-step run takes ~20 ms on tmpfs and ~120 ms
    on this machine's disk, where SQLite's and the catalog's fsyncs dominate. What the tests
    check is the same on either; the disk-full tests mount a tmpfs of their own anyway.
    """
    if "PYTEST_DEBUG_TEMPROOT" in os.environ:
        return
    try:
        free = os.statvfs(root)
    except OSError:
        return
    if os.access(root, os.W_OK) and free.f_bavail * free.f_frsize >= need:
        os.environ["PYTEST_DEBUG_TEMPROOT"] = root


_scratch_in_memory()


# Tiny models on a 2-core machine that also runs the writer thread: one intra-op thread
# is faster, and keeps numerics independent of the core count (module-scoped fixtures too).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_and_no_leaked_writers():
    """Seed every test (one intra-op thread), and fail one that leaves a Recorder's writer thread running."""
    torch.set_num_threads(1)  # as above, whatever the test before set
    torch.manual_seed(0)
    yield
    deadline = time.monotonic() + 5
    while True:
        alive = [t for t in threading.enumerate() if t.name == "stepdump-writer" and t.is_alive()]
        if not alive:
            return
        gc.collect()  # an unreferenced Recorder closes itself through its finalizer
        if time.monotonic() > deadline:
            pytest.fail(f"{len(alive)} stepdump writer thread(s) still running after the test: close your Recorders")
        time.sleep(0.05)


@dataclass(frozen=True)
class CliResult:
    """What one ``stepdump`` command line gave: its exit code and everything it printed."""

    code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args, ok=0)`` runs ``stepdump ARGS`` in this process through ``stepdump.cli.main.main``
    and returns a CliResult, failing the test unless the exit code is ``ok`` (``ok=None``: any).

    In-process is ~1 s faster per call than a subprocess; tests/test_cli.py keeps one subprocess
    smoke test of the installed entry point. The console is 200 columns wide, as in a wide terminal.
    """
    from stepdump.cli.main import main

    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: object, ok: int | None = 0) -> CliResult:
        capsys.readouterr()  # only this command's output
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse: --help, --version and usage errors exit
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out, err = capsys.readouterr()
        if ok is not None:
            assert code == ok, f"stepdump {' '.join(map(str, args))}: exit {code}, not {ok}\n{out}{err}"
        return CliResult(int(code), out, err)

    return run


@pytest.fixture(scope="module")
def browser():
    """A headless chromium (playwright) shared by a module's report page tests, which open their
    pages in it with helpers.open_page. Module-scoped, not session: test_report.py and
    test_report_live.py start playwright themselves, and two sync playwrights cannot be open at once."""
    from playwright.sync_api import sync_playwright
    from test_report import CHROMIUM_ARGS, _chromium

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def zygote():
    """The reliability tests' fork server (tests/reliability/procs.py): one interpreter with torch
    and stepdump imported, forking each child that is then killed. Session-scoped: it holds no
    state between spawns, so test_reliability_crash.py and test_reliability_kill_modes.py share
    one rather than each starting its own."""
    from reliability.procs import Zygote

    with Zygote() as z:
        yield z


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every SQL statement a catalog connection opened during the test runs, as SQLite expands it
    (an ``executemany`` shows once per row: each row is a step of its own, and a GIL hand-off)."""
    import sqlite3

    seen: list[str] = []
    real = sqlite3.connect

    def connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        con = real(*args, **kwargs)  # type: ignore[arg-type]
        con.set_trace_callback(seen.append)
        return con

    monkeypatch.setattr(sqlite3, "connect", connect)
    return seen
