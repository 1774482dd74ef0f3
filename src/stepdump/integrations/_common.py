"""What the framework callbacks share: GradScaler skips, parameter names, log values."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from stepdump.core.layout import unwrap as unwrap_module
from stepdump.errors import ConfigError
from stepdump.read.export_trainers import TRAINER_META_KEY

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


def with_trainer_setup(metadata: Any, setup: dict[str, Any]) -> dict[str, Any]:
    """The Recorder's ``metadata=`` with the framework's loop setup added under
    ``stepdump.trainer`` (read by ``run.export(format="hf-trainer" | "lightning")``).

    Values JSON cannot hold (the inf batches of an iterable loader) become the text
    ``"inf"``; a ``stepdump.trainer`` the user gave wins.
    """
    clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in setup.items()}
    return {TRAINER_META_KEY: clean, **dict(metadata or {})}


def with_grad_clip(metadata: dict[str, Any] | None, clip: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Recorder's ``metadata`` with ``grad_clip`` (how the framework clips) added, unless given.

    ``stepdump.check`` reads it (docs/checks.md, ``exploding_gradient``): whether
    the recorded grads are before or after clipping, the clip value, and which
    logged scalar holds the norm before clipping.
    """
    if not clip:
        return metadata
    out = dict(metadata or {})
    out.setdefault("grad_clip", clip)
    return out
