"""The Recorder: attaches to an optimizer's step hooks and records every step.

Step semantics (docs/concepts.md): record *t* holds params as they were before
update *t*, the grads update *t* used, optimizer state before update *t*, the
scalars logged in iteration *t*, and the RNG state and module buffers at the
*start* of iteration *t* (right after update *t-1*). Two moments feed a record:

* end of update *t-1* (optimizer post-hook, or a GradScaler step that skipped):
  RNG and buffers for record *t* are taken;
* the optimizer pre-hook of step *t* (grads are final, nothing updated yet):
  params, grads, optimizer / scheduler / scaler state are staged and sent.

A GradScaler that finds inf/NaN never calls ``optimizer.step()``, so the
pre-hook never fires; the Recorder wraps ``scaler.step`` to notice that and
records the step as skipped.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from stepdump.capture import target as _target
from stepdump.capture.activations import ModuleCapture
from stepdump.capture.guard import Failure, Guard, close_quietly, mark_run
from stepdump.capture.hooks import group_sizes, record_after_closure, watch_scaler
from stepdump.capture.naming import begin_state, full_state, state_json, tensor_entries
from stepdump.capture.ring import Ring, remember, ring_step
from stepdump.capture.scalars import (
    auto_scalars,
    checked_scalar,
    profile_scalars,
    scalar_rows,
)
from stepdump.capture.selection import (
    CORE_KINDS,
    Every,
    NameFilter,
    Schedule,
    check_kinds,
)
from stepdump.capture.session import (
    check_arguments,
    init_catalog,
    prepare_dir,
    run_meta,
)
from stepdump.capture.sharding import Ranks
from stepdump.capture.staging import Item, Stager, StagingPool
from stepdump.capture.triggers import Trigger
from stepdump.capture.triggers import resolve as resolve_trigger
from stepdump.capture.writer import StepMessage, Writer
from stepdump.core.layout import Layout, build_layout
from stepdump.errors import ConfigError, WriterError
from stepdump.store.format import LEVEL_FULL, LEVEL_NONE, LEVEL_STATS
from stepdump.store.lock import RunLock

log = logging.getLogger(__name__)


_Entry = tuple[str, str, torch.Tensor, bool, "str | None", "str | None"]


class Recorder:
    """Record every optimizer step of a training run into a run directory.

    Args:
        path: Directory of the run (created). It must not already hold a run
            unless ``resume=True``.
        model: The module being trained; names come from ``named_parameters``.
        optimizer: The optimizer whose steps are recorded.
        scheduler: Optional LR scheduler (anything with ``state_dict``).
        scaler: Optional ``torch.amp.GradScaler``; steps it skips are recorded
            and marked ``skipped``.
        capture: Kinds of tensors to record: any of ``params``, ``grads``,
            ``optimizer`` (module buffers come with ``params``).
        include: Glob(s) over parameter names to record (default all).
        exclude: Glob(s) over parameter names to leave out.
        every: Steps whose tensors are stored in full: an int n (every n-th
            step), a range, an iterable of steps or a callable ``step -> bool``.
        stats_every: Steps whose stats and fingerprints are stored (default
            every step, so diff and check see every step).
        codec: Blob codec, see ``stepdump.store.codecs.CODEC_NAMES`` and
            docs/performance.md; ``delta-lz4`` / ``delta-zstd`` store params,
            grads and optimizer state as differences from their previous blob.
        delta_chain: With a delta codec, every ``delta_chain``-th blob of a
            series is self-contained, so a read decodes at most that many blobs.
        queue_depth: Steps that may be in flight to the writer before training
            waits (each holds a staging copy of the recorded tensors).
        durability: ``"flush"`` (survives a killed process) or ``"fsync"``
            (also survives power loss, slower); docs/reliability.md has numbers.
        on_error: What a failure inside the Recorder (disk full, an I/O error, a
            tensor it cannot handle, a bug) does once recording has started.
            ``"warn"`` (default, do no harm): one warning names the cause, the
            run is marked (``run.meta["recording_stopped"]``, ``stepdump info``),
            recording stops and training goes on exactly as without stepdump;
            :meth:`close` does not raise. ``"raise"`` (strict, for tests): the
            failure raises out of ``optimizer.step()`` / :meth:`log` /
            :meth:`close` (a write failure as :class:`stepdump.WriterError`).
            Either way every step committed before the failure stays readable.
            Errors while the Recorder is being created always raise.
        resume: Append to an existing run, continuing its step numbers.
        start_step: Number of the first recorded step (default 0, or the step
            after the last recorded one when resuming).
        metadata: JSON-able dict stored with the run.
        segment_bytes: Size at which a new segment file is started.
        modules: Glob(s) over module names whose outputs are recorded when
            ``capture`` includes ``activations`` / ``activation_grads``.
        profile: Record per-step timing and memory as ``sys/*`` scalars
            (see :meth:`stepdump.Run.profile`).
        keyframe_every: Keyframe mode for :func:`stepdump.replay`: full state
            every K steps (this sets ``every=K``, ``stats_every=1``) and, at every
            step, the RNG state and the batch given to :meth:`log_batch`, so any
            step can be rebuilt bit-exactly by replaying from its keyframe.
        ring: Flight-recorder mode: keep full copies of the last ``ring`` steps
            in memory (ring x step size) and write them only when ``trigger``
            fires; stats and fingerprints are still written every step.
        trigger: ``"nan_inf"`` (default), ``"loss_spike"``, or a callable
            ``(stepdump.capture.triggers.TriggerInfo) -> bool``.
        after: Steps recorded in full after the trigger step (default ``ring``),
            before going back to ring mode.

    Use it as a context manager or call :meth:`close`; create it right before
    the training loop so the RNG state of step 0 is the one the loop starts with.

    Under ``torch.distributed`` (docs/distributed.md) each rank records into
    ``path/rank{r:05d}``; ``ranks=`` picks the ranks (``"all"``, an iterable,
    or None to record into ``path`` itself); on other ranks the Recorder is an
    inactive stand-in (``recording`` False). ``path`` may be an fsspec URL
    (``s3://bucket/run``): the run is staged locally and uploaded, see
    :class:`stepdump.Remote` passed as ``remote=``.
    """

    recording = True  # False for the stand-in that ranks= gives the ranks it leaves out

    def __new__(cls, *args: Any, **kwargs: Any) -> Recorder:
        from stepdump.capture.sharding import this_rank_records

        if cls is Recorder and not this_rank_records(kwargs.get("ranks", "all")):
            from stepdump.capture.inactive import InactiveRecorder

            return super().__new__(InactiveRecorder)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        capture: Iterable[str] | str = CORE_KINDS,
        include: str | Iterable[str] | None = "*",
        exclude: str | Iterable[str] | None = None,
        every: Every = 1,
        stats_every: Every = 1,
        codec: str = "raw",
        delta_chain: int = 8,
        queue_depth: int = 2,
        durability: str = "flush",
        on_error: str = "warn",
        resume: bool = False,
        start_step: int | None = None,
        metadata: dict[str, Any] | None = None,
        segment_bytes: int = 1 << 30,
        modules: str | Iterable[str] = "*",
        profile: bool = True,
        keyframe_every: int | None = None,
        ring: int | None = None,
        trigger: Trigger | str | None = None,
        after: int | None = None,
        ranks: Ranks = "all",
        remote: Any = None,
    ) -> None:
        every = check_arguments(model, optimizer, scheduler, scaler, durability=durability, on_error=on_error,
                                queue_depth=queue_depth, codec=codec, every=every, stats_every=stats_every,
                                keyframe_every=keyframe_every, ring=ring, delta_chain=delta_chain,
                                ring_options=(trigger, after))
        self._keyframes = keyframe_every is not None
        self._target = _target.resolve(path, ranks=ranks, remote=remote, resume=resume)
        self.path = self._target.local  # this rank's store; a local staging directory for a URL
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.kinds = check_kinds(capture)
        self._filter = NameFilter(include, exclude)
        self._full = Schedule(every, "every")
        self._stats = Schedule(stats_every, "stats_every")
        self._layout: Layout = build_layout(model, optimizer)
        first = next(iter(self._layout.params.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._group_sizes = group_sizes(optimizer)
        self._closed = False
        self._hooks: list[Any] = []
        self._pending: dict[int, dict[str, Any]] = {}
        self._prev_open = False
        self._begin: dict[str, Any] | None = None
        self._pre_fired = 0
        self._batch: Any = None
        self._forward_seen = False  # a training forward ran since the last update: logs go to it

        self._guard = Guard(on_error, self.path, self._step_aside)
        self._lock = RunLock(prepare_dir(self.path, resume))
        self._lock.acquire()
        try:
            meta = run_meta(self, keyframe_every=keyframe_every, codec=codec, metadata=metadata)
            self._step = init_catalog(self.path, meta, resume, start_step)
            self._pool = StagingPool(queue_depth + (ring or 0))
            self._ring = Ring(ring, self._pool, resolve_trigger(trigger), after) if ring is not None else None
            self._stager = Stager()
            self._writer = Writer(self.path, self._pool, codec, durability, self._target.segment_bytes(segment_bytes),
                                  max_queue=queue_depth + 64, delta_chain=delta_chain)
            self._writer.start()
            self._writer.wait_ready()
            self._raise_if_writer_failed(starting=True)
            self._target.start(lambda: self._writer.steps_written)
        except BaseException:
            if getattr(self, "_writer", None) is not None and self._writer.is_alive():  # failed at start: end it
                self._writer.queue.put(None)
                self._writer.join()
            self._lock.release()
            raise
        self._profile = profile
        self._overhead = 0.0
        self._iter_start = time.perf_counter()
        self._modules = ModuleCapture(model, self.kinds, list(modules) if not isinstance(modules, str) else modules,
                                      active=lambda: self._level(self._step) != LEVEL_NONE,
                                      on_error=lambda e, where: self._fail(e, where))
        self._attach()
        # On the module given (a torch.compile wrapper runs its own hooks eagerly: no graph break).
        if not isinstance(model, torch.jit.ScriptModule):  # TorchScript runs no Python hooks
            self._hooks.append(model.register_forward_pre_hook(self._saw_forward))
        self._begin_iteration(self._step)
        # If the user forgets close(), still flush and release the lock at exit.
        self._finalizer = weakref.finalize(self, close_quietly, weakref.ref(self))

    # -- setup -------------------------------------------------------------
    def _attach(self) -> None:
        opt = self.optimizer
        self._hooks.append(opt.register_step_pre_hook(lambda o, a, k: self._on_pre_hook(a, k)))
        self._hooks.append(opt.register_step_post_hook(lambda o, a, k: self._on_step_done()))
        if self.scaler is not None:
            self.scaler.step = watch_scaler(self.scaler, self)  # instance attribute shadows the method

    # -- public API --------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of the iteration in progress (the next optimizer step)."""
        return self._step

    def log(self, **scalars: Any) -> None:
        """Record scalars (loss, accuracy, ...) for the current iteration.

        Once the model has run forward (with grad) in this iteration, scalars go to
        it. Before that, a name logged right after ``optimizer.step()`` that the
        just-finished step has not got yet is given to that step, so
        ``rec.log(loss=loss)`` after the step lands on the step that computed it.
        A value that is not one real number raises :class:`stepdump.ConfigError`.
        """
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        values = {name: checked_scalar(name, value) for name, value in scalars.items()}  # all, before any is kept
        if self._guard.stopped or self._raise_if_writer_failed():
            return
        for name, value in values.items():
            step = self._step
            if self._prev_open and not self._forward_seen and name not in self._pending.get(step - 1, {}):
                step -= 1
            self._pending.setdefault(step, {})[name] = value

    def log_batch(self, batch: Any) -> None:
        """Record the batch of the current iteration (any nest of tensors) as kind ``inputs``.

        Stored under ``batch/<path>`` (``batch/0``, ``batch/1`` for ``(x, y)``) so a
        step can be replayed; call it once per iteration (again for micro-batches:
        later calls get ``#1``, ``#2``...).
        """
        if self._guard.stopped or self._raise_if_writer_failed():
            return
        if self._level(self._step) == LEVEL_NONE:
            return
        try:
            skeleton = self._modules.log_batch(batch)
        except ConfigError:  # the caller's mistake (no tensors in it): say so
            raise
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "log_batch()")
            return
        if skeleton is not None:  # what replay hands back to train_step
            self._batch = skeleton

    def close(self) -> None:
        """Flush everything to disk, detach from the optimizer and release the run."""
        if self._closed:
            return
        self._closed = True
        self._modules.remove()
        if self._ring is not None:
            self._ring.release_all()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.scaler is not None and "step" in vars(self.scaler):
            del self.scaler.step
        try:
            scalars = [r for s in sorted(self._pending) for r in scalar_rows(s, self._pending[s])]
            self._pending.clear()
            if scalars and self._writer.error is None and not self._guard.stopped:
                self._put(StepMessage(step=None, scalars=scalars))
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "close()")
        finally:
            self._writer.queue.put(None)
            self._writer.join()
            if self._guard.failure is not None:  # with the last step that really was committed
                mark_run(self.path, replace(self._guard.failure, last_committed=self._writer.last_step))
            self._lock.release()
            self._finalizer.detach()
        try:
            self._raise_if_writer_failed()
        finally:
            try:
                self._target.finish()  # a URL run: publish the final state
            except WriterError as e:  # the complete run is still in the local staging directory
                if self._guard.strict:
                    raise
                log.warning("stepdump: %s", e)
        log.info("stepdump: closed %s (%d steps, %d bytes)", self.path, self._writer.steps_written,
                 self._writer.bytes_written)

    @property
    def bytes_written(self) -> int:
        """Bytes of tensor data appended to segment files so far."""
        return self._writer.bytes_written

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # don't let a writer error hide the user's own exception
            self.close()
        except WriterError as e:
            log.error("stepdump: %s", e)

    # -- hooks -------------------------------------------------------------
    def _level(self, t: int) -> int:
        return LEVEL_FULL if self._full(t) else LEVEL_STATS if self._stats(t) else LEVEL_NONE

    def _saw_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # a training forward, not an evaluation under no_grad
            self._forward_seen = True

    def _on_pre_hook(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer's step pre-hook. With a closure (LBFGS), grads exist only once the
        optimizer has called it: the record is taken after its first call instead."""
        self._pre_fired += 1
        new_args = None if self._guard.stopped else record_after_closure(args, kwargs, self._on_pre_step)
        if new_args is None:  # no closure: the grads are final now
            self._on_pre_step()
        return new_args

    def _on_pre_step(self, skipped: bool = False) -> None:
        if self._guard.stopped or self._raise_if_writer_failed():
            return
        try:
            self._record_step(skipped)
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "optimizer.step() pre-hook")

    def _fail(self, err: BaseException, where: str) -> None:
        """A failure inside a hook: strict re-raises (a write failure as WriterError), else step aside."""
        if self._guard.strict:
            self._raise_if_writer_failed()
            raise err
        if self._writer.error is not None:  # the writer failed first: that is the cause
            self._raise_if_writer_failed()
            return
        self._guard.fail(err, where, self._step, self._writer.last_step)

    def _step_aside(self, failure: Failure) -> None:
        """The guard's first failure: no more hooks, nothing held, the run marked."""
        self._modules.remove()  # no more activations piling up for a record that never comes
        if self._ring is not None:
            self._ring.release_all()
        self._pending.clear()
        self._begin = None

    def _record_step(self, skipped: bool) -> None:
        t = self._step
        started = time.perf_counter()
        meta = self._refresh_layout()
        with torch.profiler.record_function("stepdump.capture"):
            scalars = scalar_rows(t - 1, self._pending.pop(t - 1, {})) if self._prev_open else []
            self._prev_open = False
            auto_scalars(self._pending.setdefault(t, {}), self.optimizer, self.scaler)
            if self._ring is not None:
                remember(self._ring.history, scalars)
            level = self._level(t)
            msg = StepMessage(step=t, level=level, skipped=skipped, scalars=scalars, meta=meta)
            captured = self._modules.take()
            if self._ring is not None and level == LEVEL_STATS:
                ring_step(self, msg, captured)
            elif level != LEVEL_NONE:
                msg.slot = self._pool.acquire(lambda: self._writer.error)
                try:
                    self._stage(msg, t, level == LEVEL_FULL, captured)
                except BaseException:
                    self._pool.release(msg.slot)  # never sent: the writer will not hand it back
                    raise
            self._batch = None
            self._put(msg)
        self._overhead += time.perf_counter() - started

    def _stage(self, msg: StepMessage, t: int, full: bool, captured: list[tuple[str, str, torch.Tensor]]) -> None:
        entries = self._entries(full)
        if full or self._keyframes:
            msg.state_json = self._state_json(t, entries, full)
        msg.items = self._stager.stage(msg.slot, entries)
        # Hook values are private copies already; no second staging copy. In
        # keyframe mode the batch is stored at every step, for replay.
        msg.items.extend(
            Item(kind, name, tensor, full or (self._keyframes and kind == "inputs"))
            for kind, name, tensor in captured
        )

    def _refresh_layout(self) -> dict[str, Any] | None:
        """``optimizer.add_param_group`` since the last step: name the new params, and
        return the catalog meta that says so (resume checks the groups against it)."""
        sizes = group_sizes(self.optimizer)
        if sizes == self._group_sizes:
            return None
        self._layout = build_layout(self.model, self.optimizer)
        self._group_sizes = sizes
        log.info("stepdump: the optimizer's param groups changed at step %d; recording %d groups from here",
                 self._step, len(sizes))
        return {"layout": self._layout.to_meta()}

    def _on_step_done(self) -> None:
        if self._guard.stopped:
            return
        try:
            self._end_update()
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "optimizer.step() post-hook")

    def _end_update(self) -> None:
        started = time.perf_counter()
        if self._profile:
            profile_scalars(self._pending.setdefault(self._step, {}), started - self._iter_start, self._overhead,
                            self._device)
        self._step += 1
        self._prev_open = True
        self._forward_seen = False
        self._begin_iteration(self._step)
        self._iter_start = time.perf_counter()
        self._overhead = self._iter_start - started

    def _begin_iteration(self, t: int) -> None:
        """Start of iteration t: keep what a full record t needs from this moment."""
        # A callable schedule may say yes only later in the iteration (a trigger set
        # by the loop), so with one the start-of-iteration state is always taken.
        full = self._full(t) or self._ring is not None or self._full.dynamic
        if not full and not (self._keyframes and self._level(t) != LEVEL_NONE):
            self._begin = None
            return
        with torch.profiler.record_function("stepdump.begin"):
            self._begin = begin_state(self._layout, self._filter if full and "params" in self.kinds else None)

    # -- building a record -------------------------------------------------
    def _entries(self, full: bool) -> list[_Entry]:
        buffers = self._begin["buffers"] if full and self._begin is not None else {}
        return tensor_entries(self._layout, self.optimizer, self.kinds, self._filter, full, buffers)

    def _state_json(self, t: int, entries: list[_Entry], full: bool = True) -> str:
        return state_json(self._full_state() if full else {}, self._begin, self._batch, entries)

    def _full_state(self) -> dict[str, Any]:
        return full_state(self._layout, self.optimizer, self.scheduler, self.scaler)

    # -- plumbing ----------------------------------------------------------
    def _put(self, msg: StepMessage) -> None:
        while True:
            try:
                self._writer.queue.put(msg, timeout=0.05)
                return
            except queue.Full:
                if self._raise_if_writer_failed():
                    return

    def _raise_if_writer_failed(self, starting: bool = False) -> bool:
        """Raise WriterError if the writer failed; with on_error="warn" (once recording has
        started) stop recording instead and return True. False: all is well."""
        err = self._writer.error if hasattr(self, "_writer") else None
        if err is None:
            return False
        if not self._guard.strict and not starting:
            failed = self._writer.failed_step
            self._guard.fail(err, "writing the run", self._step if failed is None else failed, self._writer.last_step)
            return True
        raise WriterError(f"stepdump could not write {self.path}: {err}") from err
