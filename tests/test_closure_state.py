"""An optimizer stepped with a closure: the record holds the optimizer state as of before step().

The record of such a step is taken after the closure's first call (the grads exist only
then), but LBFGS changes its state before that call (``func_evals`` / ``n_iter`` appear at
step 0). What must hold (capture/hooks.py StateBefore): the recorded
``optimizer_state_dict(k)`` equals a deep copy of ``optimizer.state_dict()`` taken right
before ``optimizer.step(closure)``, bitwise, in every schedule that stores it; restoring
step k and redoing it gives record k+1; an optimizer that changes its state in place
before calling the closure is refused (one warning, the recorder steps aside), never
recorded as if it were the state before the step.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from helpers import assert_same_tree, gen
from torch import nn

import stepdump
from stepdump.errors import StepdumpError

STEPS = 6


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _closure(model: nn.Module, opt: torch.optim.Optimizer, t: int) -> Any:
    g = gen(t)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def _lbfgs(model: nn.Module, search: str | None) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=2, line_search_fn=search)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, before: list[dict] | None = None) -> None:
    for t in steps:
        if before is not None:
            before.append(copy.deepcopy(opt.state_dict()))  # right before step(closure)
        opt.step(_closure(model, opt, t))


SCHEDULES = {"full": {"every": 1}, "tiered": {"every": 2, "stats_every": 1}, "keyframes": {"keyframe_every": 3}}


@pytest.mark.parametrize("search", [None, "strong_wolfe"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_lbfgs_records_the_state_before_the_step_and_restores_to_the_next_record(tmp_path, search, schedule) -> None:
    model = _model()
    opt = _lbfgs(model, search)
    before: list[dict] = []
    with stepdump.Recorder(tmp_path / "r", model, opt, on_error="raise", **SCHEDULES[schedule]):
        _train(model, opt, range(STEPS), before)
    run = stepdump.open(tmp_path / "r")
    stored = [t for t in run.steps if t < STEPS]
    assert stored and stored[0] == 0, stored
    for t in stored:  # step 0 included: LBFGS's state is empty before its first step
        assert_same_tree(run.optimizer_state_dict(t), before[t], f"{schedule} step {t} optimizer_state_dict")
    for t in stored:
        fresh = _model(seed=1)
        fresh_opt = _lbfgs(fresh, search)
        run.restore(t, fresh, fresh_opt)
        assert_same_tree(fresh_opt.state_dict(), before[t], f"{schedule}: restored at {t}")
        _train(fresh, fresh_opt, range(t, t + 1))
        want = before[t + 1] if t + 1 < STEPS else copy.deepcopy(opt.state_dict())
        assert_same_tree(fresh_opt.state_dict(), want, f"{schedule}: restored at {t}, redone")
        if t + 1 in run.steps:
            for name, p in fresh.named_parameters():
                assert torch.equal(run.tensor(name, t + 1, "params"), p), f"{schedule} {t}+1 {name}"


class _StateFirst(torch.optim.SGD):
    """Changes its state in place before it calls the closure (no torch optimizer does)."""

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "count" in state:
                    state["count"].add_(1)
                else:
                    state["count"] = torch.zeros(())
        return super().step(closure)


def test_state_changed_before_the_closure_is_refused_not_recorded_as_before(tmp_path, caplog) -> None:
    def train(recorded: bool, **kw: Any) -> nn.Module:
        model = _model()
        opt = _StateFirst(model.parameters(), lr=0.1)
        if not recorded:
            _train(model, opt, range(4))
            return model
        with stepdump.Recorder(tmp_path / f"r{len(kw)}", model, opt, **kw):
            _train(model, opt, range(4))
        return model

    plain = train(False)
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        model = train(True)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)  # training unchanged
    warned = [r.getMessage() for r in caplog.records if "before it called the closure" in r.getMessage()]
    assert len(warned) == 1, warned
    run = stepdump.open(tmp_path / "r0")
    assert run.meta.get("recording_stopped")
    assert 1 not in run.steps  # step 0 is fine (the state is created, not changed); step 1 is refused
    with pytest.raises(StepdumpError, match="before it called the closure"):
        train(True, on_error="raise")
