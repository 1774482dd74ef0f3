"""Crashes and write failures: a killed recorder loses at most the step in flight (issue 2 f),
and a failing writer surfaces as WriterError without damaging committed steps."""

from __future__ import annotations

import errno
import json
import textwrap
import time

import pytest
import torch
from helpers import (
    assert_final_record,
    assert_run_matches,
    assert_same,
    regression_batch,
    sigkill_child_when,
    snapshot,
)
from reliability.faults import FullDisk
from torch import nn

import stepdump

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    import stepdump

    run_dir, side = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def batch(t):
        g = torch.Generator().manual_seed(t)
        return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)

    rec = stepdump.Recorder(run_dir, model, opt)
    with open(side, "a") as f:
        for t in range(100000):
            x, y = batch(t)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            line = {
                "step": t,
                "params": {n: p.tolist() for n, p in model.named_parameters()},
                "grads": {n: p.grad.tolist() for n, p in model.named_parameters()},
            }
            f.write(json.dumps(line) + "\\n")
            f.flush()
            os.fsync(f.fileno())
            time.sleep(0.02)
            opt.step()
            rec.log(loss=loss)
    """
)


def _batch(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _read_side(path):
    out = {}
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the kill may cut the last line short
                continue
            out[rec["step"]] = rec
    return out


def test_sigkill_mid_run_keeps_a_readable_prefix_and_resumes(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir, side = tmp_path / "run", tmp_path / "side.jsonl"
    side.touch()
    sigkill_child_when(script, (run_dir, side), tmp_path / "child.log", lambda: len(_read_side(side)) >= 20)
    reported = _read_side(side)

    run = stepdump.open(run_dir)
    assert not run.live  # the kernel dropped the dead process's lock
    assert (run_dir / "LOCK").exists()  # ... but its file is still there
    steps = run.steps
    assert steps == list(range(len(steps))), f"not a contiguous prefix: {steps}"
    assert run.all_steps == steps
    assert len(steps) >= 5
    assert steps[-1] <= max(reported)
    for t in steps:
        for name in ("weight", "bias"):
            assert run.tensor(name, t).tolist() == reported[t]["params"][name], f"params {name} at {t}"
            assert run.tensor(name, t, kind="grads").tolist() == reported[t]["grads"][name], f"grads {name} at {t}"
    # scalars of committed steps are there (the last step's may have been in flight)
    assert set(run.scalars()["loss"].dropna().index) >= set(steps[:-1])
    last = steps[-1]
    run.close()

    # Resume: restore the last record, redo its iteration, go on recording from last+1.
    model = nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.open(run_dir) as run:
        run.restore(last, model, opt)
    x, y = _batch(last)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    snaps = {}
    with stepdump.Recorder(run_dir, model, opt, resume=True) as rec:  # the stale LOCK does not block
        assert rec.step == last + 1
        for t in range(last + 1, last + 6):
            x, y = _batch(t)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps[t] = snapshot(model, opt)
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(run_dir) as run:
        # last+1..last+5 recorded, then close() wrote the final record last+6 (the trained model)
        assert run.steps == list(range(last + 7))
        assert_final_record(run, model, opt, step=last + 6)
        for t, snap in snaps.items():
            assert_run_matches(run, t, snap)
        for t in steps:  # what was there before is untouched
            assert run.tensor("weight", t).tolist() == reported[t]["params"]["weight"]
        if last + 1 in reported:  # the redone iteration matches what the child computed
            assert run.tensor("weight", last + 1).tolist() == reported[last + 1]["params"]["weight"]


# -- writer failures ---------------------------------------------------------------------


def _model_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _iteration(model, opt, t):
    x, y = regression_batch(t, d_in=4, d_out=2)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    return loss


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _check_enospc(exc):
    assert "No space left on device" in str(exc)
    cause = exc.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC


def test_writer_failure_surfaces_on_log_step_and_close(tmp_path):
    disk = FullDisk()
    model, opt = _model_opt()
    snaps = []
    rec = stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", storage=disk.storage)
    reader = stepdump.open(tmp_path / "run")
    for t in range(3):
        loss = _iteration(model, opt, t)
        snaps.append(snapshot(model, opt))
        opt.step()
        rec.log(loss=loss)
    _wait_for(lambda: reader.steps == [0, 1, 2])
    disk.armed = True
    _iteration(model, opt, 3)
    opt.step()  # step 3 goes to the writer, which fails on it

    def log_raises():
        try:
            rec.log(probe=1.0)
        except stepdump.WriterError as e:
            _check_enospc(e)
            return True
        return False

    _wait_for(log_raises)
    assert disk.calls >= 1
    # from now on every call says so, and the optimizer does not step past it
    before = model.weight.detach().clone()
    _iteration(model, opt, 4)
    with pytest.raises(stepdump.WriterError, match="No space left on device") as ei:
        opt.step()
    _check_enospc(ei.value)
    assert_same(model.weight.detach(), before)
    with pytest.raises(stepdump.WriterError, match="No space left on device"):
        rec.close()
    rec.close()  # a second close is a no-op
    # Steps committed before the failure are intact; the failed one left nothing behind.
    assert reader.steps == [0, 1, 2]
    assert reader.all_steps == [0, 1, 2]
    assert reader.stats(steps=3).empty
    for t in range(3):
        assert_run_matches(reader, t, snaps[t])
    reader.close()
    # The lock was released: recording can go on once the disk has room again.
    disk.armed = False
    with stepdump.Recorder(tmp_path / "run", model, opt, resume=True, storage=disk.storage) as rec2:
        assert rec2.step == 3


def test_writer_failure_surfaces_on_close(tmp_path):
    disk = FullDisk()
    model, opt = _model_opt()
    rec = stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", storage=disk.storage)
    with stepdump.open(tmp_path / "run") as reader:
        for t in range(2):
            _iteration(model, opt, t)
            opt.step()
        _wait_for(lambda: reader.steps == [0, 1])
    disk.armed = True
    _iteration(model, opt, 2)
    opt.step()
    with pytest.raises(stepdump.WriterError) as ei:
        rec.close()
    _check_enospc(ei.value)
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1]


@pytest.mark.parametrize("room", [0, 1])
def test_writer_failure_on_first_step_leaves_an_empty_run(tmp_path, room):
    """The disk fills up at the first write of step 0, or after some of its bytes went out.

    The tensors are large (1.4 MB each) so that a step takes more than one write
    whatever the writer batches.
    """
    disk = FullDisk(armed=True, room=room)
    torch.manual_seed(0)
    model = nn.Linear(600, 600)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", storage=disk.storage)
    model(torch.randn(2, 600)).square().mean().backward()
    opt.step()
    with pytest.raises(stepdump.WriterError) as ei:
        rec.close()
    _check_enospc(ei.value)
    assert disk.calls >= 1
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == []
        assert run.names("params") == []  # nothing of the failed step is visible
        assert run.names("grads") == []
        assert run.stats().empty
        with pytest.raises(stepdump.StepNotFoundError, match="no recorded steps"):
            run.state_dict(0)


def test_writer_error_does_not_hide_the_users_exception(tmp_path):
    disk = FullDisk()
    model, opt = _model_opt()
    with pytest.raises(ZeroDivisionError):
        with stepdump.Recorder(tmp_path / "run", model, opt, storage=disk.storage):
            disk.armed = True
            _iteration(model, opt, 0)
            opt.step()
            raise ZeroDivisionError
