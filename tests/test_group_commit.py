"""Group commit (issue 25): stats-only steps are committed together, not one transaction each.

On a millisecond step every SQLite call of the writer thread was a GIL hand-off that stalled the
training thread (capture/writer.py's module docstring). These tests pin what the change may and
may not do: fewer statements per stats-only step; every step still committed, in order, with the
time it was written; a step with bytes, a ``durability="fsync"`` run and ``close()`` commit at
once; an idle writer commits what it holds within ``COMMIT_WINDOW``; a failure still names the
first step that did not commit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import catalog_sql, tiny_model, train_logging

import stepdump
from stepdump.capture import writer as writer_mod
from stepdump.store.catalog import CatalogWriter





def _steps_rows(statements: list[str], table: str) -> list[str]:
    return [s for s in statements if s.startswith(f"INSERT OR REPLACE INTO {table}(")]


def test_stats_only_steps_share_their_statements(tmp_path: Path, statements: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)  # steps as fast as a loaded machine can make them
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 40
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        train_logging(rec, model, opt, steps)
    commits = sum(s == "COMMIT" for s in statements)
    step_inserts = _steps_rows(statements, "steps")
    tensor_inserts = _steps_rows(statements, "tensors")
    # One transaction per step before: >= 40 commits and 40 step and 40 tensor statements. Now the
    # steps that commit at once are step 0 (no commit before it) and the step whose message sets meta
    # (the layout once the optimizer state exists); the rest wait for the final record at close().
    assert commits <= 6, commits
    assert len(step_inserts) <= 4 and len(tensor_inserts) <= 4, (len(step_inserts), len(tensor_inserts))
    # ...and every step is there, once, in order, each with the time it was written (not its commit's)
    rows = catalog_sql(tmp_path / "run", "SELECT step, level, time FROM steps ORDER BY step")
    assert [r[0] for r in rows] == list(range(steps + 1))  # + the final record
    times = [r[2] for r in rows[:steps]]
    assert times == sorted(times) and len(set(times)) == len(times)
    run = stepdump.open(tmp_path / "run")
    assert run.scalars()["loss"].dropna().tolist() == [float(t) for t in range(steps)]
    assert len(run.stats(steps=steps - 1)) == len(run.stats(steps=0)) > 0


def test_a_slow_loop_commits_every_step(tmp_path: Path, statements: list[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps further apart than COMMIT_WINDOW wait for nothing: each commits as it comes."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 0.0)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        train_logging(rec, model, opt, 6)
    assert len(_steps_rows(statements, "steps")) >= 6 and sum(s == "COMMIT" for s in statements) >= 6


def test_each_step_commits_alone_with_fsync_and_for_bytes(tmp_path: Path, statements: list[str]) -> None:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "fsync", model, opt, every=None, stats_every=1, durability="fsync") as rec:
        train_logging(rec, model, opt, 6)
    assert sum(s == "COMMIT" for s in statements) >= 6
    statements.clear()
    with stepdump.Recorder(tmp_path / "full", model, opt, every=1) as rec:  # every step has bytes
        train_logging(rec, model, opt, 6)
    assert sum(s == "COMMIT" for s in statements) >= 6


def test_an_idle_writer_commits_what_it_holds(tmp_path: Path) -> None:
    """A live reader sees a stats-only step within COMMIT_WINDOW (plus slack), without close()."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run"
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1) as rec:
        train_logging(rec, model, opt, 3)
        deadline = time.monotonic() + writer_mod.COMMIT_WINDOW + 10  # slack for a loaded machine
        seen: list[Any] = []
        while time.monotonic() < deadline:
            seen = catalog_sql(path, "SELECT step FROM steps ORDER BY step")
            if len(seen) == 3:
                break
            time.sleep(0.02)
        assert [s for (s,) in seen] == [0, 1, 2]
        # and a step arriving after a pause starts a new window: it commits too
        train_logging(rec, model, opt, 1)
        while time.monotonic() < deadline and len(seen) < 4:
            seen = catalog_sql(path, "SELECT step FROM steps ORDER BY step")
            time.sleep(0.02)
        assert len(seen) == 4


def test_a_failed_group_names_its_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A group commit that fails takes every held step with it: the warning names the first of
    them as where recording stopped, and the run holds none of them (step 0, committed at once, stays)."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)  # hold every stats-only step until close()

    def full_disk(self: Any, rows: Any) -> None:
        raise OSError(28, "No space left on device")

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run"
    rec = stepdump.Recorder(path, model, opt, every=None, stats_every=1)
    try:
        # Step 0 commits at once (no commit before it), and only then do steps 1..4 come, to be held: a
        # writer that found all five waiting (a slow machine) would commit them together.
        train_logging(rec, model, opt, 1)
        deadline = time.monotonic() + 30
        while catalog_sql(path, "SELECT count(*) FROM steps") != [(1,)] and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer may not have taken step 0 yet
        assert catalog_sql(path, "SELECT step FROM steps") == [(0,)]
        train_logging(rec, model, opt, 4)
        monkeypatch.setattr(CatalogWriter, "add_steps", full_disk)
        with caplog.at_level("WARNING"):
            rec.close()  # the final record's commit inserts the held steps first, and fails
    finally:
        rec.close()  # (a no-op once closed) no writer left running when an assertion above fails
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "stopped at step 1" in said and "No space left on device" in said, said
    assert catalog_sql(path, "SELECT step FROM steps") == [(0,)]


def test_held_gradient_log_steps_write_their_bytes_before_the_commit_that_names_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient log's steps (grads stored: bytes below full level) are held like stats-only ones;
    at each COMMIT every blob row it makes visible points inside what its segment file holds."""
    import re
    import sqlite3

    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)  # held until a keyframe or close()
    path = tmp_path / "run"
    seg_dir = path / "segments"
    log: list[tuple[str, Any]] = []  # ("blobs", [(id, segment, offset, length)]) / ("commit", {file: size})
    real = sqlite3.connect

    def trace(sql: str) -> None:
        if sql.startswith("INSERT INTO blobs("):
            rows = re.findall(r"\((\d+), (\d+), (\d+), (\d+), '", sql)
            log.append(("blobs", [tuple(int(v) for v in r) for r in rows]))
        elif sql == "COMMIT":  # before SQLite commits: what the files hold at that moment
            log.append(("commit", {f.name: f.stat().st_size for f in seg_dir.glob("*.seg")} if seg_dir.exists() else {}))

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        con = real(*args, **kwargs)
        con.set_trace_callback(trace)
        return con

    monkeypatch.setattr(sqlite3, "connect", connect)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(path, model, opt, gradient_log=8, codec="zstd") as rec:
        train_logging(rec, model, opt, 12)
    monkeypatch.setattr(sqlite3, "connect", real)
    names = dict(catalog_sql(path, "SELECT id, key FROM segments"))
    pending: list[tuple[int, int, int, int]] = []
    held_commits = 0
    for what, value in log:
        if what == "blobs":
            pending.extend(value)
            continue
        steps_in_it = len(pending)
        for _bid, seg, offset, length in pending:
            name = names[seg].rsplit("/", 1)[-1]
            assert offset + length <= value.get(name, 0), (names[seg], offset, length, value)
        held_commits += steps_in_it > 0
        pending = []
    assert pending == [] and held_commits >= 2
    # Steps 2..7 and 9..11 were held (a commit a moment before); every step is in the run, read back.
    assert [s for (s,) in catalog_sql(path, "SELECT step FROM steps WHERE level < 2 ORDER BY step")] == \
        [s for s in range(12) if s % 8]
    transactions = sum(1 for what, _ in log if what == "commit")
    assert transactions < 12, transactions
    with stepdump.open(path) as run:
        assert stepdump.verify(run).ok  # every stored grad's bytes against its fingerprint


class _GatedWriter:
    """The writer stopped before it writes step ``at`` until :attr:`gate` is set (the steps after it
    wait in its mailbox meanwhile), and the steps each commit held (:attr:`commits`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        import threading

        self.gate, self.blocked = threading.Event(), threading.Event()
        self.commits: list[list[int]] = []
        self.writer: Any = None
        write, commit = writer_mod.Writer._write, writer_mod.Writer._commit_held

        def gated_write(writer: Any, msg: Any) -> None:
            if msg.step == at and not self.gate.is_set():
                self.writer = writer
                self.blocked.set()
                self.gate.wait(30)
            write(writer, msg)

        def counted_commit(writer: Any) -> None:
            self.commits.append([s for s, *_ in writer._held_steps])
            commit(writer)

        monkeypatch.setattr(writer_mod.Writer, "_write", gated_write)
        monkeypatch.setattr(writer_mod.Writer, "_commit_held", counted_commit)

    def wait_for_commit_of(self, step: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(step in c for c in self.commits):
            time.sleep(0.01)

    def nonempty(self) -> list[list[int]]:
        return [c for c in self.commits if c]


@pytest.mark.parametrize("mode", [{"every": None, "stats_every": 1}, {"gradient_log": 64}])
def test_steps_taken_from_the_mailbox_together_commit_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               mode: dict[str, Any]) -> None:
    """Steps the writer finds waiting together commit in one transaction, the first of them included.
    (It committed the first at once when the last commit was a window old, and held the rest for
    another window: two commits a window where one does, half of a small step's catalog cost.)"""
    window = 0.5
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", window)
    gated = _GatedWriter(monkeypatch, at=5)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, **mode) as rec:
        train_logging(rec, model, opt, 5)
        train_logging(rec, model, opt, 10)  # steps 5-14: posted while the writer waits at step 5
        assert gated.blocked.wait(30)
        due = gated.writer._due  # steps 1-4 are held, to commit a window after the last commit
        assert due is not None
        time.sleep(max(0.0, due - time.monotonic()) + 0.05)  # the writer goes on once they are due
        gated.commits.clear()
        gated.gate.set()
        gated.wait_for_commit_of(14)
        commits = gated.nonempty()  # (steps held before step 5 commit with them)
        assert len(commits) == 1 and commits[0][-10:] == list(range(5, 15)), commits
    assert [s for (s,) in catalog_sql(tmp_path / "run", "SELECT step FROM steps ORDER BY step")] == list(range(16))


def test_a_steady_loop_commits_once_a_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop faster than the window commits about once a window: commits are at least a window
    apart but for step 0, the step that sets the layout's meta and close(). (When its timed wake-up
    took mail that committed the steps due, the writer committed the newer steps it had just taken
    at once as well: two commits a window.)"""
    window = 0.1
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", window)
    commits: list[float] = []
    commit = writer_mod.Writer._commit_held

    def counted_commit(self: Any) -> None:
        if self._held_steps:
            commits.append(time.monotonic())
        commit(self)

    monkeypatch.setattr(writer_mod.Writer, "_commit_held", counted_commit)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        start = time.monotonic()
        steps = 0
        while time.monotonic() - start < 25 * window:
            train_logging(rec, model, opt, 1)
            steps += 1
        elapsed = time.monotonic() - start
    assert steps > 30  # many steps a window
    assert len(commits) <= elapsed / window + 4, (len(commits), elapsed / window)  # (before: 1.4 a window)


def test_a_burst_after_a_pause_commits_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps the writer finds waiting together after a quiet spell (nothing held, the last commit
    long ago) commit together too. (Their first two committed at once, the rest a window later:
    how long to wait for the rest was counted from the last commit, long past.)"""
    window = 0.2
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", window)
    gated = _GatedWriter(monkeypatch, at=3)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        train_logging(rec, model, opt, 3)
        gated.wait_for_commit_of(2)  # steps 0-2 committed: nothing held
        time.sleep(3 * window)  # the last commit is long past
        train_logging(rec, model, opt, 10)  # steps 3-12, posted while the writer waits at step 3
        assert gated.blocked.wait(30)
        gated.commits.clear()
        gated.gate.set()
        gated.wait_for_commit_of(12)
        assert gated.nonempty() == [list(range(3, 13))]
