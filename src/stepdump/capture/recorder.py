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
from collections import deque
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from stepdump.capture.naming import Layout, build_layout, full_state, tensor_entries
from stepdump.capture.rng import get_rng_state
from stepdump.capture.selection import CORE_KINDS, Every, NameFilter, Schedule, check_kinds
from stepdump.capture.activations import ModuleCapture
from stepdump.capture.scalars import check_scalar, scalar_rows
from stepdump.capture.session import check_arguments, init_catalog, prepare_dir
from stepdump.capture import target as _target
from stepdump.capture.distributed import Ranks
from stepdump.capture.profiling import peak_memory_mb
from stepdump.capture.ring import Ring, remember, ring_step
from stepdump.capture.staging import Item, StagingPool, Stager
from stepdump.capture.triggers import Trigger
from stepdump.capture.triggers import resolve as resolve_trigger
from stepdump.capture.writer import StepMessage, Writer
from stepdump.errors import ConfigError, WriterError
from stepdump.store import tjson
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
        on_error: What a failure to write (disk full, I/O error) does once
            recording has started. ``"raise"`` (default): the next
            ``optimizer.step()``, :meth:`log` or :meth:`close` raises
            :class:`stepdump.WriterError` naming the cause. ``"warn"``: one warning
            is logged with the cause, recording stops, training goes on and
            :meth:`close` does not raise. Either way every step committed before
            the failure stays readable. Errors while the Recorder is being
            created always raise.
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
        from stepdump.capture.distributed import this_rank_records

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
        on_error: str = "raise",
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
                                keyframe_every=keyframe_every, ring=ring, delta_chain=delta_chain)
        self._on_error = on_error
        self._stopped = False  # on_error="warn" after a writer failure: recording is off
        self._keyframes = keyframe_every is not None
        self._trigger = resolve_trigger(trigger) if ring is not None else None
        self._after = ring if after is None else after
        self._after_left = 0
        self._history: dict[str, deque[float]] = {}
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
        self._names = {id(p): n for n, p in self._layout.params.items()}
        self._closed = False
        self._hooks: list[Any] = []
        self._pending: dict[int, dict[str, Any]] = {}
        self._prev_open = False
        self._begin: dict[str, Any] | None = None
        self._pre_fired = 0
        self._batch: Any = None

        self._lock = RunLock(prepare_dir(self.path, resume))
        self._lock.acquire()
        try:
            meta = {
                "model_class": type(model).__name__,
                "optimizer_class": type(optimizer).__name__,
                "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
                "scaler": scaler is not None,
                "capture": list(self.kinds),
                "every": self._full.description,
                "keyframe_every": keyframe_every,
                "stats_every": self._stats.description,
                "codec": codec,
                "layout": self._layout.to_meta(),
                "user": metadata or {},
                **self._target.meta(self._layout.params),
            }
            self._step = init_catalog(self.path, meta, resume, start_step)
            self._pool = StagingPool(queue_depth + (ring or 0))
            self._ring = Ring(ring, self._pool) if ring is not None else None
            self._stager = Stager()
            self._writer = Writer(self.path, self._pool, codec, durability, self._target.segment_bytes(segment_bytes),
                                  max_queue=queue_depth + 64, delta_chain=delta_chain)
            self._writer.start()
            self._writer.wait_ready()
            self._raise_if_writer_failed(starting=True)
            self._target.start(lambda: self._writer.steps_written)
        except BaseException:
            self._lock.release()
            raise
        self._profile = profile
        self._overhead = 0.0
        self._iter_start = time.perf_counter()
        self._modules = ModuleCapture(model, self.kinds, list(modules) if not isinstance(modules, str) else modules,
                                      active=lambda: self._level(self._step) != LEVEL_NONE)
        self._attach()
        self._begin_iteration(self._step)
        # If the user forgets close(), still flush and release the lock at exit.
        self._finalizer = weakref.finalize(self, _close_quietly, weakref.ref(self))

    # -- setup -------------------------------------------------------------
    def _attach(self) -> None:
        opt = self.optimizer
        self._hooks.append(opt.register_step_pre_hook(lambda o, a, k: self._on_pre_step()))
        self._hooks.append(opt.register_step_post_hook(lambda o, a, k: self._on_step_done()))
        if self.scaler is not None:
            original = self.scaler.step

            def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
                before = self._pre_fired
                out = original(optimizer, *args, **kwargs)
                if optimizer is self.optimizer and self._pre_fired == before:
                    # inf/NaN found: optimizer.step() never ran, so no hook fired.
                    self._on_pre_step(skipped=True)
                    self._on_step_done()
                return out

            self.scaler.step = step  # instance attribute shadows the method
            self._scaler_original = original

    # -- public API --------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of the iteration in progress (the next optimizer step)."""
        return self._step

    def log(self, **scalars: Any) -> None:
        """Record scalars (loss, accuracy, ...) for the current iteration.

        A name logged right after ``optimizer.step()`` that the just-finished step
        has not got yet is given to that step, so ``rec.log(loss=loss)`` after
        the step lands on the step that computed the loss.
        """
        if self._raise_if_writer_failed():
            return
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        for name, value in scalars.items():
            check_scalar(name, value)
            step = self._step
            if self._prev_open and name not in self._pending.get(step - 1, {}):
                step -= 1
            # clone: the writer reads the value later, and training may change the tensor in place
            # by then (a logged parameter, Adam's step); a 1-element copy needs no device sync.
            self._pending.setdefault(step, {})[name] = (
                value.detach().clone() if isinstance(value, torch.Tensor) else value
            )

    def log_batch(self, batch: Any) -> None:
        """Record the batch of the current iteration (any nest of tensors) as kind ``inputs``.

        Stored under ``batch/<path>`` (``batch/0``, ``batch/1`` for ``(x, y)``) so a
        step can be replayed; call it once per iteration (again for micro-batches:
        later calls get ``#1``, ``#2``...).
        """
        if self._raise_if_writer_failed():
            return
        if self._level(self._step) == LEVEL_NONE:
            return
        skeleton = self._modules.log_batch(batch)
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
            if scalars and self._writer.error is None:
                self._put(StepMessage(step=None, scalars=scalars))
        finally:
            self._writer.queue.put(None)
            self._writer.join()
            self._lock.release()
            self._finalizer.detach()
        try:
            self._raise_if_writer_failed()
        finally:
            self._target.finish()  # a URL run: publish the final state
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

    def _on_pre_step(self, skipped: bool = False) -> None:
        self._pre_fired += 1
        if self._raise_if_writer_failed():
            return
        try:
            self._record_step(skipped)
        except WriterError:  # the writer died while this step was being staged
            if self._on_error != "warn":
                raise
            self._raise_if_writer_failed()

    def _record_step(self, skipped: bool) -> None:
        t = self._step
        started = time.perf_counter()
        with torch.profiler.record_function("stepdump.capture"):
            scalars = scalar_rows(t - 1, self._pending.pop(t - 1, {})) if self._prev_open else []
            self._prev_open = False
            self._auto_scalars(t)
            if self._ring is not None:
                remember(self._history, scalars)
            level = self._level(t)
            msg = StepMessage(step=t, level=level, skipped=skipped, scalars=scalars)
            captured = self._modules.take()
            if self._ring is not None and level == LEVEL_STATS:
                ring_step(self, msg, captured)
            elif level != LEVEL_NONE:
                msg.slot = self._pool.acquire(lambda: self._writer.error)
                full = level == LEVEL_FULL
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
            self._batch = None
            self._put(msg)
        self._overhead += time.perf_counter() - started

    def _on_step_done(self) -> None:
        if self._stopped:
            return
        started = time.perf_counter()
        if self._profile:
            self._profile_scalars(self._step, started)
        self._step += 1
        self._prev_open = True
        self._begin_iteration(self._step)
        self._iter_start = time.perf_counter()
        self._overhead = self._iter_start - started

    def _profile_scalars(self, t: int, now: float) -> None:
        """Iteration wall time, the recorder's share of it on this thread, peak memory."""
        slot = self._pending.setdefault(t, {})
        slot["sys/iter_ms"] = (now - self._iter_start) * 1000
        slot["sys/recorder_ms"] = self._overhead * 1000
        slot["sys/peak_mem_mb"] = peak_memory_mb(self._device)

    def _begin_iteration(self, t: int) -> None:
        """Start of iteration t: keep what a full record t needs from this moment."""
        # A callable schedule may say yes only later in the iteration (a trigger set
        # by the loop), so with one the start-of-iteration state is always taken.
        full = self._full(t) or self._ring is not None or self._full.dynamic
        if not full and not (self._keyframes and self._level(t) != LEVEL_NONE):
            self._begin = None
            return
        with torch.profiler.record_function("stepdump.begin"), torch.no_grad():
            self._begin = {
                "rng": get_rng_state(),
                "buffers": {n: b.detach().clone() for n, b in self._layout.buffers.items()
                            if full and "params" in self.kinds and self._filter(n)},
            }

    # -- building a record -------------------------------------------------
    def _entries(self, full: bool) -> list[_Entry]:
        buffers = self._begin["buffers"] if full and self._begin is not None else {}
        return tensor_entries(self._layout, self.optimizer, self.kinds, self._filter, full, buffers)

    def _state_json(self, t: int, entries: list[_Entry], full: bool = True) -> str:
        state: dict[str, Any] = self._full_state() if full else {}
        if self._begin is not None:
            state["rng"] = self._begin["rng"]
        if self._batch is not None:
            state["batch"] = self._batch

        def put(ref: str, tensor: torch.Tensor) -> None:
            entries.append(("state", ref, tensor, True, None, None))

        return tjson.dumps(tjson.encode(state, put))

    def _full_state(self) -> dict[str, Any]:
        return full_state(self._layout, self.optimizer, self.scheduler, self.scaler)

    def _auto_scalars(self, t: int) -> None:
        slot = self._pending.setdefault(t, {})
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group.get("lr")
            if lr is not None:
                slot.setdefault("lr" if i == 0 else f"lr/{i}", float(lr))
        if self.scaler is not None and self.scaler.is_enabled():
            slot.setdefault("grad_scale", float(self.scaler.get_scale()))

    # -- plumbing ----------------------------------------------------------
    def _put(self, msg: StepMessage) -> None:
        import queue as _q

        while True:
            try:
                self._writer.queue.put(msg, timeout=0.05)
                return
            except _q.Full:
                if self._raise_if_writer_failed():
                    return

    def _raise_if_writer_failed(self, starting: bool = False) -> bool:
        """Raise WriterError if the writer failed; with on_error="warn" (once recording has
        started) stop recording instead and return True. False: all is well."""
        err = self._writer.error if hasattr(self, "_writer") else None
        if err is None:
            return False
        if self._on_error == "warn" and not starting:
            self._stop_recording(err)
            return True
        raise WriterError(f"stepdump could not write {self.path}: {err}") from err

    def _stop_recording(self, err: BaseException) -> None:
        """on_error="warn": say once why recording stopped; from now on the hooks do nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._modules.remove()  # no more activations piling up for a writer that is gone
        self._pending.clear()
        log.warning("stepdump: recording into %s stopped at step %d (training goes on unrecorded; steps "
                    "before it are intact): %s: %s", self.path, self._step, type(err).__name__, err)


def _close_quietly(ref: weakref.ref[Recorder]) -> None:
    rec = ref()
    if rec is not None:
        try:
            rec.close()
        except Exception as e:  # noqa: BLE001 - interpreter exit, nowhere to raise to
            log.error("stepdump: closing at exit failed: %s", e)
