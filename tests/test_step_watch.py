"""A loop that never steps the optimizer given to the Recorder is told so, once (issue 22, item 2).

The Recorder records at that optimizer's step hooks; a hand-written update or another
optimizer object used to train on with nothing recorded and nothing said. Two rows:
loops that must get exactly one warning (saying what was expected and how to fix it),
and healthy loops that must never get it, gradient accumulation of many micro-batches
first among them (capture/stepwatch.py has the signals and thresholds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import tiny_batch, tiny_model
from torch import nn

import stepdump

SIGN = "with no step of the optimizer given to the Recorder"
Loop = Callable[[Any, nn.Module, torch.optim.Optimizer], None]


def _warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and SIGN in r.getMessage()]


def _loss(model: nn.Module, t: int, forward: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    x, y = tiny_batch(t)
    return nn.functional.mse_loss((forward or model)(x), y)


# -- loops that never step the optimizer given ------------------------------------------


def _sgd_by_hand_data(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """word_language_model's update: model.zero_grad(), p.data.add_(p.grad, alpha=-lr)."""
    for t in range(8):
        model.zero_grad()
        loss = _loss(model, t)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        rec.log(loss=loss)


def _sgd_by_hand_no_grad(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Zeroed in place (grads never None), updated under no_grad, nothing logged."""
    for t in range(8):
        loss = _loss(model, t)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad


def _other_optimizer(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The Recorder got one Adam, the loop steps another over the same params."""
    other = torch.optim.Adam(model.parameters(), lr=1e-2)
    for t in range(8):
        other.zero_grad()
        loss = _loss(model, t)
        loss.backward()
        other.step()
        rec.log(loss=loss)


def _other_optimizer_on_a_middle_param(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Another optimizer updates a param the watch does not sample: said after 1024 forwards + logs."""
    other = torch.optim.SGD([model[0].bias], lr=1e-3)
    for t in range(520):
        other.zero_grad()
        loss = _loss(model, t % 8)
        loss.backward()
        other.step()
        rec.log(loss=loss)


def _by_hand_calling_forward(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """model.forward(x) runs no hooks: only rec.log() shows the iterations."""
    for t in range(8):
        opt.zero_grad()
        loss = _loss(model, t, model.forward)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
        rec.log(loss=loss)


def _never_updates(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Forwards and logs, no update at all: said when the Recorder closes (the run holds no step)."""
    for t in range(5):
        rec.log(loss=_loss(model, t))


NEVER_STEPS: dict[str, Loop] = {
    "sgd_by_hand_data": _sgd_by_hand_data,
    "sgd_by_hand_no_grad": _sgd_by_hand_no_grad,
    "other_optimizer": _other_optimizer,
    "other_optimizer_on_a_middle_param": _other_optimizer_on_a_middle_param,
    "by_hand_calling_forward": _by_hand_calling_forward,
    "never_updates": _never_updates,
}


@pytest.mark.parametrize("loop", list(NEVER_STEPS))
def test_a_loop_that_never_steps_the_optimizer_given_is_told_once(tmp_path, caplog, loop):
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        NEVER_STEPS[loop](rec, model, opt)
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert "(Adam)" in said[0] and "rec.capture()" in said[0] and "rec.end_step()" in said[0], said[0]
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta.get("final_step") in (None, 0)  # nothing but the state at close was recorded


def test_the_warning_comes_after_three_iterations_not_at_close(tmp_path, caplog):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(3):
            _sgd_by_hand_data_one(rec, model, t)
            assert not _warnings(caplog), f"warned after {t + 1} iteration(s)"
        _sgd_by_hand_data_one(rec, model, 3)  # the 3rd change of the params is seen at this forward
        assert len(_warnings(caplog)) == 1
        assert "nothing is being recorded" in _warnings(caplog)[0]


def _sgd_by_hand_data_one(rec: Any, model: nn.Module, t: int) -> None:
    model.zero_grad()
    loss = _loss(model, t)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)


# -- healthy loops ----------------------------------------------------------------------


def _plain(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(6):
        opt.zero_grad()
        loss = _loss(model, t)
        loss.backward()
        opt.step()
        rec.log(loss=loss)


def _accumulation(micro: int, steps: int) -> Loop:
    def loop(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for s in range(steps):
            opt.zero_grad()
            for m in range(micro):
                loss = _loss(model, s * micro + m) / micro
                loss.backward()
                rec.log(loss=loss)  # per micro-batch: the same name again and again before the step
            opt.step()
    return loop


def _lbfgs(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(3):
        def closure(t: int = t) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(model, t)
            loss.backward()
            return loss
        rec.log(loss=opt.step(closure))


def _grad_scaler(scaler: Any) -> Loop:
    def loop(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for t in range(6):
            opt.zero_grad()
            loss = _loss(model, t)
            scaler.scale(loss).backward()
            if t == 0:  # an inf: the scaler skips the first step (no optimizer hook fires)
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            rec.log(loss=loss)
    return loop


def _eval_between_steps(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for _ in range(5):  # a validation before training, with grad on (people forget no_grad)
        _loss(model, 99)
    for t in range(6):
        opt.zero_grad()
        loss = _loss(model, t)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for v in range(20):
                _loss(model, 100 + v)
        rec.log(loss=loss)


def _load_and_swap_before_training(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A checkpoint loaded after the Recorder was made, EMA weights swapped in and back: 2 new values."""
    model.load_state_dict(tiny_model(seed=3).state_dict())
    _loss(model, 0)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    _loss(model, 1)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    _plain(rec, model, opt)


def _by_hand_with_capture(rec: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The fix the warning names: rec.capture() before a hand-written update, rec.end_step() after."""
    for t in range(6):
        model.zero_grad()
        loss = _loss(model, t)
        loss.backward()
        rec.capture()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
        rec.end_step()
        rec.log(loss=loss)


HEALTHY: dict[str, tuple[str, Loop]] = {
    "plain": ("adam", _plain),
    "accumulation_x16": ("adam", _accumulation(16, 3)),
    "accumulation_x64": ("adam", _accumulation(64, 2)),
    "lbfgs_closure": ("lbfgs", _lbfgs),
    "grad_scaler_first_step_skipped": ("scaler", _plain),  # the loop is built in the test (needs the scaler)
    "eval_between_steps": ("adam", _eval_between_steps),
    "load_and_swap_before_training": ("adam", _load_and_swap_before_training),
    "by_hand_with_capture": ("manual", _by_hand_with_capture),
}


@pytest.mark.parametrize("loop", list(HEALTHY))
def test_healthy_loops_are_never_warned(tmp_path, caplog, loop):
    kind, body = HEALTHY[loop]
    model = tiny_model()
    opt: torch.optim.Optimizer = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=20) if kind == "lbfgs"
                                  else torch.optim.Adam(model.parameters(), lr=1e-2))
    kwargs: dict[str, Any] = {"auto_capture": False} if kind == "manual" else {}
    if kind == "scaler":
        kwargs["scaler"] = scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        body = _grad_scaler(scaler)
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "run", model, opt, **kwargs) as rec:
        body(rec, model, opt)
        stepped = rec.step
    assert not _warnings(caplog)
    with stepdump.open(tmp_path / "run") as run:  # and it did record every step
        assert run.steps[-1] == stepped > 0
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # the watch left with the Recorder
