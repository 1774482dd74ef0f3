"""What the framework callbacks share: GradScaler skips, resume checks, parameter names, log values."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepdump.core.layout import unwrap as unwrap_module
from stepdump.errors import ConfigError
from stepdump.store.format import CATALOG_FILE

log = logging.getLogger(__name__)


def found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a GradScaler that has unscaled ``optimizer`` found inf/NaN (so will skip its step).

    Reads the scaler's per-optimizer state, filled by ``scaler.unscale_``; False when
    there is no enabled scaler or it has not unscaled this optimizer yet.
    """
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return False
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
    found = state.get("found_inf_per_device") or {}
    return bool(sum(float(v.item()) for v in found.values()))


def check_resume(path: Path, start_step: int) -> None:
    """Refuse to append steps from ``start_step`` to a run that already has them, saying why."""
    if not (path / CATALOG_FILE).exists():
        return
    import stepdump

    with stepdump.open(path) as run:
        steps = run.all_steps
    if steps and steps[-1] >= start_step:
        raise ConfigError(
            f"{path} already holds steps up to {steps[-1]}, but training resumes from a checkpoint at step "
            f"{start_step}: steps {start_step}..{steps[-1]} were recorded after that checkpoint was saved. "
            "Record the resumed training into a new directory, or remove the old run first."
        )


def param_globs(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """fnmatch patterns that match exactly the parameters ``optimizer`` steps, by model name."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [_escape(n) for n, p in unwrap_module(model).named_parameters() if id(p) in mine]


def _escape(name: str) -> str:
    # fnmatch has no escape(); a special character inside brackets is literal.
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def scalar_items(logs: dict[str, Any], skip: Iterable[str] = ()) -> dict[str, float]:
    """The plain numbers in a framework's log dict (no bools, strings or nested values)."""
    skip = set(skip)
    return {
        k: float(v)
        for k, v in logs.items()
        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def unwrap(obj: Any, attr: str) -> Any:
    """Follow ``obj.<attr>`` through wrappers (Accelerate's optimizer/scheduler) to the torch object."""
    seen = 0
    while obj is not None and hasattr(obj, attr) and seen < 8:
        inner = getattr(obj, attr)
        if inner is None or inner is obj:
            break
        obj, seen = inner, seen + 1
    return obj
