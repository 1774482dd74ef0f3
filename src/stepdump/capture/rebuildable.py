"""Said when recording starts: a gradient log whose steps between keyframes can never be rebuilt.

A gradient log (``gradient_log=K``) stores the grads of every step and the full state every K
steps; a step in between is rebuilt on read by building the same torch.optim optimizer from the
keyframe and re-applying the recorded updates (docs/gradient-log.md). That needs the class to be
a torch.optim class (a reader never imports a class a run names) whose ``step()`` takes no
closure. Anything else (transformers' ``Adafactor``, schedule-free AdamW, a Lookahead wrapper, a
user's subclass) records fine, but only its keyframes will be readable: one warning now, with
what to use instead, rather than refusals at read time.

A torch.optim optimizer can still defeat the rebuild when something else writes its state
between two of its steps (a Lookahead around the Adam given to the Recorder adds
``lookahead_slow_buff``): :class:`GainedState` says so at the first step that shows it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

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


class GainedState:
    """Optimizer state keys that appear between two steps, outside ``step()`` (module docstring).

    The step post-hook notes the state keys of two sampled params (the first and the last the
    optimizer holds: a wrapper writes every param's state), the next pre-hook compares; a key
    gained in between is warned about once, and the watch ends. Cheap enough for every step of
    a gradient log: two dict lookups per hook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[], int]) -> None:
        self._optimizer, self._step = optimizer, step
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._sample = list({id(p): p for p in params[:1] + params[-1:]}.values())
        self._after: list[set[str]] | None = None
        self.done = False

    def _keys(self) -> list[set[str]]:
        state = self._optimizer.state
        return [set(state[p]) if p in state else set() for p in self._sample]

    def after_step(self, *args: Any) -> None:
        """The step post-hook: the keys ``step()`` left."""
        if not self.done:
            self._after = self._keys()

    def before_step(self, *args: Any) -> None:
        """The step pre-hook: a key gained since the last step ended is said, once."""
        if self.done or self._after is None:
            return
        try:
            gained = sorted({k for now, then in zip(self._keys(), self._after, strict=True) for k in now - then})
        except Exception as e:  # noqa: BLE001 - do no harm: a hint is not worth a failure
            log.debug("stepdump: the optimizer state watch stopped: %s", e)
            self.done = True
            return
        if gained:
            self.done = True
            name = type(self._optimizer).__name__
            log.warning(
                "stepdump: %s's state gained %s before step %d, outside %s.step() (something around the optimizer "
                "writes it: a Lookahead wrapper's slow weights); a gradient log re-applies step() only, so steps "
                "between keyframes from here on cannot be rebuilt and will not be readable. To read every step, %s.",
                name, ", ".join(repr(k) for k in gained), self._step(), name, _INSTEAD)
