"""Kill it: SIGKILLed recorders, stale and live locks across processes, a reader tailing a live run.

The processes are forked from a fork server (tests/reliability/procs.py) that
imported torch once, so each trial costs a fork rather than a torch import.
`make soak` runs the same crash trials 50+ times (tests/reliability/soak.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from reliability.crash import run_chain
from reliability.procs import (
    Zygote,
    alive,
    iteration,
    make_model_opt,
    read_side,
    step_hashes,
    tensor_hash,
)

import stepdump

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def zygote():
    with Zygote() as z:
        yield z


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
        assert names == {"LOCK", "catalog.sqlite", "segments"}  # the leftovers are gone
    # Anything else in the directory still makes it "not empty and not a run".
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    model, opt = make_model_opt()
    with pytest.raises(stepdump.RunExistsError):
        stepdump.Recorder(other, model, opt, resume=True)
