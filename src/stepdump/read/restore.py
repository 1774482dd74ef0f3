"""Restore a recorded step into live model / optimizer / scheduler / scaler / RNG.

Everything is read and checked first; only then is anything changed, so a
mismatch leaves the caller's objects exactly as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stepdump.capture.rng import set_rng_state
from stepdump.errors import ConfigError, RestoreMismatchError
from stepdump.store.format import parse_shape

if TYPE_CHECKING:
    from stepdump.read.run import Run


def restore(run: Run, step: int, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
            scaler: Any = None, *, rng: bool = True) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"restore needs the model (a torch.nn.Module), got {type(model).__name__}")
    from stepdump.read.distributed import has_dtensors, restore_sharded

    if has_dtensors(model):  # FSDP2 / tensor parallel: this rank's shards go into its DTensors
        return restore_sharded(run, step, model, optimizer, scheduler, scaler, rng=rng)
    meta = run.meta
    sd = run.state_dict(step)
    _check_model(run, model, sd)
    osd = None
    if optimizer is not None:
        _check_class("optimizer", optimizer, meta.get("optimizer_class"))
        osd = run.optimizer_state_dict(step)
        _check_optimizer(run, step, optimizer, osd)
    if scheduler is not None:
        _check_class("scheduler", scheduler, meta.get("scheduler_class"))
    state = side_state(run, step, scheduler, scaler, rng)
    # All checks passed: apply.
    apply(model, sd, optimizer, osd, scheduler, scaler, state, rng)


def side_state(run: Run, step: int, scheduler: Any, scaler: Any, rng: bool) -> dict[str, Any]:
    """The step's scheduler / scaler / RNG state, checked against what the caller wants restored."""
    state = run.step_state(step)
    if scheduler is not None and state.get("scheduler") is None:
        raise RestoreMismatchError(f"{run.path} recorded no LR scheduler; call restore without scheduler=")
    if scaler is not None and state.get("scaler") is None:
        raise RestoreMismatchError(f"{run.path} recorded no GradScaler; call restore without scaler=")
    if rng and "rng" not in state:
        raise RestoreMismatchError(f"step {step} has no RNG state; pass rng=False to restore without it")
    return state


def apply(model: torch.nn.Module, sd: Any, optimizer: Any, osd: Any, scheduler: Any, scaler: Any,
          state: dict[str, Any], rng: bool) -> None:
    """Load checked state into the live objects (nothing is checked here)."""
    model.load_state_dict(sd, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(osd)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    if rng:
        set_rng_state(state["rng"])


def _check_class(what: str, obj: Any, recorded: str | None) -> None:
    if recorded is not None and type(obj).__name__ != recorded:
        raise RestoreMismatchError(
            f"the run recorded a {recorded} {what}, but a {type(obj).__name__} was given; build the same {what} "
            "as the recorded run"
        )


def _check_model(run: Run, model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    live = model.state_dict()
    for key in live:
        if key not in sd:
            raise RestoreMismatchError(
                f"the model has {key!r}, which the run did not record (recorded model: "
                f"{run.meta.get('model_class')}); restore into the same architecture"
            )
    for key, t in sd.items():
        if key not in live:
            raise RestoreMismatchError(f"the run has {key!r}, which the model does not; restore into the same architecture")
        lt = live[key]
        if tuple(lt.shape) != tuple(t.shape) or lt.dtype != t.dtype:
            raise RestoreMismatchError(
                f"{key!r}: the run has {t.dtype} {tuple(t.shape)}, the model has {lt.dtype} {tuple(lt.shape)}; "
                "restore into the same architecture and dtype"
            )


def _check_optimizer(run: Run, step: int, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    groups = osd["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise RestoreMismatchError(
            f"the run's optimizer had {len(groups)} param groups, this one has {len(optimizer.param_groups)}; "
            "build the optimizer with the same groups"
        )
    names = [g["params"] for g in run.step_state(step)["groups"]]
    shapes = dict(
        run._con.execute(
            "SELECT s.name, t.shape FROM tensors t JOIN series s ON s.id = t.series "
            "WHERE t.step = ? AND s.kind = 'params'",
            (step,),
        ).fetchall()
    )
    for i, (recorded, live) in enumerate(zip(names, optimizer.param_groups, strict=True)):
        if len(recorded) != len(live["params"]):
            raise RestoreMismatchError(
                f"param group {i}: the run had {len(recorded)} parameters, this optimizer has {len(live['params'])}"
            )
        for j, (name, p) in enumerate(zip(recorded, live["params"], strict=True)):
            shape = shapes.get(name)
            if shape is not None and parse_shape(shape) != tuple(p.shape):
                raise RestoreMismatchError(
                    f"param group {i}, parameter {j} ({name!r}): the run has shape {parse_shape(shape)}, "
                    f"the optimizer's parameter has {tuple(p.shape)}; pass parameters in the same order"
                )
