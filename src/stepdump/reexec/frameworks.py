"""The iteration of a framework's recording, built from its module: re-execution without a train_step.

A run recorded by :class:`stepdump.integrations.lightning.StepdumpCallback` holds, in its meta,
how the Trainer iterated (``accumulate_grad_batches``, ``grad_clip``, the scheduler's interval)
and, at every step, each micro-batch (the callback logs them). From those and the
LightningModule this builds what ``reexecute`` needs: the optimizer (``configure_optimizers``)
and a ``train_step`` doing what Lightning's automatic optimization does for one optimizer step:
``training_step`` per micro-batch, each loss divided by the accumulation and backpropagated,
then (after the grads are fingerprinted: Lightning records them before it clips) the clipping,
``optimizer.step()`` and a per-step scheduler. It returns the loss as the callback logged it
(the mean of the micro-batch losses, the normalisation undone).

Refused with the reason where that would not be the recorded iteration: manual optimization,
several optimizers, a module that clips its own way (``configure_gradient_clipping``).
A run recorded by the HF Trainer callback is re-executed by its Trainer (reexec/hf_trainer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stepdump.errors import ConfigError
from stepdump.read.export_trainers import TRAINER_META_KEY
from stepdump.reexec import hf_trainer

TrainStep = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]


def supply(run: Any, module: Any, optimizer: torch.optim.Optimizer | None,
           scheduler: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainStep, Any, list[str]]:
    """``(model, optimizer, train_step, scheduler, notes)`` for a framework's recording, or a
    ConfigError. ``module``: the LightningModule, or the HF ``Trainer`` (reexec/hf_trainer.py)."""
    meta_user = run.meta.get("user")
    user: dict[str, Any] = meta_user if isinstance(meta_user, dict) else {}
    raw = user.get(TRAINER_META_KEY)
    setup: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if setup.get("framework") == "hf-trainer":
        return hf_trainer.supply(run, setup, module, optimizer, scheduler)
    if setup.get("framework") != "lightning" or not hasattr(module, "training_step") or hf_trainer.is_trainer(module):
        what = f"a {setup['framework']} recording" if setup.get("framework") else "not recorded by a framework callback"
        raise ConfigError(f"{run.path} is {what}: pass train_step=(model, optimizer, batch) -> loss, one iteration as "
                          "the loop ran it (a Lightning run re-executes from its LightningModule without one, an "
                          "HF Trainer run from its Trainer)")
    return (module, *_lightning(user, setup, module, optimizer, scheduler))


def _configured(module: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The one optimizer (and its scheduler) ``configure_optimizers`` returns, in any of its shapes."""
    got = module.configure_optimizers()
    sched = None
    if isinstance(got, (list, tuple)) and len(got) == 2 and all(isinstance(x, (list, tuple)) for x in got):
        opts, scheds = list(got[0]), list(got[1])
        sched = scheds[0] if len(scheds) == 1 else None
        got = opts
    if isinstance(got, (list, tuple)):
        if len(got) != 1:
            raise ConfigError(f"configure_optimizers returned {len(got)} optimizers: each optimizer is recorded as a "
                              "run of its own (opt0, opt1, ...); pass optimizer= and train_step= for one of them")
        got = got[0]
    if isinstance(got, dict):
        sched = got.get("lr_scheduler")
        got = got.get("optimizer")
    if isinstance(sched, dict):
        sched = sched.get("scheduler")
    if not isinstance(got, torch.optim.Optimizer):
        raise ConfigError(f"configure_optimizers returned {type(got).__name__}, not an optimizer: pass optimizer=")
    return got, sched


def _lightning(user: dict[str, Any], setup: dict[str, Any], module: Any, optimizer: torch.optim.Optimizer | None,
               scheduler: Any) -> tuple[torch.optim.Optimizer, TrainStep, Any, list[str]]:
    if not getattr(module, "automatic_optimization", True):
        raise ConfigError("the LightningModule uses manual optimization: its training_step steps the optimizer "
                          "itself with the Trainer's helpers; pass train_step= (and optimizer=)")
    raw_clip = user.get("grad_clip")
    clip: dict[str, Any] = raw_clip if isinstance(raw_clip, dict) else {}
    try:
        import lightning.pytorch as pl

        own_clip = type(module).configure_gradient_clipping is not pl.LightningModule.configure_gradient_clipping
    except ImportError:
        own_clip = False
    if clip and own_clip:
        raise ConfigError(f"{type(module).__name__} overrides configure_gradient_clipping: how it clips is not "
                          "recorded, so it cannot be re-run without the Trainer; pass train_step=")
    if optimizer is None:
        optimizer, configured = _configured(module)
        scheduler = scheduler if scheduler is not None else configured
    accumulate = int(setup.get("accumulate_grad_batches") or 1)
    per_step = setup.get("scheduler_interval") == "step"
    notes = ["Lightning iteration built from the module: training_step's batch_idx is counted from the first step "
             "(a module that reads it past the first epoch sees other values)"]

    def clip_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]  # Lightning's main_params order
        if clip.get("algorithm") == "value":
            torch.nn.utils.clip_grad_value_(params, clip_value=clip["max_value"])
        else:
            torch.nn.utils.clip_grad_norm_(params, clip["max_norm"])

    def train_step(model: Any, opt: torch.optim.Optimizer, batch: Any) -> float:
        micro = list(batch) if accumulate > 1 else [batch]
        losses = []
        start = int(opt.state.get(opt.param_groups[0]["params"][0], {}).get("step", 0))  # updates so far
        for i, b in enumerate(micro):
            out = model.training_step(b, start * accumulate + i)
            loss = out.get("loss") if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):
                raise ConfigError(f"training_step returned no loss tensor for micro-batch {i} (Lightning skips such a "
                                  "step; it was recorded, so this is not the recorded iteration): pass train_step=")
            norm = loss / accumulate  # what Lightning's closure backpropagates
            norm.backward()
            shown = norm.detach().clone()
            losses.append(shown * accumulate if accumulate > 1 else shown)  # as the callback logs it
        # Lightning records the grads before it clips: clip in a pre-hook that runs after the
        # re-execution's own (registered before train_step was called).
        handle = opt.register_step_pre_hook(clip_hook) if clip else None
        try:
            opt.step()
        finally:
            if handle is not None:
                handle.remove()
        if per_step and scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        return float(torch.stack(losses).mean())

    return optimizer, train_step, scheduler, notes
