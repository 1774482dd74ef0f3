"""The iteration of a Hugging Face ``Trainer`` recording, run by the Trainer itself: re-execution
without a train_step.

A run recorded by :class:`stepdump.integrations.transformers.StepdumpTrainerCallback` holds each
micro-batch the Trainer's ``training_step`` was given (the callback logs them) and, in its meta,
the Trainer's ``max_steps`` and ``logging_steps``. Given a ``Trainer`` built as for the run (same
model class and config, same ``TrainingArguments``), this builds what ``reexecute`` needs with the
Trainer's own code, so that what it does is what the recorded loop did:

- the optimizer and scheduler from ``trainer.create_optimizer_and_scheduler`` (its parameter
  groups and hyper-parameters; the scheduler sized by the recorded ``max_steps``);
- per optimizer step: ``num_items_in_batch`` from ``trainer._get_num_items_in_batch`` over the
  step's micro-batches, ``current_gradient_accumulation_steps`` set as the loop sets it, then
  ``trainer.training_step`` on each micro-batch (``compute_loss``, the division by the
  accumulation where the Trainer divides, ``accelerator.backward``);
- ``trainer._clip_grad_norm`` with ``max_grad_norm > 0``, then ``trainer._get_grad_norm``, *before*
  ``optimizer.step()``: the callback records at the optimizer's step pre-hook, after the Trainer
  clipped, so the grads compared are the clipped ones, as recorded;
- ``optimizer.step()``, ``lr_scheduler.step()``, ``model.zero_grad()``;
- the loss as the Trainer logs it with ``logging_steps=1``: the float32 sum of the micro-batch
  losses ``training_step`` returned (``_tr_loss``), as a Python float. With ``logging_steps > 1``
  the logged loss is a mean over a window of steps, so no loss is returned (not compared; a note
  says so).

The ``_``-prefixed Trainer methods are private API, called by name as the callback reaches
``_load_rng_state``; a Trainer without them is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepdump.errors import ConfigError

_NEEDED = ("training_step", "create_optimizer_and_scheduler", "_get_num_items_in_batch", "_clip_grad_norm",
           "_get_grad_norm")


def is_trainer(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``transformers.Trainer`` (no import of transformers here)."""
    return hasattr(obj, "args") and hasattr(obj, "model") and callable(getattr(obj, "training_step", None)) \
        and callable(getattr(obj, "create_optimizer_and_scheduler", None))


def supply(run: Any, setup: dict[str, Any], trainer: Any, optimizer: torch.optim.Optimizer | None,
           scheduler: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any, list[str]]:
    """``(model, optimizer, train_step, scheduler, notes)`` from ``trainer`` for an HF recording."""
    if not is_trainer(trainer):
        raise ConfigError(f"{run.path} was recorded by the HF Trainer callback: pass the transformers Trainer built "
                          f"as for the run (model, TrainingArguments), not a {type(trainer).__name__}; or pass "
                          "optimizer= and train_step=(model, optimizer, batch) -> loss")
    missing = [m for m in _NEEDED if not callable(getattr(trainer, m, None))]
    if missing:
        raise ConfigError(f"this Trainer has no {', '.join(missing)} (another transformers version): the recorded "
                          "iteration cannot be run by it; pass optimizer= and train_step=")
    args = trainer.args
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ConfigError("a DeepSpeed / FSDP Trainer is not re-executed (the callback does not record them either)")
    model: torch.nn.Module = trainer.model
    if optimizer is None:
        steps = int(setup.get("max_steps") or getattr(args, "max_steps", 0) or 0)
        if steps <= 0:
            raise ConfigError("the run's meta has no max_steps to size the Trainer's scheduler: pass optimizer= "
                              "and scheduler=")
        trainer.optimizer, trainer.lr_scheduler = None, None  # built afresh, as train() builds them
        trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    if optimizer is None:
        raise ConfigError("the Trainer created no optimizer: pass optimizer=")
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer the callback recorded
    max_norm = float(getattr(args, "max_grad_norm", 0) or 0)
    per_step_loss = int(setup.get("logging_steps") or getattr(args, "logging_steps", 1) or 1) == 1
    notes = [] if per_step_loss else [
        f"loss not compared: logging_steps={setup.get('logging_steps')} (the Trainer logs the mean loss over a "
        "window of steps, not this step's); grads, params and optimizer state are compared"]

    per_epoch = int(setup.get("steps_per_epoch") or 0)
    nan_filter = bool(getattr(args, "logging_nan_inf_filter", False))

    def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float | None:
        # One recorded call per micro-batch: a list of them, or one batch (a Mapping: HF inputs are dicts).
        micro = [batch] if isinstance(batch, Mapping) else list(batch)
        device = getattr(args, "device", None)
        done = int(getattr(scheduler, "last_epoch", -1))  # updates so far (the scheduler steps once per update)
        if per_epoch and done >= 0 and done % per_epoch == 0:
            _draw_epoch_order(trainer, done // per_epoch)
        num_items = trainer._get_num_items_in_batch(micro, device)
        trainer.current_gradient_accumulation_steps = len(micro)
        total = torch.tensor(0.0, device=device)  # the Trainer's _tr_loss (float32)
        filtered = False
        for inputs in micro:
            step_loss = trainer.training_step(m, dict(inputs), num_items)
            filtered |= bool(nan_filter and not torch.isfinite(step_loss).all())
            total += step_loss
        # Before step(), as the loop does: the recorded grads are the clipped ones. _get_grad_norm
        # (the logged grad_norm) clips at inf without max_grad_norm: a no-op on finite grads, but
        # it multiplies by NaN where the norm is not finite, so it is run too.
        trainer._get_grad_norm(m, grad_norm=trainer._clip_grad_norm(m) if max_norm > 0 else None)
        opt.step()
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        m.zero_grad()
        if filtered:  # the Trainer logged a substitute (logging_nan_inf_filter), not this loss
            note = "loss not compared: a micro-batch loss is NaN/Inf and logging_nan_inf_filter replaced it in the log"
            if note not in notes:
                notes.append(note)
            return None
        return float(total.item()) if per_step_loss else None

    return model, inner, train_step, scheduler, notes


def _draw_epoch_order(trainer: Any, epoch: int) -> None:
    """What the Trainer's data loader draws from the RNG at an epoch's first batch (its sampler's
    order), by the Trainer's own loader: the record's RNG of an epoch's first step is the state
    before that draw (the moment a checkpoint saves, which an export and a resume need)."""
    if getattr(trainer, "train_dataset", None) is None:
        raise ConfigError(f"this step begins epoch {epoch}: its dropout draws from the RNG after the Trainer's data "
                          "loader drew the epoch's order; build the Trainer with the run's train_dataset")
    loader = trainer.get_train_dataloader()
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    next(iter(loader))  # the batch itself is the recorded one; only the draw is wanted
