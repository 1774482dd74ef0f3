"""The Recorder: attaches to an optimizer's step hooks and records every step.

Step semantics (docs/concepts.md): record *t* holds params as they were before
update *t*, the grads update *t* used, optimizer state before update *t*, the
scalars logged in iteration *t*, and the RNG state and module buffers at the
*start* of iteration *t* (right after update *t-1*). Two moments feed a record,
each a public capture hook (hooks.py attaches them; a framework callback may call them):

* :meth:`Recorder.end_step` at the end of update *t-1* (optimizer post-hook, or a
  GradScaler step that skipped): RNG and buffers for record *t* are taken;
* :meth:`Recorder.capture` at the optimizer pre-hook of step *t* (grads final,
  nothing updated yet): params, grads, optimizer / scheduler / scaler state are sent.

A GradScaler that finds inf/NaN never calls ``optimizer.step()``, so the
pre-hook never fires; ``scaler.step`` is wrapped to record the step as skipped.
A stats-only record reads the live tensors on a worker instead (capture/lean.py),
from the iteration's first training forward on (the model's forward pre-hook).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from stepdump.capture import options as _options
from stepdump.capture import target as _target
from stepdump.capture.activations import ModuleCapture
from stepdump.capture.assemble import Assembler
from stepdump.capture.final import FinalRecord
from stepdump.capture.guard import Failure, Guard, close_quietly
from stepdump.capture.handoff import WriterLink
from stepdump.capture.handles import Hook
from stepdump.capture.hooks import attach, detach_scaler, nested_step
from stepdump.capture.iteration import LOOP, IterationStart, StartState
from stepdump.capture.lean import LeanCapture
from stepdump.capture.step_state import StateBefore, begin_state
from stepdump.capture.profiling import BackgroundClock, ThreadWaits, span, timed
from stepdump.capture.projection import log_start as log_projection
from stepdump.capture.rebuildable import GainedState, warn_if_unrebuildable
from stepdump.capture.ring import Ring
from stepdump.capture.scalars import auto_scalars, profile_scalars
from stepdump.capture.selection import Levels, NameFilter
from stepdump.capture.fingerprints import resumed as resumed_fingerprint
from stepdump.capture.session import check_objects, discard_created, init_catalog, prepare_dir, run_meta
from stepdump.capture.sharding import Ranks, this_rank_records
from stepdump.capture.staging import Slot, StagingPool, owned
from stepdump.capture.state_check import StateCheck
from stepdump.capture.stepwatch import StepWatch
from stepdump.capture.triggers import resolve as resolve_trigger
from stepdump.capture.unstepped import mark_no_step
from stepdump.capture.user_log import UserLog
from stepdump.capture.writer import StepMessage
from stepdump.capture.structure import StructureWatch, recorded_layouts
from stepdump.core import stats_file
from stepdump.core.layout import build_layout
from stepdump.core.wrappers import inner_optimizer, inner_scheduler, require_step_hooks, state_holder
from stepdump.errors import ConfigError, WriterError
from stepdump.store.format import LEVEL_FULL, LEVEL_NONE, LEVEL_STATS
from stepdump.store.lock import RunLock
from stepdump.store.storage import LocalStorage

if TYPE_CHECKING:
    from stepdump.capture.options import RecordOptions, Schedule, StoreOptions
    from stepdump.capture.selection import Every
    from stepdump.capture.triggers import Trigger
    from stepdump.capture.upload import Remote
    from stepdump.core.layout import Layout
    from stepdump.store.storage import StorageFactory

log = logging.getLogger(__name__)


class Recorder:
    """Record every optimizer step of a training run into a run directory.

    Two spellings: ``Recorder(path, model, optimizer, ...)`` records one model and its optimizer;
    ``Recorder(path, models={...}, optimizers={...}, ...)`` records one run over several named
    pairs (a GAN's G and D) and builds a :class:`~stepdump.capture.joint.JointRecorder`, which
    takes the same options and has the same methods.

    Args:
        path: Directory of the run (created). It must not already hold a run
            unless ``resume=True``. May be an fsspec URL (``s3://bucket/run``):
            the run is staged locally and uploaded (``remote=``, docs/remote.md).
        model: The module being trained; names come from ``named_parameters``.
        optimizer: The optimizer whose steps are recorded (accelerate's prepared optimizer: the
            torch optimizer inside it; its state is what ``state_dict()`` holds).
        scheduler: Optional LR scheduler (anything with ``state_dict``; accelerate's: the one inside).
        scaler: Optional ``torch.amp.GradScaler``; steps it skips are recorded
            and marked ``skipped``.
        models, optimizers, schedulers, scalers: Instead of the four above, dicts by pair
            name (``models={"G": netG, "D": netD}, optimizers={"G": opt_g, "D": opt_d}``): one
            run over several (model, optimizer) pairs with one step counter, names stored
            per pair (``G/fc.weight``); see docs/recipes/gan-and-multi-model-loops.md.
        record: What to record, as one :class:`stepdump.options.RecordOptions`, or its fields as the
            keywords below.
        schedule: When; one of the recording modes (README "Recording modes" says when to use each):

            * full (the default): ``StepSchedule()``, every tensor at every step;
            * tiered: ``StepSchedule(every=100)`` / ``every=100, stats_every=1``, stats and
              fingerprints every step, tensors every 100;
            * lean (stats only): ``StepSchedule(every=None)`` / ``every=None, stats_every=1``;
            * gradient log: ``GradientLogSchedule(every=K)`` / ``gradient_log=K``, grads every
              step and full state every K, any step rebuilt exactly (docs/gradient-log.md);
            * keyframes: ``KeyframeSchedule(every=K)`` / ``keyframe_every=K``, for
              :func:`stepdump.replay`;
            * ring: ``RingSchedule(size=N)`` / ``ring=N``, ``trigger``, ``after``: the last N
              steps kept in memory, written when the trigger fires.
        store: How to store it, as one :class:`stepdump.options.StoreOptions`, or its fields as the
            keywords below.
        on_error: What a failure inside the Recorder (disk full, a tensor it
            cannot handle, a bug) does once recording has started: ``"warn"``
            (default, do no harm: one warning, the run marked
            ``run.meta["recording_stopped"]``, recording stops, training goes on)
            or ``"raise"`` (strict, for tests: out of ``optimizer.step()`` /
            :meth:`log` / :meth:`close`, a write failure as
            :class:`stepdump.WriterError`). docs/reliability.md has the details.
        resume: Record on into an existing run from the step after its last update (replacing
            its final record), or from ``start_step``, dropping recorded steps from there on.
        start_step: Number of the first recorded step (default 0, or as above).
        metadata: JSON-able dict stored with the run.
        ranks: Under ``torch.distributed`` (docs/distributed.md) each rank
            records into ``path/rank{r:05d}``; ``ranks`` picks them (``"all"``,
            an iterable, or None to record into ``path`` itself). On the other
            ranks the Recorder is inactive (``recording`` False): it attaches
            nothing and writes nothing, so one script serves every rank.
        auto_capture: True (default): records are taken at the optimizer's
            step pre-hook. False: the caller calls :meth:`capture` when the
            grads are final and nothing is updated yet (a framework callback,
            docs/integrations.md).

    Options: every field of the three groups is also a plain keyword (``every=100``,
    ``codec="zstd"``), the everyday spelling; each defaults to its group's default. Give an
    option one way, as a keyword or inside its group: both is a :class:`stepdump.ConfigError`.

    What to record (``record=``, :class:`stepdump.options.RecordOptions`):
        capture: Kinds of tensors: any of ``params`` (module buffers come with them), ``grads``,
            ``optimizer``, ``activations``, ``activation_grads``, ``inputs``.
        include: Glob(s) over parameter names to record.
        exclude: Glob(s) over parameter names to leave out.
        modules: Glob(s) over module names whose outputs are recorded, with ``activations`` or
            ``activation_grads`` in ``capture`` (None: every module).
        profile: Record per-step timing and memory as ``sys/*`` scalars.
        extra_state: Objects recorded beside the model, by name (``{"ema": ema_model}``): each one's
            ``state_dict()`` at full steps, loaded by ``run.restore(..., extra_state=...)``.
        frozen: What a full step stores of params with ``requires_grad=False``: ``"once"`` (their
            bytes when first recorded, again only if they change) or ``"fingerprint"`` (never).

    When (``schedule=``, one mode at a time; the modes are listed under ``schedule`` above):
        every: Steps whose tensors are stored in full: an int n (every n-th step), a range, an
            iterable of steps, a callable ``step -> bool``, or None (never: the lean mode).
        stats_every: Steps whose per-tensor stats and fingerprints are stored (same forms).
        keyframe_every: K: keyframes for :func:`stepdump.replay`, full state every K steps, stats,
            RNG and batch every step (:class:`stepdump.options.KeyframeSchedule`).
        gradient_log: K: grads every step, full state every K steps, any step rebuilt exactly
            (:class:`stepdump.options.GradientLogSchedule`).
        ring: N: the last N steps kept in memory and written when ``trigger`` fires
            (:class:`stepdump.options.RingSchedule`).
        trigger: With ``ring``: ``"nan_inf"``, ``"loss_spike"`` or a callable
            ``(stepdump.options.TriggerInfo) -> bool``.
        after: With ``ring``: steps recorded in full after the trigger step (None: ``ring`` of them).

    How to store it (``store=``, :class:`stepdump.options.StoreOptions`):
        codec: Blob codec (``"raw"``, ``"zstd"``, ``"delta-lz4"``, ...; docs/performance.md).
        delta_chain: With a delta codec, every ``delta_chain``-th blob of a series is self-contained.
        queue_depth: Steps in flight to the writer before training waits.
        staging_bytes: Host memory for staging copies, all steps in flight together.
        durability: ``"flush"`` (survives a killed process) or ``"fsync"`` (also power loss).
        segment_bytes: Size at which a new segment file is started.
        remote: For a URL path: how the run is published (a :class:`stepdump.options.Remote` or a
            dict of its fields).
        storage: A callable building what segment files are written through (None: local files).
        fingerprint: The fingerprint kind of each tensor: ``"auto"``, ``"xxh3"`` or ``"dmix64"``.
        stats_parquet: Write ``stats.parquet`` (every stat row, for DuckDB / Polars / Spark in place)
            into the run directory at :meth:`close` (needs pyarrow; docs/scale.md).

    Use it as a context manager or call :meth:`close`; create it right before
    the training loop so the RNG state of step 0 is the one the loop starts with.
    """

    path: Path  # this rank's run directory (on an inactive rank: the path as given)
    _joint: Any = None  # the JointRecorder this pair's Recorder records for (capture/joint.py)

    # help() and inspect.signature() read __new__ before __init__: this shows __init__'s (set below).
    __signature__: ClassVar[inspect.Signature]

    def __new__(cls, *args: Any, **kwargs: Any) -> Recorder:
        # A misspelt keyword is a ConfigError that names the nearest option, not a TypeError.
        _options.refuse_unknown(kwargs, _PARAMETERS)
        # Recorder(path, models=..., optimizers=...): one run over several pairs (capture/joint.py).
        if cls is Recorder and (kwargs.get("models") is not None or kwargs.get("optimizers") is not None):
            from stepdump.capture.joint import JointRecorder

            return super().__new__(JointRecorder)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        models: Mapping[str, nn.Module] | None = None,
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Mapping[str, Any] | None = None,
        scalers: Mapping[str, Any] | None = None,
        record: RecordOptions | None = None,
        schedule: Schedule | None = None,
        store: StoreOptions | None = None,
        on_error: str = "warn",
        resume: bool = False,
        start_step: int | None = None,
        metadata: dict[str, Any] | None = None,
        ranks: Ranks = "all",
        auto_capture: bool = True,
        # The fields of record= (RecordOptions), schedule= and store= (StoreOptions) as plain keywords.
        # Their defaults are the groups' own (shown as such by help()); one left out is not passed on.
        capture: Iterable[str] | str = _options.unset("capture"),
        include: str | Iterable[str] | None = _options.unset("include"),
        exclude: str | Iterable[str] | None = _options.unset("exclude"),
        modules: str | Iterable[str] | None = _options.unset("modules"),
        profile: bool = _options.unset("profile"),
        extra_state: Mapping[str, Any] | None = _options.unset("extra_state"),
        frozen: str = _options.unset("frozen"),
        every: Every = _options.unset("every"),
        stats_every: Every = _options.unset("stats_every"),
        keyframe_every: int | None = _options.unset("keyframe_every"),
        gradient_log: int | None = _options.unset("gradient_log"),
        ring: int | None = _options.unset("ring"),
        trigger: Trigger | str | None = _options.unset("trigger"),
        after: int | None = _options.unset("after"),
        codec: str = _options.unset("codec"),
        delta_chain: int = _options.unset("delta_chain"),
        queue_depth: int = _options.unset("queue_depth"),
        staging_bytes: int = _options.unset("staging_bytes"),
        durability: str = _options.unset("durability"),
        segment_bytes: int = _options.unset("segment_bytes"),
        remote: Remote | Mapping[str, Any] | None = _options.unset("remote"),
        storage: StorageFactory | None = _options.unset("storage"),
        fingerprint: str = _options.unset("fingerprint"),
        stats_parquet: bool = _options.unset("stats_parquet"),
    ) -> None:
        self.options: _options.RecorderOptions = _options.resolve(
            record, schedule, store, on_error=on_error, resume=resume, start_step=start_step, metadata=metadata,
            ranks=ranks, auto_capture=auto_capture,
            capture=capture, include=include, exclude=exclude, modules=modules, profile=profile,
            extra_state=extra_state, frozen=frozen,
            every=every, stats_every=stats_every, keyframe_every=keyframe_every, gradient_log=gradient_log,
            ring=ring, trigger=trigger, after=after,
            codec=codec, delta_chain=delta_chain, queue_depth=queue_depth, staging_bytes=staging_bytes,
            durability=durability, segment_bytes=segment_bytes, remote=remote, storage=storage,
            fingerprint=fingerprint, stats_parquet=stats_parquet)
        if model is None and optimizer is None:
            raise ConfigError("Recorder needs the model and its optimizer: Recorder(path, model, optimizer), or "
                              "models= and optimizers= dicts for several pairs (a GAN's G and D)")
        if schedulers is not None or scalers is not None:
            raise ConfigError("schedulers= and scalers= go with models= and optimizers= (a joint run); "
                              "for one model give scheduler= and scaler=")
        # accelerate's prepared optimizer / scheduler: record the torch objects inside (core/wrappers.py),
        # and the GradScaler the wrapper steps with, unless one is given.
        if scaler is None and inner_optimizer(optimizer) is not optimizer:
            scaler = getattr(optimizer, "scaler", None)
        optimizer, scheduler = inner_optimizer(optimizer), inner_scheduler(scheduler)
        check_objects(model, optimizer, scheduler, scaler)
        if model is None or optimizer is None:  # check_objects refuses these already; this narrows the types
            raise ConfigError("Recorder needs both the model and its optimizer: Recorder(path, model, optimizer)")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self._closed = False
        self._hooks: list[Any] = []
        self._step = 0 if start_step is None else start_step
        self.recording = this_rank_records(ranks)
        if not self.recording:  # a rank ranks= leaves out: only count steps, so rec.step agrees on every rank
            self.path = path  # type: ignore[assignment]
            require_step_hooks(optimizer)
            self._hooks.append(optimizer.register_step_post_hook(
                Hook(lambda o, a, k: None if nested_step(o) else self.end_step())))
            return
        self._start(path)

    def _start(self, path: str | os.PathLike[str]) -> None:
        opts, rec, store, sched = self.options, self.options.record, self.options.store, self.options.schedule
        self._target = _target.resolve(path, ranks=opts.ranks, remote=store.remote, resume=opts.resume)
        self.path = self._target.local  # this rank's store; a local staging directory for a URL
        self.kinds = tuple(rec.capture)  # RecordOptions made it a tuple of kinds
        self._keyframes = isinstance(sched, _options.KeyframeSchedule)
        ring = sched if isinstance(sched, _options.RingSchedule) else None
        self._filter = NameFilter(rec.include, rec.exclude)
        self._level = Levels(*sched.steps())
        layout = build_layout(self.model, self.optimizer)
        first = next(iter(layout.params.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        # Stats-only steps read the live tensors (capture/lean.py); the ring needs copies, CUDA its own path.
        # A framework that clips after the record (metadata grad_clip: unclipped grads recorded) changes
        # the grads before the update: the lean path reads them at the record, as a full step copies them.
        clip = (opts.metadata or {}).get("grad_clip")
        self._lean = LeanCapture(enabled=ring is None and self._device.type == "cpu",
                                 grads_at_capture=isinstance(clip, dict) and clip.get("grads") == "unclipped")
        # What the user logs (scalars, the batch), held until their step's record (user_log.py)
        self._user = UserLog(accepting=lambda: not self._guard.stopped and not self._link.failed(),
                             spent=self._spent, fail=self._fail)
        self._captured_at: int | None = None  # the step capture() last recorded: once per step

        self._guard = Guard(opts.on_error, self.path, self._step_aside)
        # Where each iteration starts (RNG, buffers), followed across the process's loop (iteration.py)
        self._start_state = IterationStart(take=self._begin_iteration, step=lambda: self._step,
                                           closed=lambda: self._closed, guard=self._guard,
                                           final_rng=lambda: self._final.rng.take(), fail=self._fail)
        self._lock = RunLock(prepare_dir(self.path, opts.resume))
        self._lock.acquire()
        there = set(os.listdir(self.path))  # a new run's directory: empty but for a LOCK or a partial catalog
        try:
            self._open(layout, ring)
        except BaseException:
            # Whatever failed (a bad object, a full disk, a bug): nothing of this Recorder stays behind.
            self._abandon(None if opts.resume else there)
            raise

    def _open(self, layout: Layout, ring: _options.RingSchedule | None) -> None:
        """Create the run and start recording (the run directory is locked; :meth:`_abandon` undoes this)."""
        opts, rec, store, sched = self.options, self.options.record, self.options.store, self.options.schedule
        meta = run_meta(self.model, self.optimizer, self.scheduler, self.scaler, opts, layout,
                        self._target.meta(layout.params))
        # A resumed run's tensors keep their fingerprint kinds (checked before init_catalog drops steps).
        fingerprint = resumed_fingerprint(self.path, store.fingerprint) if opts.resume else store.fingerprint
        self._lean.dmix64 = fingerprint == "dmix64"
        self._final = FinalRecord(*init_catalog(self.path, meta, opts.resume, opts.start_step))  # for close()
        self._step = self._final.first
        # The optimizer state is what state_dict() holds: a wrapper's may live in the optimizer it wraps.
        holder = state_holder(self.optimizer)
        log_projection(self.path, layout, holder, self.kinds, self._filter, sched, self._step)
        if isinstance(sched, _options.GradientLogSchedule):
            warn_if_unrebuildable(self.optimizer)  # said now, not at read time (rebuildable.py)
            gained = GainedState(holder, lambda: self._step)  # or at the first step that shows it
            self._hooks += [self.optimizer.register_step_post_hook(Hook(gained.after_step)),
                            self.optimizer.register_step_pre_hook(Hook(gained.before_step))]
        self._pool = StagingPool(store.queue_depth + (ring.size if ring else 0), None if ring else store.staging_bytes)
        self._ring = Ring(ring.size, self._pool, resolve_trigger(ring.trigger), ring.steps_after) if ring else None
        self._asm = Assembler(layout, holder, self.scheduler, self.scaler, self.kinds, self._filter,
                              self._lean, keyframes=self._keyframes,
                              gradlog=isinstance(sched, _options.GradientLogSchedule),
                              extra=rec.extra_state, frozen=rec.frozen)
        self._asm.stager.device_fp = fingerprint != "xxh3"  # CUDA tensors: dmix64 on the device
        self._asm.slot_budget = self._pool.slot_budget
        self._asm.structure = StructureWatch()  # the model's structure changing mid-run (structure.py)
        if opts.resume:  # the layouts of the steps kept, which a change from here adds to
            self._asm.resumed(recorded_layouts(self.path))
        self._hooks.append(self._asm.structure)
        self._link = WriterLink(self.path, self._pool, self._guard, lambda: self._step, codec=store.codec,
                                durability=store.durability, max_queue=store.queue_depth + 64,
                                in_flight=store.queue_depth,
                                segment_bytes=self._target.segment_bytes(store.segment_bytes),
                                delta_chain=store.delta_chain, storage=(store.storage or LocalStorage)(self.path),
                                fingerprint=fingerprint)
        self._target.start(lambda: self._link.steps_written)
        self._overhead, self._iter_start = 0.0, time.perf_counter()
        # sys/recorder_bg_ms: CPU time of the recorder's own threads in each iteration (profiling.py)
        self._bg = BackgroundClock(lambda: (*self._link.threads, *self._lean.threads))
        # The training thread's waits on those threads outside the hooks (profiling.ThreadWaits)
        self._waits = ThreadWaits() if self.options.record.profile else None
        self._modules = ModuleCapture(self.model, self.kinds, list(rec.modules or "*"),
                                      active=lambda: self._level(self._step) != LEVEL_NONE,
                                      on_error=lambda e, where: self._fail(e, where))
        self._hooks.extend(attach(self, self.scaler, auto_capture=opts.auto_capture, spent=self._spent))
        # On the module given (a torch.compile wrapper runs its own hooks eagerly: no graph break).
        if not isinstance(self.model, torch.jit.ScriptModule):  # TorchScript runs no Python hooks
            # Timed: their time on the training thread is the recorder's too (sys/recorder_ms). Copies: handles.py.
            self._hooks.append(self.model.register_forward_pre_hook(Hook(timed(self._saw_forward, self._spent))))
            self._hooks.append(self.model.register_forward_hook(Hook(timed(self._saw_forward_end, self._spent))))
        # State that state_dict() holds and the record does not: said at the first step showing it.
        self._hooks.append(self.optimizer.register_step_pre_hook(Hook(StateCheck(self.optimizer, holder).look)))
        self._watch = StepWatch(self.model, self.optimizer, lambda: self._step)  # a loop that never steps it: say so
        self._hooks.extend(self._watch.handles)
        self._start_state.open(self._step)
        LOOP.join(self._start_state)
        # If the user forgets close(), still flush and release the lock at exit.
        self._finalizer = weakref.finalize(self, close_quietly, weakref.ref(self))

    def _abandon(self, there: set[str] | None) -> None:
        """Undo a construction that failed part way: hooks off, threads stopped, the run released, and
        what a new run's construction created removed (``there``: what its directory held before; None
        when resuming, whose run stays as it is), so the same directory takes a Recorder again."""
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if (modules := getattr(self, "_modules", None)) is not None:
            modules.remove()
        LOOP.leave(self._start_state)
        detach_scaler(self.scaler)
        self._lean.close()
        self._target.abandon()
        if (link := getattr(self, "_link", None)) is not None:
            link.stop()
        try:
            if there is not None:
                discard_created(self.path, there)
        finally:
            self._lock.release()

    # -- public API --------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of the iteration in progress (the next optimizer step)."""
        return self._step

    def close(self) -> None:
        """Write the final record (the state after the last update), flush, detach, release the run."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not self.recording:
            return
        LOOP.leave(self._start_state)
        self._watch.closing()
        self._modules.remove()
        if self._ring is not None:
            self._ring.release_all()
        detach_scaler(self.scaler)
        try:
            self._send_held()
            if self._final.due(self._step, self._captured_at, self.kinds) and not self._guard.stopped:
                self._link.put(self._final.message(self._asm, self.model, self._step, self._pool, self._link))
            scalars = self._user.final_rows(self._step)  # no step recorded: a row per iteration
            if scalars and self._link.error is None and not self._guard.stopped:
                self._link.put(StepMessage(step=None, scalars=scalars))
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "close()")
        finally:
            self._lean.close()
            self._link.finish()  # everything queued committed; the run marked if recording stopped
            unstepped = self._user.unstepped
            if unstepped is not None and not self.options.resume and not self._guard.stopped:
                mark_no_step(self.path, unstepped.iterations, self._watch.stepped_instead)
            not_compacted = self._compact()  # before the lock goes and before a URL run is published
            self._lock.release()
            self._finalizer.detach()
        self._link.publish(self._target)  # the writer's failure (strict), then a URL run's final state
        if not_compacted is not None:
            raise not_compacted

    def _compact(self) -> WriterError | None:
        """The run's stats as ``stats.parquet`` (core/stats_file.py), once every step is committed and
        while the run is still locked. A failure is one warning; when strict, it is returned, for
        :meth:`close` to raise once the run is released."""
        if not self.options.store.stats_parquet:
            return None
        if self._guard.stopped or self._link.error is not None:  # its warning said it; the disk may be full
            log.info("stepdump: %s not written: recording stopped", self.path / stats_file.STATS_FILE)
            return None
        try:
            stats_file.compact(self.path, strict=self._guard.strict)
        except WriterError as e:
            return e
        return None

    @property
    def bytes_written(self) -> int:
        """Bytes of tensor data appended to segment files so far."""
        return self._link.bytes_written if self.recording else 0

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
        if not self.recording:
            return
        self._user.log(scalars, self._step, self._start_state.forward_seen, self._watch.event)

    def log_batch(self, batch: Any) -> None:
        """Record the batch of the current iteration (any nest of tensors) as kind ``inputs``.

        Stored under ``batch/<path>`` (``batch/0``, ``batch/1`` for ``(x, y)``) so a
        step can be replayed; call it once per iteration (again for micro-batches:
        later calls get ``#1``, ``#2``...).
        """
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        if not self.recording or self._guard.stopped or self._link.failed():
            return
        if self._level(self._step) == LEVEL_NONE:
            return
        self._user.log_batch(batch, self._modules)

    def __repr__(self) -> str:
        where = "closed" if self._closed else f"at step {self._step}"
        return f"<stepdump.Recorder {self.path!s} {where}{'' if self.recording else ' (this rank is not recorded)'}>"

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except WriterError as e:
            if exc_type is None:
                raise
            log.error("stepdump: %s", e)  # don't let a writer error hide the user's own exception

    # -- capture hooks (public: the optimizer hooks and framework callbacks drive these) --
    def capture(self, *, skipped: bool = False, optimizer_state: StateBefore | None = None) -> int:
        """Take the record of the current step now; return its number.

        Call it when the grads of the step are final and nothing is updated yet.
        With ``auto_capture`` (the default) the optimizer's step pre-hook calls it;
        a framework callback built with ``auto_capture=False`` calls it itself.
        A second call in the same step does nothing (LBFGS: the first closure
        evaluation is recorded). ``skipped``: the update will not happen (a
        GradScaler found inf/NaN); then call :meth:`end_step`, no hook will.
        ``optimizer_state``: the optimizer state as ``step()`` began, when the
        record is taken inside it (after a closure's first call; naming.StateBefore).
        """
        started = time.perf_counter()  # from here on the pre-hook's time is the recorder's (sys/recorder_ms)
        cpu = self._waits.begin() if self._waits is not None else 0.0
        t = self._step
        if (not self.recording or self._closed or self._captured_at == t or self._guard.stopped
                or self._link.failed()):
            return t
        self._captured_at = t
        self._asm.state_before = optimizer_state
        try:
            if self._joint is not None:  # a pair of a joint run: is it this pair's turn?
                self._joint.update_starting(self)
            LOOP.update_starting(self._start_state)  # the loop's first update: every start state is final
            self._record_step(skipped, started)
            if self._waits is not None:
                self._waits.end(cpu)
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "optimizer.step() pre-hook" if self.options.auto_capture else "capture()")
        return t

    def end_step(self) -> None:
        """The update of the current step is over: go on to the next iteration.

        The optimizer's step post-hook calls it; call it yourself only for a
        step whose ``optimizer.step()`` never ran (``capture(skipped=True)``).
        Takes what the next record starts from (RNG state, module buffers).
        """
        if self._closed:
            return
        if not self.recording:
            self._step += 1
            return
        if self._guard.stopped:
            return
        try:
            self._end_update()
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "optimizer.step() post-hook")

    def begin_iteration(self, rng: dict[str, Any] | None = None) -> None:
        """Take the start-of-iteration state (RNG, buffers) of the current step again.

        :meth:`end_step` takes it right after the previous update; call this when
        something between that moment and the iteration changes it (a per-epoch
        reseed, loading a checkpoint), so that replay starts where training did.

        ``rng``: the RNG state to record instead of the current one (a trainer restored
        it, then drew from it before this call could be made), as ``Run.rng_state`` gives it.
        """
        if rng is not None and not (isinstance(rng, dict) and "torch" in rng):
            raise ConfigError(f"begin_iteration(rng=) takes a dict like Run.rng_state(), not {type(rng).__name__}")
        if not self.recording or self._closed or self._guard.stopped:
            return
        try:
            self._start_state.pin(self._step, rng)  # the caller's moment: nothing retakes it
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "begin_iteration()")

    # -- inside the hooks ----------------------------------------------------
    def _fail(self, err: BaseException, where: str) -> None:
        """A failure inside a hook: strict re-raises (a write failure as WriterError), else step aside."""
        self._link.fail(err, where)

    def _step_aside(self, failure: Failure) -> None:
        """The guard's first failure: no more hooks, nothing held, the run marked."""
        self._modules.remove()  # no more activations piling up for a record that never comes
        if self._ring is not None:
            self._ring.release_all()
        self._user.pending.clear()
        self._start_state.drop()
        LOOP.leave(self._start_state)
        self._lean.drop()  # nothing in flight is sent any more

    def _saw_forward(self, module: nn.Module, args: Any) -> None:  # the model's forward pre-hook
        if not torch.is_grad_enabled():  # an evaluation under no_grad
            return
        again = self._start_state.training_forward()  # a training forward (or one with grad enabled)
        t = self._step
        watch = self._asm.structure  # its flag only (no call): the pre-hook looks at the optimizer's groups
        if watch is not None and watch.dirty and self._captured_at != t and not self._guard.stopped:
            try:  # the model's structure changed since the last look (a layer pruned before this forward)
                self._asm.follow(self.model, t, self._start_state.begin)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")
        if self._lean.enabled and self._captured_at != t and not self._guard.stopped and self._level(t) == LEVEL_STATS:
            try:
                self._lean.forward_started(t, lambda: self._asm.entries(False, step=t), again)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")

    def _saw_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:  # its forward hook
        if not torch.is_grad_enabled() and not self._closed and not self._guard.stopped:
            try:  # an evaluation's forward: the iteration's start RNG is after it (capture/iteration.py)
                LOOP.eval_ended()
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward hook")

    def _begin_iteration(self, t: int) -> StartState | None:
        """What a record of step ``t`` needs from the start of its iteration, taken now (None: nothing)."""
        # A callable schedule may say yes only later (a trigger set by the loop): then always taken.
        full = self._level.full(t) or self._ring is not None or self._level.full.dynamic
        every = self._keyframes or self._asm.gradlog  # RNG (a gradient log: buffers too) at every step
        if not full and not (every and self._level(t) != LEVEL_NONE):
            return None
        with span("stepdump.begin"):  # a no-op unless a torch profiler is on
            keep = full or self._asm.gradlog
            return begin_state(self._asm.layout, self._filter if keep and "params" in self.kinds else None)

    def _record_step(self, skipped: bool, started: float) -> None:
        t = self._step
        user, begin = self._user, self._start_state.begin
        scalars = user.step_recorded(t)  # step t-1's, held since its update ended
        self._send_held()
        meta = self._asm.refresh_layout(self.model, t, begin)
        with span("stepdump.capture"):  # a no-op unless a torch profiler is on
            auto_scalars(user.pending.setdefault(t, {}), self.optimizer, self.scaler)
            if self._ring is not None:
                self._ring.remember(scalars)
            level = self._level(t)
            if self._asm.changed_at == t and self._asm.gradlog and level != LEVEL_NONE and begin is not None:
                level = LEVEL_FULL  # a gradient log replays no update across a change of names: a keyframe
            msg = StepMessage(step=t, level=level, skipped=skipped, scalars=scalars, meta=meta)
            captured = self._modules.take()
            first: list[StepMessage] = []  # held ring steps, written before this one
            held = False  # a lean step's message waits for its grads' rows (sent by end_step)
            if level != LEVEL_NONE:
                ring = self._ring if level == LEVEL_STATS else None  # the ring decides on a full copy

                def acquire() -> Slot:  # a staging slot, taken only by a step that stages something
                    msg.slot = self._pool.acquire(lambda: self._link.error)
                    return msg.slot

                try:
                    held = self._asm.fill(msg, acquire, level == LEVEL_FULL or ring is not None, begin,
                                          user.batch, captured)
                    slot = msg.slot
                    if ring is not None:
                        grads = [p.grad for p in self._asm.layout.params.values() if p.grad is not None]
                        first = ring.take(msg, t, slot or acquire(), grads)  # (fill staged this step: a slot)
                    elif slot is not None and slot.event is None and owned(msg.items):
                        # Nothing in the slot (a lean step's rows are computed or copied already, a small
                        # gradient-log step's bytes copied out): the slot goes back now, and the message
                        # may wait for the writer (capture/mailbox.py).
                        self._pool.release(slot)
                        msg.slot = None
                except BaseException:
                    if msg.slot is not None:
                        self._pool.release(msg.slot)  # never sent: the writer will not hand it back
                    raise
            user.batch = None
            for m in (*first, *(() if held else (msg,))):
                self._link.put(m)
        self._overhead += time.perf_counter() - started

    def _send_held(self) -> None:  # a lean step's message, once its grads are read (the update is over)
        if (msg := self._lean.finish()) is not None:
            self._link.put(msg)

    def _end_update(self) -> None:
        started = time.perf_counter()
        cpu = self._waits.begin() if self._waits is not None else 0.0
        # The hooks' waits for the GPU in this iteration (their time is in self._overhead); those of
        # this post-hook count in the next one, as its time does (below).
        on_gpu = self._waits.on_gpu() if self._waits is not None else 0.0
        self._send_held()
        # What the update left in the params (while the writer finishes its grads), for the next record
        # to compare with (a callable schedule may decide later: taken as full).
        lv = self._level
        self._asm.after_update(LEVEL_FULL if lv.full.dynamic or lv.stats.dynamic else lv(self._step + 1))
        # a gradient log's grads, written during the update
        self._asm.stager.wait_deferred(self._link.is_alive, self._pool.gpu_waits)
        if self._waits is not None:
            bg = self._bg.take()
            waited = self._waits.waited(started - self._iter_start, self._overhead, bg, cpu)
            profile_scalars(self._user.pending.setdefault(self._step, {}), started - self._iter_start,
                            max(0.0, self._overhead - on_gpu), self._device, bg, waited, self._waits.unseen(bg), on_gpu)
        self._step += 1
        self._user.after_update = True
        self._start_state.open(self._step)
        # The RNG right after this update: a final record's, if it is the last. Where the next iteration's
        # start state was just taken (a gradient log, keyframes, a full record next), it is that reading.
        begin = self._start_state.begin
        if begin is not None and isinstance(begin.get("rng"), dict):
            self._final.rng.keep(begin["rng"])
        else:
            self._final.rng.take()
        LOOP.update_ended(self._start_state)  # another Recorder of this loop: its iteration starts after this update
        # The next iteration starts where this one's accounting stopped, so the time
        # _begin_iteration took counts both as recorder time and as iteration time.
        self._iter_start = started
        self._overhead = time.perf_counter() - started
        if self._waits is not None:
            self._waits.end(cpu)  # the post-hook's CPU time: the next iteration's, as its wall time

    def _spent(self, seconds: float) -> None:  # a timed hook's time: the recorder's, in this iteration
        self._overhead += seconds


Recorder.__signature__ = inspect.signature(Recorder.__init__).replace(  # without self, as a class shows it
    parameters=list(inspect.signature(Recorder.__init__).parameters.values())[1:],
    return_annotation=inspect.Signature.empty)
_PARAMETERS = frozenset(Recorder.__signature__.parameters)
