"""How the Recorder hears about a step: closures, GradScaler skips, optimizer param groups.

The Recorder takes a record at the optimizer's step pre-hook, where grads are
final and nothing is updated yet. Two ordinary setups break that moment, and
this module holds what handles them:

* an optimizer called with a closure (LBFGS, or any optimizer given one): the
  pre-hook fires *before* the closure computes the gradients, so the record is
  taken right after the closure's first call instead (the grads of the first
  evaluation, params and optimizer state still untouched: every torch optimizer
  calls the closure before it changes anything);
* a GradScaler that finds inf/NaN never calls ``optimizer.step()``, so no
  optimizer hook fires: ``scaler.step`` is wrapped on that one instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class _Steps(Protocol):
    optimizer: torch.optim.Optimizer
    _pre_fired: int

    def _on_pre_step(self, skipped: bool = False) -> None: ...
    def _on_step_done(self) -> None: ...


def group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    """Parameters per param group: a change means ``add_param_group`` was called."""
    return [len(g["params"]) for g in optimizer.param_groups]


def record_after_closure(args: tuple[Any, ...], kwargs: dict[str, Any],
                         record: Callable[[], None]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """For a step pre-hook: new ``(args, kwargs)`` whose closure calls ``record()`` after its
    first call, or None when ``step()`` was given no closure (record now).

    ``args`` are ``step()``'s own, the optimizer first. The user's closure runs
    unguarded: an exception from it is theirs and passes through unchanged;
    ``record`` is the Recorder's guarded pre-step.
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None
    recorded = False

    def closure_then_record() -> Any:
        nonlocal recorded
        loss = closure()
        if not recorded:
            recorded = True
            record()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_record}
    return (args[0], closure_then_record, *args[2:]), kwargs


def watch_scaler(scaler: Any, rec: _Steps) -> Callable[..., Any]:
    """A ``scaler.step`` that records a step the scaler skips (inf/NaN found: no optimizer hook fires)."""
    original = scaler.step

    def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        before = rec._pre_fired
        out = original(optimizer, *args, **kwargs)
        if optimizer is rec.optimizer and rec._pre_fired == before:
            rec._on_pre_step(skipped=True)
            rec._on_step_done()
        return out

    return step
