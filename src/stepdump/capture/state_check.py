"""Said at the first step that shows it: optimizer state that ``state_dict()`` holds and the record does not.

The record takes the optimizer state per param from the optimizer's ``state`` (for a wrapper
that keeps none, from the optimizer holding it: core/wrappers.py ``state_holder``). An optimizer
class may keep more in ``state_dict()`` than that: a subclass adding its own entries, a wrapper
keeping its slow weights beside the state. Such state is not recorded, so a restore would not
bring it back and the run would go on differently. Until it is recorded, :class:`StateCheck`
compares, at the step pre-hook of the first :data:`STEPS` steps, the tensors ``state_dict()``
holds with those the record takes, and warns once naming what is missing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

STEPS = 64  # steps looked at (state appears in the first steps: Adam's at step 1, a Lookahead's at k)


class StateCheck:
    """Compares ``optimizer.state_dict()`` with ``holder.state`` at the first steps (module docstring).

    Only for a class that overrides ``state_dict()``: torch's own builds it from ``state``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, holder: torch.optim.Optimizer) -> None:
        self._optimizer, self._holder = optimizer, holder
        self._left = STEPS if type(optimizer).state_dict is not torch.optim.Optimizer.state_dict else 0

    def look(self, *args: Any) -> None:
        """A step pre-hook: warn once if ``state_dict()`` holds tensors the record does not take."""
        if self._left <= 0:
            return
        self._left -= 1
        try:
            missing = self.missing()
        except Exception as e:  # noqa: BLE001 - do no harm: a hint is not worth a failure
            log.debug("stepdump: could not compare %s.state_dict() with its state: %s",
                      type(self._optimizer).__name__, e)
            self._left = 0
            return
        if missing:
            self._left = 0
            name = type(self._optimizer).__name__
            log.warning(
                "stepdump: %s.state_dict() holds optimizer state that stepdump does not record (%s): it takes "
                "the state per param from %s.state. A restore of this run will not bring that state back, so "
                "training restored from it goes on differently. Keep the state in optimizer.state[param] (as "
                "torch.optim does), or record the object holding it with Recorder(extra_state={...}).",
                name, ", ".join(missing), type(self._holder).__name__)

    def missing(self) -> list[str]:
        """What ``state_dict()`` holds as tensors beyond the per-param state the record takes:
        ``state`` keys (``exp_avg``) and other top-level entries (``slow_state``)."""
        sd = self._optimizer.state_dict()
        taken = {k for st in self._holder.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
        keys = {k for st in (sd.get("state") or {}).values() if isinstance(st, dict)
                for k, v in st.items() if isinstance(v, torch.Tensor) and k not in taken}
        extra = [k for k, v in sd.items() if k not in ("state", "param_groups") and _holds_tensor(v)]
        return [f"state key {k!r}" for k in sorted(keys)] + [f"entry {k!r}" for k in extra]


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 4:
        return False
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False
