"""The writer thread: stats, fingerprints, encoding, segment appends, catalog commits.

Order of work for one step: every blob is appended to the segment file (and, with
``durability="fsync"``, fsynced) *before* the catalog transaction that makes the step visible
commits. Bytes appended by a step that never committed are unreferenced garbage at the end of a
segment, never a wrong answer. What a crash can lose follows from this order and from the group
commit below; it is stated once, in docs/reliability.md ("After a crash").

Live items (staging.py: tensors over the staging budget, handed over uncopied)
come first in a step's items; once the last of them is appended, the writer sets
the slot's ``live_done`` and the training thread, waiting in the pre-hook, lets
the optimizer go on. A failed step sets it too, after the appender has stopped
reading, so the training thread never waits on a writer that gave up.

Group commit. The writer commits a step below full level (stats only: a lean step's rows, its
scalars; or a gradient log's step: its grads' bytes and rows) at once only if its last commit is
``COMMIT_WINDOW`` seconds old and no more mail waits behind it (the steps found waiting together
commit together, at most a window after they were due); otherwise the rows wait in Python until
then (the queue running dry or not), or until a full step, a meta change or the end comes, and then
go in together, in one transaction, after the held steps' bytes are written (and with
``durability="fsync"`` fsynced). A loop slower than that commits every step; a fast one about
1/``COMMIT_WINDOW`` times a second. A small stats-only step's copies (``StepMessage.packed``) are
described then too, those of one layout a block at a time (packed.blocks); so are a small gradient-log step's grads (``StepMessage.copied``), whose bytes are
appended when the step comes and whose rows are made at the commit (capture/gradlog_rows.py). Why: a commit of a small model's step rewrites a page of the tensors table per series
(rows are keyed by series, then step) in the WAL, and each SQLite call lets go of the GIL and takes
it back, a context switch of the training thread per statement; on a millisecond step those cost
the training thread more than the rows do (measured: docs/design-measurements.md, "Small records
described by the writer"). With ``durability="fsync"`` every step commits on its own.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stepdump.capture.appender import DEFAULT_MAX_PENDING, Appender
from stepdump.capture.gradlog_rows import CopiedLayout, CopiedStep, describe_copied, layout_key, small_rows
from stepdump.capture.projection import Pace
from stepdump.capture.lean import LeanRow
from stepdump.capture.mailbox import MAIL, Mailbox, MailReader, Written, mailable
from stepdump.capture.packed import Snapshot
from stepdump.capture.writer_lean import LeanRows
from stepdump.store.stat_chunk import ColumnBlock
from stepdump.core.device_lean import DEVICE_FP_KIND, HOST_FP_KIND, device_fingerprint
from stepdump.capture.staging import Copied, CopyPlan, Item, Slot, StagingPool
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import fingerprint_bytes, raw_bytes
from stepdump.core.stats import compute_stats
from stepdump.errors import WriterError
from stepdump.store.catalog import CatalogWriter
from stepdump.store.codecs import SeriesEncoder, get_codec
from stepdump.store.format import LEVEL_FULL, SEGMENT_DIR, format_shape
from stepdump.store.storage import Storage

log = logging.getLogger(__name__)

# Kinds whose tensors get health stats; ``state`` blobs (RNG, scheduler internals)
# get only a fingerprint, since their "mean" means nothing.
_NO_STATS = frozenset({"state"})
# Kinds stored as deltas against their previous blob by a delta codec: state that
# persists across steps. Activations and batches change wholesale from step to step.
_DELTA_KINDS = frozenset({"params", "grads", "optimizer", "buffers", "extra"})
# Kinds of state that often stays the same from one full step to the next (a frozen base under
# adapters, a causal-mask buffer): a tensor whose bytes equal its series' last stored blob (same
# fingerprint, length, dtype and shape) gets a row naming that blob instead of a new copy.
_SHARED_KINDS = frozenset({"params", "buffers", "extra"})
# Blobs at least this large go straight to the file; smaller ones are batched.
_DIRECT_WRITE = 1 << 20
# A copied gradient-log step's bytes lying end to end in its copy at least this long go to the file
# from there (Writer._append_copied), not through the batching buffer (a copy per step).
_DIRECT_RUN = 256 << 10
# Encoded bytes that may wait for the disk at least this much, whatever the staging budget
# (a smaller cap would make the writer wait on every batched write).
_MIN_PENDING = 4 * _DIRECT_WRITE
# Seconds stats-only steps may wait in the writer before their commit (module docstring).
COMMIT_WINDOW = 0.1
# Held steps' copies kept at most this many bytes: past it they are described before the commit
# (a fast loop with a record near lean.INLINE_BYTES would otherwise hold a window's worth).
HELD_PACKED_BYTES = 8 << 20
_DUE = object()  # what the writer's loop takes when held steps are due (no message came)


@dataclass
class StepMessage:
    """Everything the writer needs for one step. ``level`` None: scalars only."""

    step: int | None
    level: int | None = None
    skipped: bool = False
    items: list[Item] = field(default_factory=list)
    state_json: str | None = None
    scalars: list[tuple[int, str, Any]] = field(default_factory=list)
    slot: Slot | None = None
    hold_slot: bool = False  # ring mode: the recorder keeps the slot after this message
    meta: dict[str, Any] | None = None  # catalog meta to set in the same transaction (a new layout)
    lean: list[LeanRow] = field(default_factory=list)  # rows computed from live tensors (capture/lean.py)
    # Small tensors copied at the step, their rows described here, before ``lean``'s (capture/packed.py).
    packed: Snapshot | None = None
    # Staged items copied out of their slot (a small gradient-log step: staging.OwnedCopier), before ``items``.
    copied: Copied | None = None


class Writer(threading.Thread):
    """Consumes StepMessages from a bounded queue until it gets ``None``.

    Composed of a :class:`MailReader` (the messages in order: capture/mailbox.py) and a
    :class:`LeanRows` (stats-only rows: capture/writer_lean.py), each given what it needs per call.

    ``run_dir`` holds the catalog; segment bytes go through ``storage`` (the
    Recorder's, files under ``run_dir`` by default), which the writer closes when
    it ends.
    """

    def __init__(
        self,
        run_dir: Path,
        pool: StagingPool,
        codec: str,
        durability: str,
        segment_bytes: int,
        max_queue: int,
        delta_chain: int = 8,
        *,
        storage: Storage,
        fingerprint: str = "auto",
    ) -> None:
        super().__init__(name="stepdump-writer", daemon=True)
        # Recorder(fingerprint=): "dmix64" gives every new series dmix64; otherwise a row's kind is
        # its own (a CUDA tensor's dmix64 from the device, else xxh3). A series keeps its first kind.
        self._fp_kind = DEVICE_FP_KIND if fingerprint == DEVICE_FP_KIND else None
        self._check_kinds = False  # this step's rows need their kinds checked (_write)
        self.run_dir = run_dir
        self.pool = pool
        self.codec = get_codec(codec)
        self._encoder = SeriesEncoder(self.codec, delta_chain)
        self.durable = durability == "fsync"
        self.segment_bytes = segment_bytes
        # Tokens (mailbox.MAIL), the end (None), or a message put straight in (no mailbox).
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.mailbox = Mailbox()  # the Recorder's messages, in order (capture/mailbox.py)
        self.written = Written(notify=self.durable)  # what of it is written: fsync's bound on steps in flight
        self._mail = MailReader(self.queue, self.mailbox, self.written)
        self._lean = LeanRows()  # stats-only rows into catalog rows (capture/writer_lean.py)
        self.error: BaseException | None = None
        self.storage = storage
        # Owned bytes waiting for the disk (codec output) are capped like staging itself.
        budget = pool.budget if pool.budget is not None else DEFAULT_MAX_PENDING
        self._appender = Appender(self.storage, max_pending=max(budget, _MIN_PENDING))
        self._pace = Pace(run_dir)  # once the first steps are timed: bytes per hour vs free disk
        self.bytes_written = 0
        self.steps_written = 0
        self.last_step: int | None = None  # the last step committed (a failure's warning names it)
        self.failed_step: int | None = None  # the step whose write failed
        self._catalog: CatalogWriter | None = None
        self._segment: str | None = None
        self._segment_size = 0
        self._segment_seq = 0
        self._buffer = bytearray()
        self._buffer_offset = 0  # where the buffer's bytes go in the segment
        self._blob_rows: list[tuple[Any, ...]] = []  # the step's blob rows, added to the catalog before commit
        # series -> (blob, fingerprint, raw length, dtype, shape) of its last stored blob (_SHARED_KINDS),
        # in this writer session: a resumed Recorder stores each tensor again once.
        self._last_blob: dict[int, tuple[int, int, int, str, str]] = {}
        self._ready = threading.Event()
        # Stats-only steps not committed yet (group commit, module docstring): their tensor,
        # step and scalar rows, the first one's time, and their steps.
        self._held_tensors: list[tuple[Any, ...]] = []
        self._held_steps: list[tuple[int, int, int, float, str | None]] = []
        self._held_scalars: list[tuple[int, str, float | None]] = []
        self._held_blobs: list[tuple[Any, ...]] = []  # the blob rows of held steps (a gradient log's)
        self._held_blocks: list[ColumnBlock] = []  # held steps' described copies, in columns (a stat chunk's)
        self._held_packed: list[tuple[int, Snapshot]] = []  # held steps' copies, described at the commit
        self._held_packed_bytes = 0
        # Held copied gradient-log steps (their bytes appended, their rows made at the commit), and
        # the layouts of the last few copy plans (gradlog_rows.CopiedLayout).
        self._held_copied: list[CopiedStep] = []
        self._held_copied_bytes = 0
        self._layouts: dict[int, tuple[CopyPlan, CopiedLayout]] = {}  # id(plan) -> (plan, its layout)
        self._layouts_by_key: dict[tuple[Any, ...], CopiedLayout] = {}  # layout_key(plan) -> its layout
        self._borrowed = False  # an append since the last wait reads a staging slot's memory
        self._last_commit = -math.inf  # monotonic time of the last commit
        self._due: float | None = None  # when the held rows must commit (None: none held)

    # -- thread body -------------------------------------------------------
    def run(self) -> None:
        try:
            self._catalog = CatalogWriter(self.run_dir, synchronous="FULL" if self.durable else "NORMAL")
            self.last_step = self._catalog.last_step()  # a resumed run has steps already
            self._appender.start()
        except BaseException as e:  # noqa: BLE001 - surfaced to the training thread
            self.error = e
            self._ready.set()
            self._mail.drain(self._done_with)
            return
        self._ready.set()
        while True:
            msg: Any
            try:
                msg = self._mail.next(self._due, self._window())
            except queue.Empty:  # held steps waited long enough, or it is time to look at the mail
                msg = _DUE
            ok = self._mail.take(self._handle)
            if msg is None:  # the end: held steps commit before the catalog closes (a failure sets self.error)
                if ok:
                    self._handle(None)
                else:
                    self._mail.discard(self._done_with)
                break
            if not ok:
                if msg is not MAIL and msg is not _DUE:
                    self._done_with(msg)
                self._mail.drain(self._done_with)
                break
            if msg is MAIL or (msg is _DUE and (self._due is None or time.monotonic() < self._due)):
                continue  # (due: the mail just taken committed the steps that were due, and holds newer ones)
            if not self._handle(None if msg is _DUE else msg):
                self._mail.drain(self._done_with)
                break
        self._shutdown()

    def _window(self) -> float:
        """Seconds a step below full may wait for its commit (0: none waits)."""
        return 0.0 if self.durable else COMMIT_WINDOW

    def _more_mail(self) -> bool:
        """Whether more mail waits behind the message being written, to commit with it: while the
        held steps are due less than a window ago (a writer that never finds the mailbox empty still
        commits about once a window)."""
        return bool(len(self.mailbox)) and (self._due is None or time.monotonic() < self._due + COMMIT_WINDOW)

    def can_mail(self, msg: StepMessage) -> bool:
        """Whether ``msg`` may wait in the mailbox without waking the writer (mailbox.mailable)."""
        return mailable(msg, self._window())

    def _handle(self, msg: StepMessage | None) -> bool:
        """Write ``msg`` (None: only commit the held steps); False once the writer has failed."""
        try:
            if msg is None:
                self._commit_held()
            else:
                self._write(msg)
                if msg.level is not None:
                    self._pace.observe(self.bytes_written)
                if self._due is not None and time.monotonic() >= self._due and not self._more_mail():
                    self._commit_held()  # a steady stream of messages never leaves the queue dry
        except BaseException as e:  # noqa: BLE001 - surfaced to the training thread
            # Not logged as an error here: the training thread reports it, as a
            # WriterError or (on_error="warn") as the one warning it logs.
            step = self._held_steps[0][0] if self._held_steps else (None if msg is None else msg.step)
            log.debug("stepdump writer failed at step %s: %s", step, e)
            # A scalars-only message (close()) fails "after" the last committed step.
            last = -1 if self.last_step is None else self.last_step
            self.failed_step = step if step is not None else last + 1
            self.error = e
            self._rollback()
            self._quiesce()  # no append may still read the slot that is handed back next
            if msg is not None:
                self._done_with(msg)
            return False
        if msg is not None:
            self._done_with(msg)
        return True

    def _quiesce(self) -> None:
        try:
            if self._appender.is_alive():
                self._appender.wait()
        except BaseException as e:  # noqa: BLE001 - the first error is the one to report
            log.debug("stepdump: an append failed after a writer error: %s", e)

    def _rollback(self) -> None:
        """Forget the failed step's rows, so that _shutdown's commit makes none of it visible."""
        self._encoder.forget()
        self._last_blob.clear()  # it may name blobs of the rolled-back step
        self._forget_held()
        try:
            if self._catalog is not None:
                self._catalog.rollback()
        except BaseException as e:  # noqa: BLE001 - the first error is the one to report
            log.debug("stepdump: rollback after a writer error failed: %s", e)

    def _done_with(self, msg: StepMessage) -> None:
        if msg.slot is None:
            return
        msg.slot.live_done.set()  # already, unless the step failed before its live items were done
        if msg.hold_slot:
            msg.slot.written.set()
        else:
            self.pool.release(msg.slot)

    def _shutdown(self) -> None:
        try:
            if self._appender.is_alive():
                self._appender.stop()  # every queued append is done before files close
                if self.error is None and self._appender.error is not None:
                    raise self._appender.error
            if self._catalog is not None:
                if self._segment is not None:
                    # With durability="flush" the bytes are the OS's to write back,
                    # as for every step before (docs/reliability.md).
                    self.storage.sync(self._segment, durable=self.durable)
                self._catalog.close()
        except BaseException as e:  # noqa: BLE001
            self.error = self.error or e
        finally:
            self.storage.close()

    def wait_ready(self) -> None:
        self._ready.wait()

    # -- one step ----------------------------------------------------------
    def _write(self, msg: StepMessage) -> None:
        cat = self._catalog
        if cat is None:  # run() opens it before taking messages
            raise WriterError("the catalog is not open")
        device_pack = None
        if msg.slot is not None and msg.slot.event is not None:  # pragma: no cover - CUDA only
            self.pool.gpu_waits.wait(msg.slot.event)
            # a lean step described on the device: its rows have landed (read below, after the lean rows)
            device_pack, msg.slot.device_pack = msg.slot.device_pack, None
        if msg.packed is not None and msg.step is not None:
            # The copies a stats-only step made (LeanCapture.take): described when the held steps
            # commit, those of one layout together (packed.describe_all).
            self._held_packed.append((msg.step, msg.packed))
            self._held_packed_bytes += msg.packed.nbytes
            msg.packed = None
            if self._held_packed_bytes > HELD_PACKED_BYTES:  # bounded memory: described now, committed later
                self._describe_held(cat)
        rows = []
        self._blob_rows = []
        # Whether a row's kind must be checked against its series' (a store of xxh3 series only and
        # an xxh3 row: never; no call per row on that path). Read once a step: one row per series
        # a step, so a series a row of this step makes dmix64 gets no other row in it.
        self._check_kinds = check = cat.any_fp_kind
        if msg.copied is not None:
            # A small gradient-log step's copies: in bulk when its layout allows, else item by item.
            if msg.level is None or not self._append_copied(cat, msg.step, msg.copied):
                msg.items = [*msg.copied.items(), *msg.items]
            msg.copied = None
        live = sum(item.live for item in msg.items)  # they come first (Stager.stage)
        known = small_rows(msg.items, _NO_STATS)  # the small staged ones, described together
        for i, item in enumerate(msg.items):
            rows.append(self._item_row(cat, msg.step, item, known.get(i)))
            if i + 1 == live and msg.slot is not None:
                # Direct appends point into the live tensors: the optimizer may change them
                # once the training thread goes on, so the appends are done first.
                self._appender.wait()
                msg.slot.live_done.set()
        self._lean.rows(cat, msg.step, msg.lean, check, rows)  # computed before the message was sent
        if device_pack is not None:  # pragma: no cover - CUDA only
            self._lean.device_rows(cat, msg.step, device_pack, rows)  # type: ignore[arg-type]
        self._held_blobs.extend(self._blob_rows)
        stepped = msg.level is not None and msg.step is not None
        if stepped:
            self._held_tensors.extend(rows)
            self._held_steps.append((msg.step, msg.level, int(msg.skipped), time.time(),  # type: ignore[arg-type]
                                     msg.state_json))
        self._held_scalars.extend((s, n, _to_float(v)) for s, n, v in msg.scalars)
        # A step below full (stats only, or a gradient log's grads) held while the last commit is
        # recent, or while more mail waits behind it: the steps the writer finds waiting together
        # commit together (committing the first of them alone and the rest a window later would
        # make two commits a window where one does).
        now = time.monotonic()
        if not (msg.level == LEVEL_FULL or msg.meta or self.durable) \
                and (now - self._last_commit < COMMIT_WINDOW or self._more_mail()):
            if self._due is None:  # commits with the next ones (group commit), a window after the last
                # commit, or now when that is past (then _more_mail holds it a window at most)
                self._due = max(self._last_commit + COMMIT_WINDOW, now)
            if self._borrowed:  # appends reading the slot's memory: done before it is handed back
                self._appender.wait()
                self._borrowed = False
            return
        for key, value in (msg.meta or {}).items():
            cat.set_meta(key, value)
        self._commit_held()

    def _commit_held(self) -> None:
        """Insert the held rows (every step since the last commit, this one included) and commit."""
        cat = self._catalog
        if cat is None:
            raise WriterError("the catalog is not open")
        self._describe_held(cat)
        self._describe_copied()
        if self._held_blobs:
            self._flush_buffer(inline=True)  # nothing left to overlap with: the commit waits for it
            if self._segment is not None:  # bytes first, then the commit that points at them
                self._appender.wait()
                self._borrowed = False
                self.storage.sync(self._segment, durable=self.durable)
            cat.add_blobs(self._held_blobs)
        if self._held_tensors or self._held_blocks:
            # Rows with bytes go to the catalog's tensor rows (a blob each); the stats-only rows of
            # the window (and its described copies, in columns already) go together as one stat
            # chunk, a column per stat (store/stat_chunk.py).
            stored = [r for r in self._held_tensors if r[4] is not None]
            if stored:
                cat.add_tensors(stored)
            if len(stored) < len(self._held_tensors) or self._held_blocks:
                cat.add_stat_chunk([r for r in self._held_tensors if r[4] is None] if stored else self._held_tensors,
                                   self._held_blocks)
        if self._held_steps:
            cat.add_steps(self._held_steps)
        if self._held_scalars:
            cat.add_scalars(self._held_scalars)
        cat.commit()
        self._last_commit = time.monotonic()
        if self._held_steps:
            self.steps_written += len(self._held_steps)
            self.last_step = self._held_steps[-1][0]
        self._forget_held()

    def _describe_held(self, cat: CatalogWriter) -> None:
        """The held steps' copies (``StepMessage.packed``) described, into the held tensor rows."""
        held, self._held_packed, self._held_packed_bytes = self._held_packed, [], 0
        self._lean.describe(cat, held, self._held_tensors, self._held_blocks)

    def _describe_copied(self) -> None:
        """The held copied steps' rows (gradlog_rows.describe_copied), into the held tensor and blob rows."""
        held, self._held_copied, self._held_copied_bytes = self._held_copied, [], 0
        if held:
            rows = describe_copied(held)
            self._held_tensors.extend(rows.tensors)
            self._held_blobs.extend(rows.blobs)

    def _append_copied(self, cat: CatalogWriter, step: int | None, copied: Copied) -> bool:
        """A copied gradient-log step's bytes appended in a few slices, its rows made when it
        commits (gradlog_rows: the rows the per-item path makes); False, with nothing done, when
        the per-item path must take it (another codec or fingerprint kind, a kind with rules of its
        own, a segment to start)."""
        if self._check_kinds or self._fp_kind is not None or self.codec.needs_base or self.codec.name != "raw":
            return False
        layout = self._layout(copied.plan)
        if not layout.bulk or self._segment is None or self._segment_size + layout.total > self.segment_bytes:
            return False
        sids = layout.series(cat)  # (new series created in item order, as the per-item path does)
        bufs = copied.buffers
        raws = layout.raws(bufs)
        offset = at = self._segment_size
        for run in layout.runs:
            part = raws[run.group][run.start:run.stop]
            if len(part) >= _DIRECT_RUN:  # memory of its own already (the step's copy): not copied again
                self._flush_buffer()
                self._appender.append(self._segment, part, at, owned=True)
            else:
                if not self._buffer:
                    self._buffer_offset = at
                self._buffer += part
            at += len(part)
        self._segment_size = at
        self.bytes_written += layout.total
        if len(self._buffer) >= _DIRECT_WRITE:
            self._flush_buffer()
        self._held_copied.append(CopiedStep(step, layout, bufs, raws, sids, cat.new_blob_ids(layout.k),
                                            cat.segment_id(self._segment), offset, self.codec.name))
        self._held_copied_bytes += layout.total
        if self._held_copied_bytes > HELD_PACKED_BYTES:  # bounded memory: described now, committed later
            self._describe_copied()
        return True

    def _layout(self, plan: CopyPlan) -> CopiedLayout:
        """The layout of ``plan``, worked out once while it is among the last few seen. Plans of one
        layout (each staging slot has its own) share it: their held steps are described together."""
        got = self._layouts.get(id(plan))
        if got is not None and got[0] is plan:
            return got[1]
        if len(self._layouts) >= 8:
            self._layouts.clear()
            self._layouts_by_key.clear()
        key = layout_key(plan)
        layout = self._layouts_by_key.get(key)
        if layout is None:
            layout = self._layouts_by_key[key] = CopiedLayout(plan, _NO_STATS, _SHARED_KINDS, _DIRECT_WRITE)
        self._layouts[id(plan)] = (plan, layout)
        return layout

    def _forget_held(self) -> None:
        self._held_tensors, self._held_steps, self._held_scalars, self._held_blobs = [], [], [], []
        self._held_blocks = []
        self._held_packed, self._held_packed_bytes = [], 0
        self._held_copied, self._held_copied_bytes = [], 0
        self._due = None

    def _item_row(self, cat: CatalogWriter, step: int | None, item: Item,
                  known: tuple[tuple[Any, ...], int] | None = None) -> tuple[Any, ...]:
        """``item``'s tensor row (its bytes appended if it is stored); ``known``: its stats and
        fingerprint, computed already (gradlog_rows.small_rows)."""
        t = item.tensor
        if item.live and t.device.type != "cpu":  # pragma: no cover - needs a GPU
            # Over the staging budget on a device: copied here, one tensor at a time. The
            # slot's event (synchronized in _write) fired after the training stream's work.
            t = t.cpu()
        data = item.raw if item.raw is not None else raw_bytes(t)
        # The row's fingerprint is of its series' kind: the first row's (the item's own, or the
        # Recorder's fingerprint="dmix64"), kept at every later step even if the tensor moved to
        # another device: the host copy is fingerprinted again under the series' kind.
        want = item.fp_kind or self._fp_kind
        sid = cat.series_id(item.kind, item.name, item.param, item.key, want)
        fp_kind = cat.fp_kind(sid) if want is not None or self._check_kinds else HOST_FP_KIND
        if fp_kind != HOST_FP_KIND:
            if item.device_fp is not None and item.fp_kind == fp_kind:  # pragma: no cover - CUDA: the device pass's
                fp = int(item.device_fp)
            else:  # dmix64 of the host copy (a CPU tensor, or a CUDA one over the staging budget)
                fp = int(device_fingerprint(t))
        else:
            fp = fingerprint_bytes(data) if known is None else known[1]
        if item.kind in _NO_STATS:
            stats: tuple[Any, ...] = (t.numel(),) + (None,) * 9
        elif known is not None:
            stats = known[0]
        elif item.device_stats is not None:  # pragma: no cover - CUDA only
            stats = _from_device_stats(item.device_stats)
        else:
            stats = compute_stats(t)
        blob = None
        dtype, shape = stored_dtype(t), format_shape(t.shape)
        if item.full:
            same = (fp, len(data), dtype, shape)
            last = self._last_blob.get(sid) if item.kind in _SHARED_KINDS else None
            if last is not None and last[1:] == same:
                blob = last[0]  # unchanged since its last stored blob: named again, not stored again
            else:
                # Bytes the writer made (a contiguous copy, a codec's output) count against the
                # appender's cap; a staging buffer or a live tensor's own bytes do not.
                borrowed = item.raw is not None or (item.live and t.is_contiguous())
                blob = self._append_blob(cat, data, t.element_size(), fp if fp_kind == HOST_FP_KIND else None,
                                         sid if item.kind in _DELTA_KINDS else None, borrowed)
                if item.kind in _SHARED_KINDS:
                    self._last_blob[sid] = (blob, *same)
        return (sid, step, dtype, shape, blob, *stats, fp)

    def _append_blob(self, cat: CatalogWriter, data: memoryview, itemsize: int, fp: int | None,
                     series: int | None = None, borrowed: bool = True) -> int:
        blob_id = cat.new_blob_id()
        encoded, base, codec_name = self._encoder.encode(series, blob_id, data, itemsize)
        # For the raw codec the stored bytes are the raw bytes: reuse the fingerprint (when it is
        # xxh3: ``fp`` None for another kind, as the checksum is always xxh3 of the stored bytes).
        checksum = fp if encoded is data and fp is not None else fingerprint_bytes(encoded)
        length = len(memoryview(encoded).cast("B"))
        key = self._segment_for(length)
        offset = self._segment_size
        if length >= _DIRECT_WRITE:
            self._flush_buffer()
            # On the appender thread; ``encoded`` (often a view of the staging slot)
            # stays untouched until the wait() before this step's commit.
            owned = encoded is not data or not borrowed
            self._borrowed = self._borrowed or not owned
            self._appender.append(key, encoded, offset, owned=owned)
        else:
            # Small blobs are gathered and written with one syscall per step.
            if not self._buffer:
                self._buffer_offset = offset
            self._buffer += encoded
            if len(self._buffer) >= _DIRECT_WRITE:
                self._flush_buffer()
        self._segment_size = offset + length
        self.bytes_written += length
        self._blob_rows.append(
            (blob_id, cat.segment_id(key), offset, length, codec_name, len(data), checksum, base)
        )
        return blob_id

    def _flush_buffer(self, inline: bool = False) -> None:
        if self._buffer and self._segment is not None:
            self._appender.append(self._segment, self._buffer, self._buffer_offset, owned=True, inline=inline)
            self._buffer = bytearray()  # the old one now belongs to the appender

    def _segment_for(self, length: int) -> str:
        if self._segment is None or (self._segment_size and self._segment_size + length > self.segment_bytes):
            if self._segment is not None:
                self._flush_buffer()
                self._appender.wait()
                self.storage.sync(self._segment, durable=self.durable)
                self.storage.close_writer(self._segment)
            self._segment = self._fresh_segment()
            self._segment_size = 0
        return self._segment

    def _fresh_segment(self) -> str:
        """The next segment key that is missing or empty. A new segment per writer session:
        the tail of an older one may hold garbage from a crash, and append-only means we
        never rewrite it (nor append after it: offsets start at 0)."""
        while True:
            self._segment_seq += 1
            key = f"{SEGMENT_DIR}/{self._segment_seq:06d}.seg"
            if self.storage.size(key) == 0:
                return key


def _from_device_stats(t: torch.Tensor) -> tuple[Any, ...]:
    v = t.tolist()
    counts = tuple(int(x) for x in v[:4])
    rest = tuple(None if math.isnan(x) else float(x) for x in v[4:])
    return counts + rest


def _to_float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
