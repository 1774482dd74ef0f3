"""Localize: which module makes two setups part, replaying one recorded step in both.

Both setups (e.g. a reference implementation and a port) are put in the state
of the same recorded step, given the same batch and RNG, and run with hooks on
every module. The first module whose output differs (in forward order), else
the first whose output gradient differs (in backward order), is named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stepdump.analysis.diff import TensorDiff, compare_tensors
from stepdump.core import tjson
from stepdump.core.nested import flatten
from stepdump.core.rng import set_rng_state
from stepdump.errors import ConfigError

TrainStep = Callable[[nn.Module, torch.optim.Optimizer, Any], Any]


@dataclass
class Setup:
    """One side: a model, its optimizer and the code of one iteration."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_step: TrainStep


@dataclass
class Localization:
    """Where two setups first differ within one step."""

    step: int
    module: str | None
    phase: str  # "forward", "backward" or "none"
    diff: TensorDiff | None = None
    compared: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.module is None:
            return f"step {self.step}: every module output and gradient is identical in both setups"
        d = self.diff
        size = f" (max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}, {d.n_diff}/{d.numel} elements)" if d else ""
        what = "output" if self.phase == "forward" else "output gradient"
        return f"step {self.step}: first difference in the {what} of module {self.module!r}{size}"


class _Stop(Exception):
    pass


def localize(run: Any, step: int, a: Setup | tuple, b: Setup | tuple, *, atol: float = 0.0,
             rtol: float = 0.0) -> Localization:
    """Replay ``step`` of ``run`` in setups ``a`` and ``b`` and name the first module that differs.

    The run must hold the step's state in full (a keyframe, or a full step) and
    its batch (``rec.log_batch``). Each setup is ``Setup(model, optimizer,
    train_step)`` or a tuple of those three.
    """
    sa, sb = (s if isinstance(s, Setup) else Setup(*s) for s in (a, b))
    st = run.step_state(step)
    if "batch" not in st:
        raise ConfigError(f"step {step} has no recorded batch; record with rec.log_batch(batch) every iteration")
    fa, ga = _trace(run, step, st, sa)
    fb, gb = _trace(run, step, st, sb)
    result = Localization(step=step, module=None, phase="none")
    for phase, xa, xb in (("forward", fa, fb), ("backward", ga, gb)):
        lookup = dict(xb)
        for name, ta in xa:
            tb = lookup.get(name)
            if tb is None:
                continue
            result.compared.append(name)
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                result.module, result.phase = _module(name), phase
                result.diff = TensorDiff("activations", name, "shape" if ta.shape != tb.shape else "dtype")
                return result
            d = compare_tensors("activations" if phase == "forward" else "activation_grads", name, ta, tb, atol, rtol)
            if d is not None:
                result.module, result.phase, result.diff = _module(name), phase, d
                return result
    return result


def _module(name: str) -> str:
    return name.split("/")[0].split("#")[0]


def _trace(run: Any, step: int, st: dict[str, Any], setup: Setup) -> tuple[list, list]:
    run.restore(step, setup.model, setup.optimizer, rng=False)
    forward: list[tuple[str, torch.Tensor]] = []
    backward: list[tuple[str, torch.Tensor]] = []
    calls: dict[str, int] = {}
    handles = []

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            n = calls.get(name, 0)
            calls[name] = n + 1
            base = name if n == 0 else f"{name}#{n}"
            for path, t in flatten(output, base):
                forward.append((path, t.detach().clone()))
                if t.requires_grad:
                    t.register_hook(lambda g, path=path: backward.append((path, g.detach().clone())))

        return hook

    for name, mod in setup.model.named_modules():
        handles.append(mod.register_forward_hook(make_hook(name or "<root>")))

    def stop(opt: Any, args: Any, kwargs: Any) -> None:
        raise _Stop

    handles.append(setup.optimizer.register_step_pre_hook(stop))
    if "rng" in st:
        set_rng_state(st["rng"])
    batch = tjson.decode(st["batch"], lambda ref: run.tensor(ref, step, kind="inputs"))
    try:
        setup.train_step(setup.model, setup.optimizer, batch)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return forward, backward
