"""Optimizers wrapped by other libraries or by the loop, given to a plain Recorder (issue 37).

Each test trains a loop shape nobody here wrote (accelerate's prepared optimizer, a SAM-style
two-step optimizer, transformers' Adafactor, a Lookahead-style wrapper) and checks that the run is
the training, bit for bit, or that what cannot be recorded is said, and that a Recorder that
cannot be built leaves nothing behind (lock, threads, files).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_run_matches, assert_same, snapshot, tiny_batch, tiny_model
from torch import nn

import stepdump
from stepdump.errors import ConfigError


def _stepdump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stepdump")]


# -- accelerate's prepared optimizer -------------------------------------------------------


def _accelerate_loop(path: Path | None, steps: int = 4, accumulate: int = 2) -> tuple[nn.Module, Any, list[Any]]:
    """accelerate's gradient accumulation: the prepared optimizer's step() runs every micro-batch and
    steps the inner AdamW every ``accumulate``; ``snaps``: the state before each real update."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, inner, sched)
    snaps: list[Any] = []
    rec = stepdump.Recorder(path, model, opt, sched) if path is not None else None
    for t in range(steps * accumulate):
        with acc.accumulate(model):
            x, y = tiny_batch(t)
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                snaps.append(snapshot(model, inner))
            opt.step()
            sched.step()
            opt.zero_grad()
        if rec is not None:
            rec.log(loss=loss)
    if rec is not None:
        rec.close()
    return model, inner, snaps


def test_accelerate_prepared_optimizer_is_recorded(tmp_path: Path) -> None:
    model, inner, snaps = _accelerate_loop(tmp_path / "r")
    plain, _, _ = _accelerate_loop(None)
    for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_same(a, b, f"training changed by recording: {n}")
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [0, 1, 2, 3, 4], "one record per update of the inner AdamW, and the final record"
    assert run.meta["optimizer_class"] == "AdamW"
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)
    assert_run_matches(run, 4, snapshot(model, inner), kinds=("params", "optimizer"))
    assert run.step_state(4)["scheduler"]["last_epoch"] == 4


def test_accelerate_restore_into_prepared_objects(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    _, _, snaps = _accelerate_loop(tmp_path / "r")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = tiny_model(seed=5)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = Accelerator(cpu=True).prepare(model, inner)
    stepdump.open(tmp_path / "r").restore(2, model, opt, rng=False)
    assert_run_matches(stepdump.open(tmp_path / "r"), 2, snapshot(model, inner) | {"grads": snaps[2]["grads"]})


class _HooklessWrapper(torch.optim.Optimizer):
    """A wrapper that skips ``Optimizer.__init__`` (as timm's Lookahead did before it added the hook
    dicts by hand): it has no step hooks for a Recorder to attach to."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.base.step(closure)


def test_failed_construction_releases_everything(tmp_path: Path) -> None:
    """A Recorder that fails while being built (here: attaching to an optimizer with no step hooks)
    raises a stepdump error, stops its threads, releases the run and leaves the directory as it was."""
    model = tiny_model()
    wrapped = _HooklessWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    before = set(_stepdump_threads())
    with pytest.raises(ConfigError, match="step hooks"):
        stepdump.Recorder(tmp_path / "r", model, wrapped)
    left = [t for t in _stepdump_threads() if t not in before and t.is_alive()]
    assert left == [], f"threads still running: {left}"
    # The same directory takes a Recorder again, as if nothing had been tried.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "r", model, opt) as rec:
        x, y = tiny_batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        rec.log(loss=1.0)
    assert stepdump.open(tmp_path / "r").steps == [0, 1]
