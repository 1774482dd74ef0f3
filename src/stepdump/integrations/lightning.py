"""PyTorch Lightning: record every optimizer step of ``Trainer.fit`` with one callback.

```python
from stepdump.integrations.lightning import StepdumpCallback

trainer = L.Trainer(callbacks=[StepdumpCallback("runs/exp1", every=10)])
trainer.fit(model, data)
run = stepdump.open("runs/exp1")
```

Works with ``lightning`` (``lightning.pytorch``) or the standalone
``pytorch_lightning`` package, whichever is installed (``lightning`` first).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from stepdump.capture.recorder import Recorder
from stepdump.errors import ConfigError
from stepdump.integrations._common import found_inf, param_globs, with_grad_clip, with_trainer_setup

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "stepdump.integrations.lightning needs PyTorch Lightning: pip install lightning "
            "(or pip install 'stepdump[integrations]')"
        ) from e

log = logging.getLogger(__name__)

__all__ = ["StepdumpCallback"]


class StepdumpCallback(pl.Callback):
    """Record every optimizer step of a Lightning fit into a stepdump run.

    **When a step is recorded.** At ``on_before_optimizer_step``: after the
    closure has run forward and backward for every micro-batch of the step
    (so after gradient accumulation), after AMP unscaling (``16-mixed``), and
    *before* Lightning clips gradients (``gradient_clip_val``) and before the
    update. So record *t* holds the params before update *t*, the accumulated,
    unscaled, **unclipped** gradients, and the optimizer state before update *t*
    (the run's metadata records ``gradient_clip_val`` as ``grad_clip``, so
    ``stepdump.check`` knows the recorded norm is the one before clipping).
    (The optimizer's own step pre-hook, which a plain :class:`~stepdump.Recorder`
    uses, fires too early under Lightning: ``optimizer.step(closure)`` runs the
    closure inside ``step``, after the pre-hook, so the pre-hook would see the
    previous step's gradients, or a partial sum under accumulation. So the
    callback builds its Recorder with ``auto_capture=False`` and calls its
    public :meth:`~stepdump.Recorder.capture` from that callback.)

    **Steps.** One record per optimizer step, whatever ``accumulate_grad_batches``
    is; step numbers follow ``trainer.global_step``. A step the GradScaler skips
    (inf/NaN) is recorded and marked skipped.

    **Scalars.** ``loss``: the mean of the micro-batch losses of the step (the
    ``loss`` of ``training_step``'s output, with Lightning's division by
    ``accumulate_grad_batches`` undone); ``lr`` (and ``grad_scale`` under AMP)
    come from the Recorder. Log more through :attr:`recorder`
    (``rec.log(acc=...)``) from your LightningModule.

    **Several optimizers** (manual optimization): one run per optimizer, in
    ``path/opt0``, ``path/opt1``, ... in the order of ``trainer.optimizers``;
    each records only the parameters its optimizer steps (unless ``include`` is
    given) and numbers its own steps from 0.

    **Resuming.** A fit resumed from a Lightning checkpoint (``ckpt_path=``), or
    any fit that starts at ``trainer.global_step > 0``, records into the same run
    (``resume=True``) from step ``trainer.global_step``. Steps the run already has
    from there on (it went on past the checkpoint) are dropped and recorded
    again, so the run stays one history (``run.meta["history"]``).

    **RNG of the first record.** A record's RNG is the state at the start of its
    iteration, before its batch is drawn. Lightning draws from the global RNG
    when it creates the data loader's iterator, before ``on_train_start`` (where
    the Recorder is made), so the callback keeps the RNG as of ``on_fit_start``
    (after a checkpoint's RNG is restored) and records that as the first step's.
    A resumed run's first record then holds the RNG the fit continues from: with
    a ``.ckpt`` from ``run.export(format="lightning")``, the original's record of
    that step (docs/integrations.md says when a resumed run diffs identical).

    Only global rank 0 records (parameters and gradients are the same on every
    DDP rank); sharded strategies (FSDP, DeepSpeed) are not supported.

    Args:
        path: Directory of the run (``path/opt{i}`` with several optimizers).
        **recorder_kwargs: Passed to :class:`stepdump.Recorder` (``capture``,
            ``every``, ``include``, ``codec``, ..., or the groups ``record=``,
            ``schedule=``, ``store=``). ``resume`` and ``start_step`` default
            as described above.
    """

    def __init__(self, path: str | os.PathLike[str], **recorder_kwargs: Any) -> None:
        for key in ("model", "optimizer", "scheduler", "scaler", "auto_capture"):
            if key in recorder_kwargs:
                raise ConfigError(f"StepdumpCallback sets {key}= itself (it finds the training objects and when to "
                                  "record); do not pass it")
        self.path = Path(path)
        self.recorder_kwargs = recorder_kwargs
        self._recorders: list[Recorder] = []
        self._by_optimizer: dict[int, Recorder] = {}
        self._captured: dict[int, tuple[int, bool]] = {}  # id(recorder) -> (step, skipped) captured this batch
        self._losses: list[torch.Tensor] = []
        self._start_rng: dict[str, Any] | None = None  # the RNG the fit starts from (before the loader draws)

    # -- access ------------------------------------------------------------------
    @property
    def recorders(self) -> list[Recorder]:
        """The Recorders of the fit in progress, one per optimizer (empty outside a fit)."""
        return list(self._recorders)

    @property
    def recorder(self) -> Recorder:
        """The Recorder of the fit in progress (there must be exactly one optimizer)."""
        if len(self._recorders) != 1:
            raise ConfigError(
                f"there are {len(self._recorders)} Recorders now (one per optimizer, only during a fit); "
                "use .recorders"
            )
        return self._recorders[0]

    # -- lifecycle ---------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a checkpoint's RNG is restored (on_load_checkpoint comes first, or takes it again
        # below when a strategy restores after setup) and before the fit loop creates the data
        # loader's iterator, which draws from the global torch RNG: the first step starts here.
        self._take_start_rng()

    def _take_start_rng(self) -> None:
        from stepdump.core.rng import get_rng_state

        try:
            self._start_rng = get_rng_state()
        except Exception as e:  # noqa: BLE001 - do no harm: the first record keeps the RNG at on_train_start
            self._start_rng = None
            log.warning("stepdump: could not read the RNG state at the start of the fit (%s); the first record holds "
                        "the one at on_train_start", e)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # By now the optimizers exist and a checkpoint given to fit() is restored, so
        # trainer.global_step is the step training continues from.
        self._close()
        if trainer.global_rank != 0:
            return
        optimizers = list(trainer.optimizers)
        if not optimizers:
            log.warning("stepdump: the LightningModule has no optimizer; nothing is recorded")
            return
        kwargs = dict(self.recorder_kwargs)
        resume = kwargs.pop("resume", None)
        if resume is None:
            resume = trainer.ckpt_path is not None or trainer.global_step > 0
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        kwargs["metadata"] = with_grad_clip(kwargs.get("metadata"), _grad_clip(trainer))
        several = len(optimizers) > 1
        try:
            for i, opt in enumerate(optimizers):
                path = self.path / f"opt{i}" if several else self.path
                start = kwargs.get("start_step")
                if start is None and resume and not several:  # later steps are dropped, recorded again
                    start = trainer.global_step
                rec_kwargs = {**kwargs, "resume": resume, "start_step": start}
                if several:
                    _only_params_of(rec_kwargs, param_globs(pl_module, opt))
                else:  # what a .ckpt's loop counters need (run.export(format="lightning"))
                    rec_kwargs["metadata"] = with_trainer_setup(rec_kwargs.get("metadata"), _setup(trainer, opt))
                # auto_capture=False: the optimizer's pre-hook fires too early under Lightning's
                # closure; on_before_optimizer_step captures, the post-hook still ends each update.
                rec = Recorder(path, pl_module, opt, scheduler=_scheduler_for(trainer, opt), scaler=scaler,
                               auto_capture=False, **rec_kwargs)
                self._recorders.append(rec)
                self._by_optimizer[id(opt)] = rec
        except BaseException:
            self._close()
            raise
        start_rng, self._start_rng = self._start_rng, None
        if start_rng is not None:  # the loader's iterator has drawn since: record the RNG from before it
            for rec in self._recorders:
                rec.begin_iteration(rng=start_rng)
        log.info("stepdump: recording %d optimizer(s) into %s from step %d", len(optimizers), self.path,
                 self._recorders[0].step)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Every (micro-)batch, as log_batch stores it: its fingerprint at every recorded step, the
        # batch itself where the schedule stores tensors, so a step can be replayed / re-executed.
        for rec in self._recorders:
            try:
                rec.log_batch(batch)
            except ConfigError as e:  # a batch without tensors: nothing to identify it by
                log.debug("stepdump: batch %d not logged: %s", batch_idx, e)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        rec = self._by_optimizer.get(id(optimizer))
        if rec is None:
            return
        if self._captured.get(id(rec), (None,))[0] == rec.step:
            return  # the closure ran again inside the same step (LBFGS): its first evaluation is recorded
        skipped = found_inf(rec.scaler, optimizer)
        self._captured[id(rec)] = (rec.capture(skipped=skipped), skipped)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self._recorders:
            return
        loss = _loss_of(outputs)
        if loss is not None:
            if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
                loss = loss * trainer.accumulate_grad_batches  # undo Lightning's normalisation
            self._losses.append(loss)
        if not self._captured:
            return  # a micro-batch that only accumulated gradients
        mean = torch.stack(self._losses).mean() if self._losses else None
        for rec in self._recorders:
            t, skipped = self._captured.pop(id(rec), (None, False))
            if t is None:
                continue
            if rec.step == t:  # captured, but optimizer.step() never ran: the GradScaler skipped it
                if not skipped:
                    log.warning("stepdump: step %d was skipped by the GradScaler after it was recorded as not "
                                "skipped (an optimizer that unscales inside step())", t)
                rec.end_step()  # no optimizer post-hook will
            if mean is not None:
                rec.log(loss=mean)  # lands on step t: it is logged right after t's update
        self._captured.clear()
        self._losses.clear()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # A .ckpt written by run.export(format="lightning") carries the RNG at the start of the
        # step it resumes (Lightning's own checkpoints keep none): restore it, so dropout and the
        # next epoch's shuffling draw what the recorded run drew.
        rng = (checkpoint.get("stepdump") or {}).get("rng")
        if rng is not None:
            from stepdump.core.rng import set_rng_state

            set_rng_state(rng)
            log.info("stepdump: RNG restored from the checkpoint of step %s", checkpoint["stepdump"].get("step"))
        if self._start_rng is not None:  # restored after on_fit_start (a strategy that restores after setup)
            self._take_start_rng()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:  # flush what was recorded; never hide the training's own exception
            self._close()
        except Exception as e:  # noqa: BLE001
            log.error("stepdump: closing the run after %s failed: %s", type(exception).__name__, e)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        recs, self._recorders = self._recorders, []
        self._by_optimizer.clear()
        self._captured.clear()
        self._losses.clear()
        errors = []
        for rec in recs:
            try:
                rec.close()
            except Exception as e:  # noqa: BLE001 - close the others, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]


def _only_params_of(kwargs: dict[str, Any], globs: list[str]) -> None:
    """Record only ``globs`` (one optimizer's params) unless the user chose ``include`` themselves."""
    record = kwargs.get("record")
    if record is None:
        kwargs.setdefault("include", globs)
    elif record.include == ("*",):
        kwargs["record"] = dataclasses.replace(record, include=globs)


def _grad_clip(trainer: pl.Trainer) -> dict[str, Any] | None:
    """How the Trainer clips (``gradient_clip_val``): after the record, so the recorded grads are unclipped."""
    val = getattr(trainer, "gradient_clip_val", None)
    if not val:
        return None
    alg = getattr(trainer, "gradient_clip_algorithm", None) or "norm"  # None: Lightning's default, norm
    algorithm = str(getattr(alg, "value", alg))
    key = "max_norm" if algorithm == "norm" else "max_value"
    return {"grads": "unclipped", "algorithm": algorithm, key: float(val)}


def _scheduler_for(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> Any:
    for config in getattr(trainer, "lr_scheduler_configs", []):
        sched = config.scheduler
        if getattr(sched, "optimizer", None) is optimizer and hasattr(sched, "state_dict"):
            return sched
    return None


def _setup(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    interval = None
    for config in getattr(trainer, "lr_scheduler_configs", []):
        if getattr(config.scheduler, "optimizer", None) is optimizer:
            interval = config.interval
    return {"framework": "lightning", "num_training_batches": float(trainer.num_training_batches),
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches), "scheduler_interval": interval}


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach().reshape(())
    return None
