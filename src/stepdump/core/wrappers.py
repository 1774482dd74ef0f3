"""The torch objects inside the wrappers training libraries put around them.

accelerate's ``prepare`` returns an ``AcceleratedOptimizer`` (the optimizer in ``.optimizer``)
and an ``AcceleratedScheduler`` (the scheduler in ``.scheduler``). The wrapper decides *whether*
to step (gradient accumulation: only when the gradients are synced); the object inside holds
the state and does the update. stepdump records, and restores into, the object inside: the
wrapper skips ``Optimizer.__init__``, so it has no step hooks, and its class is not the class
of the state.
"""

from __future__ import annotations

from typing import Any

import torch

from stepdump.errors import ConfigError

_DEPTH = 8  # wrappers followed at most (a cycle of attributes must not loop for ever)


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer inside ``optimizer`` when it is an optimizer that delegates to another one
    held in ``.optimizer`` (accelerate's ``AcceleratedOptimizer``); else ``optimizer`` itself.

    Only an optimizer wrapping an optimizer is followed: an LR scheduler also has ``.optimizer``,
    and a scheduler given where the optimizer goes must still be refused as one.
    """
    seen = 0
    while (isinstance(optimizer, torch.optim.Optimizer) and seen < _DEPTH
           and isinstance(inner := getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
           and inner is not optimizer):
        optimizer, seen = inner, seen + 1
    return optimizer


def inner_scheduler(scheduler: Any) -> Any:
    """The LR scheduler inside ``scheduler`` when it wraps one in ``.scheduler`` (accelerate's
    ``AcceleratedScheduler``); else ``scheduler`` itself (None stays None)."""
    seen = 0
    while (scheduler is not None and seen < _DEPTH and hasattr(inner := getattr(scheduler, "scheduler", None),
                                                                  "state_dict") and inner is not scheduler):
        scheduler, seen = inner, seen + 1
    return scheduler


def state_holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` holds what ``optimizer.state_dict()`` returns, mapped to params.

    ``optimizer`` itself, except for a wrapper that keeps no state of its own and shares its
    param groups (the very list) with an optimizer it holds, whose ``state_dict()`` it returns:
    timm's Lookahead (``_base_optimizer``: Adam's moments and the slow weights). Restoring goes
    through the wrapper's ``load_state_dict``, which loads the same state back into that one.
    """
    if type(optimizer).state_dict is torch.optim.Optimizer.state_dict or getattr(optimizer, "state", None):
        return optimizer
    for value in vars(optimizer).values():
        if (isinstance(value, torch.optim.Optimizer) and value is not optimizer
                and value.param_groups is optimizer.param_groups):
            return value
    return optimizer


def require_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer built without ``torch.optim.Optimizer.__init__`` (a wrapper that sets its
    own attributes): it has no step hooks, so no step of it could ever be seen."""
    if not all(hasattr(optimizer, a) for a in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")):
        raise ConfigError(
            f"{type(optimizer).__name__} has no step hooks (it was built without torch.optim.Optimizer.__init__), "
            "so stepdump cannot see its steps; give the Recorder the optimizer it wraps, whose step() does the "
            "update, or have its __init__ call super().__init__(params, defaults)")
    # A wrapper that made the hook dicts itself (timm's Lookahead) runs them only once torch has wrapped
    # its class's step(), which Optimizer.__init__ does and zero_grad() does late: wrap it now, as torch would.
    if not getattr(type(optimizer).step, "hooked", False) and hasattr(optimizer, "_patch_step_function"):
        optimizer._patch_step_function()
