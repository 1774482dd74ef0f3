"""Triggers for the flight-recorder ring buffer: when to write the last N steps.

A trigger is any callable ``trigger(info: TriggerInfo) -> bool``, evaluated at
every optimizer step (in the pre-hook, grads final). Built-ins:
``nan_inf()`` and ``loss_spike()``; strings ``"nan_inf"`` / ``"loss_spike"``
name them with default settings.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stepdump.errors import ConfigError


@dataclass
class TriggerInfo:
    """What a trigger can look at for step ``step``."""

    step: int
    scalars: dict[str, float]  # latest value of every scalar logged so far
    grads: list[torch.Tensor]
    _history: dict[str, deque[float]] = field(default_factory=dict)

    def history(self, name: str) -> list[float]:
        """Recent values of scalar ``name``, oldest first (up to the recorder's window)."""
        return list(self._history.get(name, ()))

    def grads_finite(self) -> bool:
        """True when every gradient is free of NaN/Inf (one fused norm over all grads)."""
        if not self.grads:
            return True
        # A sparse grad is finite when its stored values are (norms have no sparse kernel).
        norms = torch._foreach_norm([g._values() if g.layout == torch.sparse_coo else g for g in self.grads])
        return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


Trigger = Callable[[TriggerInfo], bool]


def nan_inf() -> Trigger:
    """Fire when a gradient or a logged scalar is NaN or infinite."""

    def fire(info: TriggerInfo) -> bool:
        if any(not math.isfinite(v) for v in info.scalars.values()):
            return True
        return not info.grads_finite()

    fire.__name__ = "nan_inf"
    return fire


def loss_spike(z: float = 6.0, name: str = "loss", min_history: int = 10) -> Trigger:
    """Fire when the latest ``name`` is more than ``z`` robust z-scores above its recent median."""
    if z <= 0 or min_history < 3:
        raise ConfigError("loss_spike needs z > 0 and min_history >= 3")

    def fire(info: TriggerInfo) -> bool:
        hist = info.history(name)
        if len(hist) < min_history + 1:
            return False
        *past, last = hist
        med = statistics.median(past)
        mad = statistics.median(abs(v - med) for v in past) * 1.4826
        if not math.isfinite(last):
            return True
        return mad > 0 and (last - med) / mad > z

    fire.__name__ = "loss_spike"
    return fire


def resolve(trigger: Trigger | str | None) -> Trigger:
    if trigger is None or trigger == "nan_inf":
        return nan_inf()
    if trigger == "loss_spike":
        return loss_spike()
    if callable(trigger):
        return trigger
    raise ConfigError(f"trigger={trigger!r}: give 'nan_inf', 'loss_spike' or a callable(info) -> bool")
