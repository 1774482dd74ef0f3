"""How the Recorder hears about a step: closures, GradScaler skips, optimizer param groups.

The Recorder takes a record at the optimizer's step pre-hook, where grads are
final and nothing is updated yet. Three ordinary setups break that moment, and
this module holds what handles them:

* an optimizer called with a closure (LBFGS, or any optimizer given one): the
  pre-hook fires *before* the closure computes the gradients, so the record is
  taken right after the closure's first call instead (the grads of the first
  evaluation, params and optimizer state still untouched: every torch optimizer
  calls the closure before it changes anything);
* a GradScaler that finds inf/NaN never calls ``optimizer.step()``, so no
  optimizer hook fires: ``scaler.step`` is wrapped on that one instance;
* an optimizer subclass whose ``step()`` calls ``super().step()``: torch wraps
  each class's ``step`` with the hook runner, so the hooks fire once per class
  in the chain; only the outermost call counts (:func:`nested_step`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from stepdump.capture.handles import Hook, ScalerStep
from stepdump.capture.profiling import timed
from stepdump.capture.step_state import StateBefore
from stepdump.core.wrappers import require_step_hooks


def _step_wrapper_code() -> Any:
    """The code of the wrapper torch.optim puts around each optimizer class's step() (it runs the hooks)."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    try:
        return wrap(lambda *a, **k: None).__code__ if wrap is not None else None
    except Exception:  # noqa: BLE001 - another torch: no nesting detection (every call counts)
        return None


_STEP_WRAPPER = _step_wrapper_code()


class Steps(Protocol):
    """The public capture hooks of a :class:`stepdump.Recorder` that these hooks drive."""

    optimizer: torch.optim.Optimizer

    @property
    def step(self) -> int: ...
    def capture(self, *, skipped: bool = False, optimizer_state: StateBefore | None = None) -> int: ...
    def end_step(self) -> None: ...


def attach(rec: Steps, scaler: Any, *, auto_capture: bool,
           spent: Callable[[float], None] | None = None) -> list[Any]:
    """Hook ``rec`` to its optimizer (and ``scaler``); return the handles to remove at close.

    The post-hook ends every update (:meth:`Recorder.end_step`). With
    ``auto_capture`` the pre-hook takes each record (:meth:`Recorder.capture`)
    and ``scaler.step`` is wrapped to record the steps the scaler skips;
    without, the caller does both (a framework callback that knows better when
    the grads are final). A scaler wrapper is undone by :func:`detach_scaler`.
    ``spent``: takes the seconds the hooks' own frame walk costs (``sys/recorder_ms``).
    """
    opt = rec.optimizer
    require_step_hooks(opt)
    # The frame walk that tells a step's own hook call from an inner super().step()'s is the
    # recorder's time too (sys/recorder_ms): ``spent`` takes it.
    nested = timed(nested_step, spent) if spent is not None else nested_step

    def post(o: Any, a: Any, k: Any) -> None:
        if not nested(o):
            rec.end_step()

    def pre(o: Any, a: Any, k: Any) -> Any:
        return None if nested(o) else capture_at_pre_hook(rec, a, k)

    # Hooks, not bare lambdas: a copy or pickle of the optimizer never carries the Recorder (handles.py).
    handles = [opt.register_step_post_hook(Hook(post))]
    if auto_capture:
        handles.append(opt.register_step_pre_hook(Hook(pre)))
        if scaler is not None:
            scaler.step = watch_scaler(scaler, rec)  # an instance attribute shadows the method
    return handles


def nested_step(optimizer: torch.optim.Optimizer) -> bool:
    """True when called from the hooks of an inner ``step()`` of ``optimizer``: a subclass whose
    ``step`` calls ``super().step()`` runs torch's hook wrapper once per class; the outer call is
    the step (counting each would record one update as two)."""
    if not _STEP_WRAPPER:
        return False
    outer = 0
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER and frame.f_locals.get("self") is optimizer:
            outer += 1
            if outer > 1:
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def detach_scaler(scaler: Any) -> None:
    """Undo :func:`attach`'s ``scaler.step`` wrapper, if there is one."""
    if scaler is not None and "step" in vars(scaler):
        del scaler.step


def capture_at_pre_hook(rec: Steps, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The optimizer's step pre-hook. With a closure (LBFGS), grads exist only once the
    optimizer has called it: the record is taken after its first call instead, with the
    optimizer state as it is now (LBFGS adds ``func_evals`` / ``n_iter`` before that call)."""
    if not _has_closure(args, kwargs):  # the grads are final now
        rec.capture()
        return None
    before = StateBefore(rec.optimizer)
    return record_after_closure(args, kwargs, lambda: rec.capture(optimizer_state=before))


def _has_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return callable(kwargs.get("closure", args[1] if len(args) > 1 else None))


def group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    """Parameters per param group: a change means ``add_param_group`` was called."""
    return [len(g["params"]) for g in optimizer.param_groups]


def record_after_closure(args: tuple[Any, ...], kwargs: dict[str, Any],
                         record: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """For a step pre-hook: new ``(args, kwargs)`` whose closure calls ``record()`` after its
    first call, or None when ``step()`` was given no closure (record now).

    ``args`` are ``step()``'s own, the optimizer first. The user's closure runs
    unguarded: an exception from it is theirs and passes through unchanged;
    ``record`` is the Recorder's :meth:`~stepdump.Recorder.capture` (guarded).
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


def watch_scaler(scaler: Any, rec: Steps) -> ScalerStep:
    """A ``scaler.step`` that records a step the scaler skips (inf/NaN found: no optimizer hook fires);
    a copy or pickle of the scaler gets its own ``step`` back (handles.py)."""
    original = scaler.step

    def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        before = rec.step
        out = original(optimizer, *args, **kwargs)
        if optimizer is rec.optimizer and rec.step == before:  # optimizer.step() never ran: no hook ended it
            rec.capture(skipped=True)
            rec.end_step()
        return out

    return ScalerStep(scaler, step)
