"""Kill it: SIGKILLed recorders, stale and live locks across processes, a reader tailing a live run.

The processes are forked from a fork server (tests/reliability/procs.py) that
imported torch once, so each trial costs a fork rather than a torch import.
`make soak` runs the same crash trials 50+ times (tests/reliability/soak.py).
"""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest
import torch
from reliability import txkill
from reliability.crash import run_chain
from reliability.procs import (
    alive,
    iteration,
    make_model_opt,
    read_side,
    step_hashes,
    tensor_hash,
)

import stepdump

pytestmark = pytest.mark.timeout(240)


def _wait_line(side, event, pid, log, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        lines = [x for x in read_side(side) if x.get("event") == event]
        if lines:
            return lines[0]
        assert alive(pid), f"child died before {event!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"child did not reach {event!r}"
        time.sleep(0.01)


def test_sigkill_at_random_moments_then_resume(zygote, tmp_path):
    """Six kills of one run at random moments (plus a last child that closes normally).

    After every kill: the store opens, verify() is ok, visible steps are a
    contiguous prefix and read back bit-exact against the hashes the child
    fsynced before each optimizer.step(), the dead writer's lock does not block,
    and the next child's Recorder(resume=True) starts right after the last
    committed step (see tests/reliability/crash.py for every check).
    """
    result = run_chain(zygote, tmp_path, trials=6, seed=20240611, max_delay=0.6)
    assert result.trials == 6
    assert result.steps >= 15  # the final child alone records 15 steps
    print(f"\ncrash trials: {result}")


def test_a_live_writer_in_another_process_locks_the_run_and_its_death_frees_it(zygote, tmp_path):
    run_dir, side, log = tmp_path / "run", tmp_path / "side.jsonl", tmp_path / "child.log"
    pid = zygote.spawn("hold_lock", log, run_dir=str(run_dir), side=str(side), steps=3)
    try:
        held = _wait_line(side, "holding", pid, log)
        assert held["step"] == 3
        with stepdump.open(run_dir) as run:
            assert run.live
            deadline = time.monotonic() + 30
            while run.steps != [0, 1, 2]:  # the child's writer thread commits them in the background
                assert time.monotonic() < deadline, run.steps
                time.sleep(0.01)
        model, opt = make_model_opt()
        with pytest.raises(stepdump.RunLockedError, match=f"another Recorder \\(pid {pid} on "):
            stepdump.Recorder(run_dir, model, opt, resume=True)
        with pytest.raises(stepdump.RunLockedError, match="another Recorder"):
            stepdump.Recorder(run_dir, model, opt)
    finally:
        zygote.kill(pid)
    # The holder died without closing: its LOCK file is still there, its flock is not.
    assert (run_dir / "LOCK").exists()
    with stepdump.open(run_dir) as run:
        assert not run.live
        assert stepdump.verify(run).ok
        run.restore(2, model, opt)
    iteration(model, opt, 2)
    opt.step()
    with stepdump.Recorder(run_dir, model, opt, resume=True) as rec:
        assert rec.step == 3
        for t in range(3, 5):
            loss = iteration(model, opt, t)
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(run_dir) as run:
        assert run.steps == list(range(6)) and run.meta["final_step"] == 5  # 5: close()'s final record
        assert stepdump.verify(run).ok
        assert "pid" in (run_dir / "LOCK").read_text()


def test_a_reader_in_another_process_sees_only_complete_steps(zygote, tmp_path):
    """A child tails the run while this process records it: each step it sees is complete and exact."""
    torch.set_num_threads(1)
    run_dir, side, log, stop = tmp_path / "run", tmp_path / "tail.jsonl", tmp_path / "tail.log", tmp_path / "stop"
    pid = zygote.spawn("tail", log, run_dir=str(run_dir), side=str(side), stop_file=str(stop))
    steps = 250
    want = {}
    try:
        model, opt = make_model_opt()
        with stepdump.Recorder(run_dir, model, opt, codec="zstd") as rec:
            _wait_line(side, "tailing", pid, log)
            for t in range(steps):
                loss = iteration(model, opt, t)
                want[t] = step_hashes(model, opt)
                opt.step()
                rec.log(loss=loss)
                time.sleep(0.003)
            # close() adds the final record: params and optimizer state after the last update, no grads
            want[steps] = {k: v for k, v in step_hashes(model, opt).items() if not k.startswith("grads\t")}
        stop.touch()
        done = _wait_line(side, "done", pid, log, timeout=120)
    finally:
        if alive(pid):
            zygote.kill(pid)
    assert done["errors"] == []
    seen = {int(k): v for k, v in done["seen"].items()}
    assert sorted(seen) == list(range(steps + 1))
    for t in range(steps + 1):
        assert seen[t] == want[t], f"step {t}: the reader got other tensors or values than were recorded"
    # It really read while the run was being written: it saw the run grow step by step.
    partial = [n for n in done["views"] if 0 < n < steps]
    assert len(set(partial)) >= 10, f"the reader never saw the run half-written: {sorted(set(done['views']))[:20]}"
    print(f"\ntail reader: {len(done['views'])} passes, {len(set(partial))} distinct partial views, "
          f"{done['reads']} tensor reads")


def test_a_recorder_killed_before_its_catalog_existed_leaves_a_startable_directory(tmp_path):
    """What a kill during Recorder creation can leave (LOCK, a half-built catalog) is not a run and
    does not stop a new Recorder, with or without resume=True."""
    for resume in (False, True):
        run_dir = tmp_path / f"run-{resume}"
        run_dir.mkdir()
        (run_dir / "LOCK").write_text("pid 1 on elsewhere\n")
        (run_dir / "catalog.sqlite.partial").write_bytes(b"SQLite format 3\x00" + bytes(100))
        (run_dir / "catalog.sqlite.partial-journal").write_bytes(bytes(10))
        with pytest.raises(stepdump.NotARunError):
            stepdump.open(run_dir)
        model, opt = make_model_opt()
        with stepdump.Recorder(run_dir, model, opt, resume=resume) as rec:
            iteration(model, opt, 0)
            opt.step()
            assert rec.step == 1
        with stepdump.open(run_dir) as run:
            assert run.steps == [0, 1] and run.meta["final_step"] == 1
            assert tensor_hash(run.tensor("0.weight", 0))[:2] == ["float32", [32, 16]]
        names = {p.name for p in run_dir.iterdir()} - {"catalog.sqlite-wal", "catalog.sqlite-shm"}
        assert names == {"LOCK", "catalog.sqlite", "segments", "stats.parquet"}  # the leftovers are gone
    # Anything else in the directory still makes it "not empty and not a run".
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    model, opt = make_model_opt()
    with pytest.raises(stepdump.RunExistsError):
        stepdump.Recorder(other, model, opt, resume=True)


# -- a kill inside each write transaction of the catalog (issue 22, item 10) ----------------------


@pytest.fixture(scope="module")
def txn_bases(zygote, tmp_path_factory):
    """The reference hashes, and the runs the rows start from: closed, and crashed (see txkill.py)."""
    work = tmp_path_factory.mktemp("txn-bases")
    want = txkill.reference(12)
    txkill.record_base(work / "closed")
    crashed = work / "crashed"
    shutil.copytree(work / "closed", crashed)
    _kill_in(zygote, crashed, work, txkill.Kill(txkill.STEP + "8, 2"), {})
    return want, {"closed": work / "closed", "crashed": crashed}


def _kill_in(zygote, run_dir, work, kill, child) -> None:
    _wait_killed(*_spawn_kill(zygote, run_dir, work, kill, child))


def _spawn_kill(zygote, run_dir, work, kill, child):
    side, log = work / f"{run_dir.name}.side", work / f"{run_dir.name}.log"
    pid = zygote.spawn("txn", log, run_dir=str(run_dir), side=str(side), kill=dataclasses.asdict(kill), **child)
    return pid, side, log


def _wait_killed(pid, side, log) -> None:
    """The child died at its kill point: it got ready to write, never closed, raised nothing."""
    deadline = time.monotonic() + 120
    while alive(pid):
        assert time.monotonic() < deadline, "the child neither died nor finished"
        time.sleep(0.005)
    events = [x.get("event") for x in read_side(side)]
    text = log.read_text()
    assert "armed" in events and "closed" not in events and "Traceback" not in text, (events, text[-3000:])


@pytest.fixture(scope="module")
def txn_killed(zygote, txn_bases, tmp_path_factory):
    """Every row's child, all forked at once (they run side by side): row id -> (run dir, follower,
    the child's pid, side file and log); and "ro": one more hot journal, left alone."""
    work = tmp_path_factory.mktemp("txn-rows")
    _, bases = txn_bases
    out = {}
    for i, row in enumerate([*txkill.ROWS, None]):
        base, kill, child = ("closed", txkill.Kill(txkill.DROP + "3"), {"at": 3}) if row is None else \
            (row.base, row.kill, row.child)
        run_dir = work / f"run{i:02d}"
        if base == "empty":
            run_dir.mkdir()
        else:
            shutil.copytree(bases[base], run_dir)
        follower = stepdump.open(run_dir) if row is not None and row.first == "follower" else None
        out["ro" if row is None else row.id] = (run_dir, follower, *_spawn_kill(zygote, run_dir, work, kill, child))
    yield out
    for _, follower, *_ in out.values():
        if follower is not None:
            follower.close()


@pytest.mark.parametrize("row", txkill.ROWS, ids=[r.id for r in txkill.ROWS])
def test_sigkill_inside_each_catalog_transaction(txn_bases, txn_killed, row):
    """SIGKILL inside one write transaction of the catalog (a one-page cache makes SQLite write
    its pages before COMMIT): afterwards open, verify (API and CLI), a follower that had the run
    open and Recorder(resume=True) all work, the run is as of the last committed transaction,
    and every step stored in full reads back bit-exact (tests/reliability/txkill.py)."""
    from stepdump.cli.main import main

    want, _ = txn_bases
    run_dir, follower, *child = txn_killed[row.id]
    _wait_killed(*child)
    if row.left is not None:  # the kill left what the row is about
        side = run_dir / f"catalog.sqlite-{row.left}"
        assert side.exists() and side.stat().st_size > 0, sorted(p.name for p in run_dir.iterdir())
    if row.full is None:
        with pytest.raises(stepdump.NotARunError):
            stepdump.open(run_dir)
    else:
        if follower is not None:
            assert follower.steps == row.full
        if row.first == "cli":
            assert main(["verify", str(run_dir)]) == 0
        if row.first == "resume":
            txkill.resume_and_finish(run_dir, want)
        else:
            with stepdump.open(run_dir) as run:
                assert stepdump.verify(run).ok
                txkill.check_steps(run, want, row.full, row.final)
                assert run.all_steps == (row.all_steps or row.full)
                assert len(run.meta.get("history", [])) == row.history
                assert "recording_stopped" not in run.meta
    assert not (run_dir / "catalog.sqlite-journal").exists()  # rolled back by whoever opened it first
    if row.first != "resume":
        txkill.resume_and_finish(run_dir, want)


def test_a_hot_journal_where_it_cannot_be_rolled_back_says_what_happened(txn_bases, txn_killed, tmp_path, capsys):
    """On a read-only mount nobody can roll the journal back: every opener says what happened and
    what to do (InterruptedWriteError, CLI exit 5: not the corruption code 4, never "damaged");
    opened once where it is writable, the run is back, bit-exact."""
    from test_reliability_hostile_catalog import _read_only_mount

    from stepdump.cli.main import main

    want, _ = txn_bases
    run_dir, _, *child = txn_killed["ro"]
    _wait_killed(*child)
    assert (run_dir / "catalog.sqlite-journal").stat().st_size > 0
    with _read_only_mount(run_dir, tmp_path / "ro") as ro:
        with pytest.raises(stepdump.InterruptedWriteError) as err:
            stepdump.open(ro)
        msg = str(err.value)
        assert "interrupted in the middle of a write" in msg and "catalog.sqlite-journal" in msg
        assert "open the run once as a user who can write" in msg and "damaged" not in msg
        capsys.readouterr()
        assert main(["verify", str(ro)]) == 5
        assert "interrupted in the middle of a write" in capsys.readouterr().err
    with stepdump.open(run_dir) as run:  # writable: rolled back on open
        assert stepdump.verify(run).ok
        txkill.check_steps(run, want, txkill.CLOSED, txkill.BASE_STEPS)
    assert not (run_dir / "catalog.sqlite-journal").exists()
