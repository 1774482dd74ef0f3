"""rec.log: which step a scalar lands on, what it accepts, and the automatic lr columns."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import training_scalars
from torch import nn

import stepdump


def _setup(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt, stepdump.Recorder(tmp_path / "run", model, opt, **kwargs)


def _backward(model):
    model(torch.randn(2, 3)).pow(2).mean().backward()


def test_logged_before_and_right_after_the_step(tmp_path):
    model, opt, rec = _setup(tmp_path)
    with rec:
        for t in range(5):
            assert rec.step == t
            _backward(model)
            rec.log(before=t)          # during iteration t
            opt.step()
            assert rec.step == t + 1
            rec.log(after=10 * t)      # right after step t: still iteration t's
    with stepdump.open(tmp_path / "run") as run:
        assert list(run.scalars().index) == list(range(6))  # and the final record 5
        sc = training_scalars(run)
        assert list(sc.index) == list(range(5))
        assert list(sc["before"]) == [0, 1, 2, 3, 4]
        assert list(sc["after"]) == [0, 10, 20, 30, 40]


def test_a_name_the_finished_step_already_has_goes_to_the_next_step(tmp_path):
    model, opt, rec = _setup(tmp_path)
    with rec:
        _backward(model)
        rec.log(x=1.0)
        opt.step()
        rec.log(x=2.0)   # step 0 has x already: this is iteration 1's
        rec.log(y=3.0)   # step 0 lacks y: step 0's
        rec.log(y=4.0)   # now step 0 has y: iteration 1's
        _backward(model)
        opt.step()
        _backward(model)
        rec.log(x=5.0)
        rec.log(x=6.0)   # logging twice in one iteration: the last value wins
        opt.step()
    with stepdump.open(tmp_path / "run") as run:
        sc = run.scalars()
        assert sc.loc[0, "x"] == 1.0 and sc.loc[1, "x"] == 2.0 and sc.loc[2, "x"] == 6.0
        assert sc.loc[0, "y"] == 3.0 and sc.loc[1, "y"] == 4.0
        assert math.isnan(sc.loc[2, "y"])


def test_accepted_scalar_types(tmp_path):
    model, opt, rec = _setup(tmp_path)
    with rec:
        _backward(model)
        wsum = model.weight.sum()
        rec.log(
            f=1.5, i=3, b=True, t0=torch.tensor(2.25), t1=torch.tensor([7.0]),
            tbf=torch.tensor(0.5, dtype=torch.bfloat16), np_f=np.float32(0.75), np_i=np.int64(9),
            grad_t=wsum,  # a tensor that requires grad is fine
            inf=float("inf"), ninf=-math.inf, nan=float("nan"),
        )
        opt.step()
    with stepdump.open(tmp_path / "run") as run:
        row = run.scalars().loc[0]
        assert (row["f"], row["i"], row["b"], row["t0"], row["t1"]) == (1.5, 3.0, 1.0, 2.25, 7.0)
        assert (row["tbf"], row["np_f"], row["np_i"]) == (0.5, 0.75, 9.0)
        assert row["grad_t"] == wsum.item()  # the value when logged, not after the update
        assert row["inf"] == math.inf and row["ninf"] == -math.inf
        assert math.isnan(row["nan"])


@pytest.mark.parametrize(
    "value, match",
    [("high", "str"), (None, "NoneType"), ([1.0], "list"), (torch.ones(3), "shape"), ({"a": 1}, "dict")],
)
def test_non_numeric_values_are_refused(tmp_path, value, match):
    model, opt, rec = _setup(tmp_path)
    with rec:
        with pytest.raises(stepdump.ConfigError, match=match) as ei:
            rec.log(bad=value)
        assert "bad" in str(ei.value)
        _backward(model)
        rec.log(good=1.0)  # the Recorder goes on working
        opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert "bad" not in run.scalars().columns
        assert run.scalars().loc[0, "good"] == 1.0


def test_log_after_close_is_refused(tmp_path):
    _, _, rec = _setup(tmp_path)
    rec.close()
    with pytest.raises(stepdump.ConfigError, match="closed"):
        rec.log(x=1.0)


def test_lr_per_group_is_logged_automatically(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[1].parameters(), "lr": 0.01},
                           {"params": [], "lr": 0.3}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    used = []
    with stepdump.Recorder(tmp_path / "run", model, opt, sched) as rec:
        for t in range(6):
            model(torch.randn(2, 3)).sum().backward()
            used.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
            rec.log(loss=1.0)
    with stepdump.open(tmp_path / "run") as run:
        sc = training_scalars(run)
        assert [c for c in sc.columns if c.startswith("lr")] == ["lr", "lr/1", "lr/2"]
        assert list(sc["lr"]) == [u[0] for u in used]
        assert list(sc["lr/1"]) == [u[1] for u in used]
        assert list(sc["lr/2"]) == [u[2] for u in used]
        assert used[0] != used[-1]
        # filters
        assert list(run.scalars(names="lr/*").columns) == ["lr/1", "lr/2", "skipped"]
        assert list(run.scalars(steps=range(2, 4)).index) == [2, 3]
        assert run.scheduler_state_dict(3)["last_epoch"] == 3


def test_scalars_of_steps_that_are_not_stored_are_kept(tmp_path):
    model, opt, rec = _setup(tmp_path, every=3, stats_every=None)
    with rec:
        for t in range(7):
            _backward(model)
            rec.log(loss=float(t))
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 3, 6, 7] and run.meta["final_step"] == 7
        sc = training_scalars(run)
        assert list(sc["loss"]) == [float(t) for t in range(7)]
        assert not sc["skipped"].any()


def test_no_grad_scale_column_without_a_scaler(tmp_path):
    model, opt, rec = _setup(tmp_path)
    with rec:
        _backward(model)
        opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert list(run.scalars().columns) == ["lr", "skipped"]
        assert run.scalars()["skipped"].dtype == bool


def test_a_logged_tensor_keeps_its_value_when_logged(tmp_path):
    """Logging a tensor that training later changes in place records the value at log time."""
    torch.manual_seed(0)
    temp = nn.Parameter(torch.tensor([2.0]))
    opt = torch.optim.SGD([temp], lr=0.25)
    values = []
    with stepdump.Recorder(tmp_path / "run", nn.Module(), opt) as rec:
        for _ in range(3):
            (temp * 3).sum().backward()
            values.append(temp.item())
            rec.log(temp=temp)  # the parameter itself, updated in place by the step
            opt.step()
            opt.zero_grad()
    with stepdump.open(tmp_path / "run") as run:
        assert values == [2.0, 1.25, 0.5]
        assert list(training_scalars(run)["temp"]) == values
