"""Hugging Face Transformers: record every optimizer step of ``Trainer.train`` with one callback.

```python
from stepdump.integrations.transformers import StepdumpTrainerCallback

trainer = Trainer(model, args, train_dataset=ds,
                  callbacks=[StepdumpTrainerCallback("runs/exp1", every=10)])
trainer.train()
run = stepdump.open("runs/exp1")
```
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

from stepdump.capture.recorder import Recorder
from stepdump.core.wrappers import inner_optimizer, inner_scheduler
from stepdump.errors import ConfigError
from stepdump.integrations._common import scalar_items, with_grad_clip, with_trainer_setup

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "stepdump.integrations.transformers needs Hugging Face Transformers: pip install transformers "
        "(or pip install 'stepdump[integrations]')"
    ) from e

log = logging.getLogger(__name__)

__all__ = ["StepdumpTrainerCallback"]

# The Trainer method that restores a checkpoint's RNG (transformers 4.x and 5.x).
_RESTORE = "_load_rng_state"

# The summary ``Trainer.train`` logs once at the end is about the whole run, not a step.
_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")


class StepdumpTrainerCallback(TrainerCallback):
    """Record every optimizer step of a Hugging Face ``Trainer`` into a stepdump run.

    **When a step is recorded.** A :class:`stepdump.Recorder` is attached to the
    (unwrapped) torch optimizer when training begins, so each record is taken
    at the optimizer's step pre-hook, inside ``optimizer.step()``. The Trainer
    calls ``optimizer.step()`` once per optimizer step, after gradient
    accumulation, after unscaling (fp16) and **after** clipping to
    ``max_grad_norm``: record *t* holds the params before update *t*, the
    accumulated, unscaled, **clipped** gradients the update used, and the
    optimizer state before update *t*. The LR scheduler's state is recorded
    before its ``step()`` for update *t* (so ``lr`` is the rate update *t*
    used), and the fp16 GradScaler's state with it; a step the scaler skips is
    recorded and marked skipped.

    **Scalars.** Every number the Trainer logs (``on_log``: ``loss``,
    ``grad_norm`` — the norm *before* clipping — ``learning_rate``, ``epoch``,
    eval metrics) goes to the step that was just taken. The Trainer's ``loss``
    is the mean over the steps since the previous log, so set
    ``logging_steps=1`` for a loss per step. ``lr`` is added by the Recorder.
    With ``max_grad_norm > 0`` the run's metadata says so (``grad_clip``), and
    ``stepdump.check`` judges exploding gradients by the logged pre-clip
    ``grad_norm`` rather than the clipped grads (``logging_steps=1`` gives it
    at every step).

    **Batches.** Every micro-batch the Trainer's ``training_step`` is given goes to
    ``log_batch`` (the callback wraps ``training_step`` on the Trainer instance that
    called ``on_train_begin``; it only reads the inputs), so
    ``stepdump.reexecute(run, k, trainer)`` re-executes a step from a Trainer alone.

    **Resuming.** ``trainer.train(resume_from_checkpoint=...)`` records into the
    same run (``resume=True``) from ``state.global_step``; steps the run already
    has from there on (recorded after that checkpoint was saved) are dropped and
    recorded again, so the run stays one history (``run.meta["history"]``).
    The Trainer restores the checkpoint's RNG only after ``on_train_begin``
    (``Trainer._load_rng_state``: at the start of the resumed epoch, or after the
    skipped batches of a mid-epoch resume), so the callback has the Trainer's
    ``_load_rng_state`` take the first record's start state again right after it
    restores: that record holds the RNG the original run had at that step, from
    before the data loader draws the next epoch's order.

    Only the main process records; DeepSpeed and FSDP (sharded parameters) are
    not supported.

    Args:
        path: Directory of the run.
        **recorder_kwargs: Passed to :class:`stepdump.Recorder` (``capture``,
            ``every``, ``include``, ``codec``, ..., or the groups ``record=``,
            ``schedule=``, ``store=``). ``resume`` and ``start_step`` default
            as described above.
    """

    def __init__(self, path: str | os.PathLike[str], **recorder_kwargs: Any) -> None:
        for key in ("model", "optimizer", "scheduler", "scaler", "auto_capture"):
            if key in recorder_kwargs:
                raise ConfigError(f"StepdumpTrainerCallback sets {key}= itself (it finds the training objects and "
                                  "when to record); do not pass it")
        self.path = Path(path)
        self.recorder_kwargs = recorder_kwargs
        self._recorder: Recorder | None = None
        self._unwatch: Any = None  # undoes the watch on the Trainer's RNG restore
        self._first_begin = False  # no Trainer found on resume: retake the start state at the first step

    @property
    def recorder(self) -> Recorder:
        """The Recorder of the training in progress (log more scalars with ``recorder.log``)."""
        if self._recorder is None:
            raise ConfigError("no training is in progress: the Recorder exists from on_train_begin to on_train_end")
        return self._recorder

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        self._close()
        if not state.is_world_process_zero:
            return
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise ConfigError("StepdumpTrainerCallback does not support DeepSpeed or FSDP (sharded parameters)")
        if model is None or optimizer is None:
            log.warning("stepdump: the Trainer gave no model or optimizer to on_train_begin; nothing is recorded")
            return
        # Accelerate wraps the optimizer and scheduler; the Recorder hooks the torch ones
        # (whose state_dicts restore into plain torch objects) and the wrapper's GradScaler.
        scaler = getattr(optimizer, "scaler", None)
        opt = inner_optimizer(optimizer)
        sched = inner_scheduler(lr_scheduler)
        kwargs_ = dict(self.recorder_kwargs)
        resume = kwargs_.pop("resume", None)
        if resume is None:
            resume = state.global_step > 0
        start = kwargs_.pop("start_step", None)
        if start is None and resume:  # steps the run has from there on are dropped and recorded again
            start = state.global_step
        kwargs_["metadata"] = with_trainer_setup(kwargs_.get("metadata"), _setup(args, state, kwargs))
        # Grads are recorded after max_grad_norm clipping; the pre-clip norm is the logged grad_norm.
        max_norm = getattr(args, "max_grad_norm", None) or 0
        clip = {"max_norm": float(max_norm), "grads": "clipped", "norm_scalar": "grad_norm"} if max_norm > 0 else None
        kwargs_["metadata"] = with_grad_clip(kwargs_.get("metadata"), clip)
        self._recorder = Recorder(self.path, model, opt, scheduler=sched, scaler=scaler, resume=resume,
                                  start_step=start, **kwargs_)
        trainer = _calling_trainer()
        self._log_micro_batches(trainer)
        if state.global_step > 0:  # a resume: the Trainer restores the checkpoint's RNG after this
            self._watch_rng_restore(trainer)
        log.info("stepdump: recording into %s from step %d", self.path, self._recorder.step)

    def _log_micro_batches(self, trainer: Any) -> None:
        """Have the Trainer's ``training_step`` log each micro-batch it is given (``rec.log_batch``):
        every micro-batch of an accumulation step, as a user line would. Callbacks see no inputs,
        and a forward hook would also see evaluation batches; ``training_step(model, inputs, ...)``
        is called once per training micro-batch, with the batch as the data loader gave it."""
        original = getattr(trainer, "training_step", None) if trainer is not None else None
        if trainer is None or not callable(original):
            log.warning("stepdump: no Trainer called on_train_begin; the batches are not recorded (a step is "
                        "re-executed only with batch=)")
            return
        rec = self._recorder

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if rec is not None and rec is self._recorder:
                try:  # reads the tensors only (fingerprint, copy): the step is unchanged
                    rec.log_batch(inputs)
                except ConfigError as e:  # a batch without tensors: nothing to identify it by
                    log.debug("stepdump: a micro-batch was not logged: %s", e)
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = training_step  # an instance attribute: this Trainer only
        undo = self._unwatch

        def unwatch() -> None:
            if trainer.__dict__.get("training_step") is training_step:
                del trainer.__dict__["training_step"]
            if undo is not None:
                undo()
        self._unwatch = unwatch

    def _watch_rng_restore(self, trainer: Any) -> None:
        """Have the Trainer that called ``on_train_begin`` retake the first record's start state
        right after its ``_load_rng_state`` (the only moment between its restore and the data
        loader's next draw). Callbacks are not given the Trainer: it is the ``self`` of a caller."""
        # The Trainer's own (private) restore is the only hook at the right moment; it is reached
        # by name, as _common.found_inf reads the GradScaler's state, and left as it was at the end.
        original = getattr(trainer, _RESTORE, None) if trainer is not None else None
        if trainer is None or not callable(original):
            self._first_begin = True
            log.warning("stepdump: no Trainer with _load_rng_state called on_train_begin; the first resumed "
                        "record takes its RNG at on_step_begin, after the data loader's draw at an epoch start")
            return
        rec = self._recorder

        def load_rng_state(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if rec is not None and rec is self._recorder:
                rec.begin_iteration()  # never raises: a failure is the Recorder's warning
            return out

        setattr(trainer, _RESTORE, load_rng_state)  # an instance attribute: this Trainer only

        undo = self._unwatch

        def unwatch() -> None:
            if trainer.__dict__.get(_RESTORE) is load_rng_state:
                del trainer.__dict__[_RESTORE]
            if undo is not None:
                undo()
        self._unwatch = unwatch

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._first_begin and self._recorder is not None:
            self._first_begin = False
            self._recorder.begin_iteration()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self._recorder is None or not logs or any(k in logs for k in _SUMMARY_KEYS):
            return
        # Logged after optimizer.step() of the step just taken, so rec.log gives it to that step.
        # An evaluation log repeats "epoch"; a second "epoch" for the same step would be
        # pushed to the next step, so only training logs (with "loss") give it.
        values = scalar_items(logs, skip=() if "loss" in logs else ("epoch",))
        if values:
            self._recorder.log(**values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        rec, self._recorder = self._recorder, None
        unwatch, self._unwatch = self._unwatch, None
        self._first_begin = False
        if unwatch is not None:
            unwatch()
        if rec is not None:
            rec.close()


def _calling_trainer(depth: int = 8) -> Any:
    """The ``transformers.Trainer`` among the callers (its training loop calls the callbacks)."""
    from transformers import Trainer

    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def _setup(args: Any, state: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``trainer_state.json`` needs beyond the record, for ``run.export(format="hf-trainer")``."""
    loader = kwargs.get("train_dataloader")
    accumulate = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
    try:
        per_epoch: int | None = max(1, -(-len(loader) // accumulate)) if loader is not None else None
    except TypeError:  # an iterable dataset has no length
        per_epoch = None
    return {"framework": "hf-trainer", "train_batch_size": state.train_batch_size,
            "logging_steps": state.logging_steps, "eval_steps": state.eval_steps, "save_steps": state.save_steps,
            "max_steps": state.max_steps, "num_train_epochs": state.num_train_epochs,
            "steps_per_epoch": per_epoch}
