"""Odd inputs at the Recorder's and restore's front door (issue 16: items 5, 6, 11, 12).

A bad scalar is refused at ``log()`` naming its key and recording goes on; a
scalar logged only now and then lands on its own iteration; a restore into an
optimizer whose params come in another order is refused; a stopped recording
says so in ``stepdump info`` and ``stepdump check``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers import MLP, regression_batch, training_scalars
from torch import nn

import stepdump
from stepdump.capture import staging


def _step(model, opt, t):
    x, y = regression_batch(t, d_in=8, d_out=4)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    return loss


BAD = {
    "one-element array": (np.array([0.5]), None),  # numpy: stored faithfully
    "numpy scalar": (np.float32(0.25), None),
    "two-element array": (np.ones(2), "numpy array of shape"),
    "too large for a float": (10**400, "not a 64-bit float"),
    "complex tensor": (torch.tensor(1 + 2j), "complex"),
    "meta tensor": (torch.empty((), device="meta"), "meta tensor"),
    "string": ("0.5", "got str"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_log_refuses_what_it_cannot_store_at_the_call_and_recording_goes_on(tmp_path, case):
    value, error = BAD[case]
    torch.manual_seed(0)
    model = MLP(8, 8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise") as rec:
        for t in range(4):
            loss = _step(model, opt, t)
            rec.log(loss=loss)
            if t == 1:
                if error is None:
                    rec.log(odd=value)
                else:
                    with pytest.raises(stepdump.ConfigError, match=rf"log\(odd=\.\.\.\).*{error}"):
                        rec.log(fine=1.0, odd=value)
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == [0, 1, 2, 3, 4]  # recording did not stop: it closed with the final record
        assert run.meta["final_step"] == 4
        sc = training_scalars(run)
        assert sc["loss"].notna().all()
        if error is None:
            assert sc.loc[1, "odd"] == float(np.asarray(value).reshape(-1)[0])
        else:
            assert "odd" not in sc and "fine" not in sc  # nothing of a refused call is kept


def test_a_scalar_logged_now_and_then_before_the_step_lands_on_its_iteration(tmp_path):
    torch.manual_seed(0)
    model = MLP(8, 8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(12):
            _step(model, opt, t)
            if t % 5 == 0:
                rec.log(rare=float(t))  # before optimizer.step(), only some iterations
            opt.step()
            rec.log(after=float(t))  # after the step, every iteration
        with torch.no_grad():  # an evaluation after the step: not a training forward
            model(torch.zeros(1, 8))
        rec.log(eval_after=99.0)
    with stepdump.open(tmp_path / "run") as run:
        sc = training_scalars(run)  # nothing lands on the final record 12, not even eval_after
        rare = sc["rare"].dropna()
        assert list(rare.index) == [0, 5, 10]
        assert list(rare) == [0.0, 5.0, 10.0]
        assert list(sc["after"]) == [float(t) for t in range(12)]
        assert sc["eval_after"].dropna().index.tolist() == [11]


def test_restore_refuses_an_optimizer_with_params_in_another_order(tmp_path):
    def build(swap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
        params = [model[0].weight, model[0].bias, model[1].weight, model[1].bias]
        if swap:
            params = [model[1].weight, model[1].bias, model[0].weight, model[0].bias]
        return model, torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=1e-3)

    model, opt = build(False)
    with stepdump.Recorder(tmp_path / "run", model, opt):
        for t in range(2):
            model(torch.ones(2, 5)).sum().backward()
            opt.step()
    fresh, fopt = build(True)
    before = [p.detach().clone() for p in fresh.parameters()]
    with stepdump.open(tmp_path / "run") as run:
        with pytest.raises(stepdump.RestoreMismatchError, match=r"'0\.weight' there at step \d+, this optimizer has '1\.weight'"):
            run.restore(1, fresh, fopt)
        for p, b in zip(fresh.parameters(), before):
            assert torch.equal(p, b)  # refused before anything changed
        assert fopt.state_dict()["state"] == {}


def test_a_stopped_recording_shows_in_info_check_and_meta(tmp_path, monkeypatch, caplog, cli):
    torch.manual_seed(0)
    model = MLP(8, 8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original = staging.Stager.stage
    calls = [0]

    def fails_third_time(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planted")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(staging.Stager, "stage", fails_third_time)
    caplog.set_level(logging.WARNING, logger="stepdump")
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(5):
            rec.log(loss=_step(model, opt, t))
            opt.step()
    [warning] = [r.getMessage() for r in caplog.records if "stopped at step" in r.getMessage()]
    assert "stopped at step 2" in warning and "RuntimeError: planted" in warning
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["recording_stopped"] == {
            "step": 2, "where": "optimizer.step() pre-hook", "error": "RuntimeError: planted", "last_committed": 1}
        [finding] = [f for f in stepdump.check(run) if f.rule == "recording_stopped"]
        assert finding.step == 2 and "the run ends at step 1" in finding.message
    out = cli("info", tmp_path / "run").stdout
    assert "recording stopped" in out and "RuntimeError: planted" in out


@pytest.mark.parametrize("kind", ["quantized", "meta"])
def test_tensors_stepdump_cannot_store_are_left_out_with_one_warning(tmp_path, kind, caplog):
    torch.manual_seed(0)
    model = MLP(8, 8, 4)
    odd = (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8) if kind == "quantized"
           else torch.empty(3, device="meta"))
    model.register_buffer("odd", odd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caplog.set_level(logging.WARNING, logger="stepdump")
    before_last = None
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise") as rec:
        for t in range(3):
            rec.log(loss=_step(model, opt, t))
            before_last = model.fc1.weight.detach().clone()
            opt.step()
    warned = [r.getMessage() for r in caplog.records if "'odd'" in r.getMessage()]
    assert len(warned) == 1 and kind in warned[0] and "left out" in warned[0]
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == [0, 1, 2, 3] and run.meta["final_step"] == 3
        assert torch.equal(run.tensor("fc1.weight", 2), before_last)
        assert torch.equal(run.tensor("fc1.weight", 3), model.fc1.weight)  # the final record
        assert "odd" not in run.names("buffers")
        with pytest.raises(stepdump.StepNotFoundError, match="odd"):
            run.state_dict(2)


def test_a_writer_that_fails_to_start_leaves_no_thread_behind(tmp_path, monkeypatch):
    import threading

    from stepdump.capture import writer

    def refuse(*args, **kwargs):
        raise OSError("catalog refused")

    monkeypatch.setattr(writer, "CatalogWriter", refuse)
    model = MLP(8, 8, 4)
    with pytest.raises(stepdump.WriterError, match="catalog refused"):
        stepdump.Recorder(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not [t for t in threading.enumerate() if t.name == "stepdump-writer"]
    monkeypatch.undo()
    with stepdump.Recorder(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True):
        pass  # the lock was released
