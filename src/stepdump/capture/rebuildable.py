"""Said when recording starts: a gradient log whose steps between keyframes can never be rebuilt.

A gradient log (``gradient_log=K``) stores the grads of every step and the full state every K
steps; a step in between is rebuilt on read by building the same torch.optim optimizer from the
keyframe and re-applying the recorded updates (docs/gradient-log.md). That needs the class to be
a torch.optim class (a reader never imports a class a run names) whose ``step()`` takes no
closure. Anything else (transformers' ``Adafactor``, schedule-free AdamW, a Lookahead wrapper, a
user's subclass) records fine, but only its keyframes will be readable: one warning now, with
what to use instead, rather than refusals at read time.
"""

from __future__ import annotations

import inspect
import logging

import torch

from stepdump.core.classes import class_id, dotted, is_torch_optimizer

log = logging.getLogger(__name__)

_INSTEAD = ("record every step in full (the default schedule), or keyframe_every=K and rebuild a step with "
            "stepdump.replay (it re-runs the training iterations)")


def why_not_rebuildable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a gradient log of ``optimizer`` could not rebuild the steps between keyframes (None: it can)."""
    cls = type(optimizer)
    if not is_torch_optimizer(cls):
        return (f"{dotted(class_id(cls))} is not a torch.optim class, and a reader re-applies updates with "
                "torch.optim's only")
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return f"{cls.__name__}.step() re-evaluates the loss (a closure), which recorded gradients cannot replace"
    return None


def warn_if_unrebuildable(optimizer: torch.optim.Optimizer) -> None:
    """One warning when a gradient log of ``optimizer`` will hold readable keyframes only."""
    why = why_not_rebuildable(optimizer)
    if why is not None:
        log.warning("stepdump: gradient_log=K will store the grads of every step, but only its keyframes (every "
                    "K steps) will be readable: %s. To read every step, %s.", why, _INSTEAD)
