"""Staging buffers: where the training thread copies tensors before the writer takes over.

Allocating fresh memory per step costs several times a copy, so each slot keeps
its buffers and reuses them while shapes stay the same. The pool holds a fixed
number of slots; when all are with the writer, the training thread waits
(backpressure) instead of dropping data or growing memory.

Staging memory is a fixed byte budget (``StoreOptions.staging_bytes``), split
evenly between the slots, not a copy of every recorded tensor: a tensor is
copied while its slot's budget lasts, and the others go to the writer *live*
(the tensor itself, ``Item.live``). The training thread is blocked in the
optimizer's pre-hook, so those tensors hold still until it returns; it returns
only once the writer has appended every live item of the step
(:meth:`StagingPool.wait_live`), so the optimizer never updates bytes the writer
still reads. Live items come first in a step's items, so that wait ends as soon
as possible and the copied rest is written while training goes on. Recording a
124M or a 7B model thus needs the same staging memory; what a bigger record
costs is time on the training thread, not memory. Ring mode is the exception:
it keeps the last N steps in full by definition, so its pool has no budget.

On CUDA, buffers are pinned host memory, filled with non_blocking copies on a
side stream; the training stream waits for that stream before the optimizer
updates anything, and the writer waits on an event before reading the bytes.
Health stats for CUDA tensors are computed on the device (see
:func:`device_stats`), so the writer thread does not compute them on the host.
A stats-only step's CUDA tensors are not copied to the host: the fused device pass
(capture/device_pack.py) describes them on the side stream, stats and the device
fingerprint (dmix64), and only those few numbers per tensor come back. Tensors
stored in full are copied (over the staging budget, by the writer itself). With
``fingerprint="xxh3"`` the bytes are hashed on the host, so every recorded tensor is
copied, stats-only steps included (docs/cuda.md).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import torch

from stepdump.capture.device_pack import DeviceLean, DevicePack, HeadsCache, Prepared, pack_on_device
from stepdump.capture.packed import layout_key
from stepdump.capture.profiling import GpuWaits, blocked
from stepdump.capture.step_state import Entry
from stepdump.core.device_lean import DEVICE_FP_KIND
from stepdump.core.dtensor import local_part
from stepdump.core.hashing import raw_bytes
from stepdump.core.sparse import as_recorded, exact_copy
from stepdump.core.stats import STATS_LEN, device_stats
from stepdump.errors import WriterError

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One tensor of one step on its way to the writer."""

    kind: str
    name: str
    tensor: torch.Tensor  # host copy of the tensor's bytes
    full: bool
    param: str | None = None
    key: str | None = None
    device_stats: torch.Tensor | None = None  # stats computed on the device, on host once the event fires
    raw: memoryview | None = None  # the staging buffer's bytes, made once per buffer (see Slot.raw_for)
    # The live tensor, not a copy: the training thread waits in the pre-hook until the
    # writer has appended it (Slot.live_done), as the optimizer would change it next.
    live: bool = False
    # A CUDA tensor fingerprinted on the device (capture/device_pack.py): its dmix64, a 0-dim
    # view of the pinned host pack, read by the writer once the slot's event has fired.
    device_fp: torch.Tensor | None = None
    fp_kind: str | None = None  # None: xxh3 of the bytes; "dmix64": ``device_fp``


def owned(items: list[Item]) -> bool:
    """Whether every item holds memory of its own (no staging slot's buffer, no live tensor, nothing
    pending on a device): then the step's slot can go back before the writer has the message."""
    return all(i.raw is None and not i.live and i.device_stats is None and i.device_fp is None for i in items)


_ITEM_TENSOR = attrgetter("tensor")


class Copied:
    """A step's staged items with their bytes copied out of the slot, one buffer per dtype; the
    writer makes the items again from them (:meth:`items`), so the training thread does no Python
    per tensor for the copy."""

    __slots__ = ("_plan", "_bufs", "nbytes")

    def __init__(self, plan: _CopyPlan, bufs: list[torch.Tensor]) -> None:
        self._plan, self._bufs = plan, bufs
        self.nbytes = plan.nbytes

    @property
    def plan(self) -> CopyPlan:
        """The copy plan of the step's layout: the same object at every step of that layout (the
        writer keys what it works out once per layout on it: gradlog_rows.CopiedLayout)."""
        return self._plan

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The copies, one flat buffer per dtype group of :attr:`plan` (its items end to end, in order)."""
        return self._bufs

    def items(self) -> list[Item]:
        """The items, in the order staged, each a view of the copies (on the writer's thread),
        with its bytes (``raw``) as a slot's copy has them: the writer describes the small ones
        together (gradlog_rows.small_rows) and reads no tensor's bytes through a view of its own."""
        out: list[Item | None] = [None] * len(self._plan.templates)
        for (idx, _), buf in zip(self._plan.groups, self._bufs, strict=True):
            views = torch._C._nn.unflatten_dense_tensors(buf, [self._plan.templates[n].tensor for n in idx])
            whole, at = raw_bytes(buf), 0
            for n, view in zip(idx, views, strict=True):
                i, size = self._plan.templates[n], view.numel() * view.element_size()
                out[n] = Item(i.kind, i.name, view, i.full, i.param, i.key, raw=whole[at:at + size])
                at += size
        return out  # type: ignore[return-value]  # every index is in one group


_ENTRY_TENSOR = attrgetter("tensor")
_ENTRY_FULL = attrgetter("full")


def _copies(plan: _CopyPlan, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (in the plan's item order) copied end to end, one new buffer per dtype group."""
    bufs = []
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python context manager (a step's gradient log)
    try:
        for idx, get in plan.groups:
            # (flatten copies the tensors end to end; a single tensor it hands back as a view: cloned)
            bufs.append(torch._C._nn.flatten_dense_tensors(list(get(tensors))) if len(idx) > 1
                        else tensors[idx[0]].reshape(-1).clone())
    finally:
        torch._C._set_grad_enabled(grad)
    return bufs


@dataclass
class _CopyPlan:
    templates: list[Item]  # the items staged (kept: their ids, the plan's key, stay theirs)
    groups: list[tuple[list[int], Any]]  # per dtype: the items' indices, an itemgetter of their tensors
    nbytes: int


CopyPlan = _CopyPlan  # the name the writer's side reads it by (Copied.plan)


class OwnedCopier:
    """Copies a small staged step out of its slot (:class:`Copied`), so that the slot goes back at
    once and the step can wait in the writer's mailbox (capture/mailbox.py) instead of waking it.
    Only plain CPU copies in the slot's buffers, at most ``limit`` bytes (a larger step keeps its
    slot: copying it would cost more than the writer's wake-up). What the items are is worked out
    once per layout: the staging plan of a known layout hands out the same items each step.

    :meth:`direct` copies such a step from the live tensors themselves, without a slot: one copy
    where staging and the copy out of the slot made two."""

    def __init__(self) -> None:
        # The last few layouts' plans (None: not copied), newest first: each slot has its own items.
        self._plans: list[tuple[list[int], _CopyPlan | None]] = []
        # direct(): the last few entry layouts' plans (None: not for this path), newest first.
        self._direct: list[tuple[tuple[list[tuple], list[tuple], list[bool]], _CopyPlan | None]] = []

    def direct(self, entries: list[Entry], limit: int) -> Copied | None:
        """``entries``' live tensors copied end to end into memory of their own, one buffer per dtype,
        as :meth:`__call__` copies them out of a slot (the same bytes: each tensor's elements in
        order); None where they are not all plain dense CPU tensors, or over ``limit`` bytes
        (staging takes them). What the entries are is worked out once per layout (the key: C calls
        only: packed.layout_key, and each entry's ``full``)."""
        tensors = list(map(_ENTRY_TENSOR, entries))
        key = (*layout_key(entries), list(map(_ENTRY_FULL, entries)))
        for known, plan in self._direct:
            if known == key:
                break
        else:
            plan = self._make_direct(entries, tensors, limit)
            self._direct.insert(0, (key, plan))
            del self._direct[_PLANS_KEPT:]
        if plan is None or plan.nbytes > limit:
            return None
        return Copied(plan, _copies(plan, tensors))

    @staticmethod
    def _make_direct(entries: list[Entry], tensors: list[torch.Tensor], limit: int) -> _CopyPlan | None:
        # Staging would store each as it is (storable: not quantized, not meta, not sparse; not a
        # DTensor or another subclass, whose local part it takes); anything else takes the slot.
        if not entries or any(type(t) not in _PLAIN or t.layout != torch.strided or not t.is_cpu or t.is_quantized
                              for t in tensors):
            return None
        groups: dict[torch.dtype, list[int]] = {}
        for n, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(n)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > limit:  # (kept as None for the layout: staging, always right, takes it)
            return None
        shape = _CopyPlan([], [(idx, itemgetter(*idx)) for idx in groups.values()], nbytes)
        # The items' templates (their heads; their tensors give the writer shapes and dtypes): views
        # of a first copy, memory of the plan's own, not the live tensors (which a template would
        # keep alive after the loop has let them go).
        views: list[torch.Tensor] = [torch.empty(0)] * len(entries)
        for (idx, _), buf in zip(shape.groups, _copies(shape, tensors), strict=True):
            for n, view in zip(idx, torch._C._nn.unflatten_dense_tensors(buf, [tensors[n] for n in idx]), strict=True):
                views[n] = view
        return _CopyPlan([Item(e.kind, e.name, v, e.full, e.param, e.key) for e, v in zip(entries, views, strict=True)],
                         shape.groups, nbytes)

    def __call__(self, items: list[Item], limit: int) -> Copied | None:
        ids = list(map(id, items))
        for known, plan in self._plans:
            if known == ids:
                break
        else:
            plan = self._make(items)
            self._plans.insert(0, (ids, plan))
            del self._plans[_PLANS_KEPT:]
        if plan is None or plan.nbytes > limit:
            return None
        return Copied(plan, _copies(plan, list(map(_ITEM_TENSOR, items))))

    @staticmethod
    def _make(items: list[Item]) -> _CopyPlan | None:
        if not items or any(i.raw is None or i.live or i.device_stats is not None or i.device_fp is not None
                            or not i.tensor.is_cpu or i.tensor.layout != torch.strided for i in items):
            return None
        groups: dict[torch.dtype, list[int]] = {}
        for n, item in enumerate(items):
            groups.setdefault(item.tensor.dtype, []).append(n)
        return _CopyPlan(list(items), [(idx, itemgetter(*idx)) for idx in groups.values()],
                         sum(i.tensor.numel() * i.tensor.element_size() for i in items))


@dataclass
class Slot:
    """Reusable buffers for one step in flight, at most ``budget`` bytes of them (None: no limit)."""

    index: int
    budget: int | None = None
    held: int = 0  # bytes of the buffers in ``buffers``
    buffers: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    views: dict[tuple[str, str], memoryview] = field(default_factory=dict)
    event: object | None = None  # torch.cuda.Event when a device copy is pending
    device_pack: object | None = None  # a lean CUDA step's rows (capture/device_pack.DevicePack), after ``event``
    # Set by the writer when it has processed a message whose slot is held (ring mode).
    written: threading.Event = field(default_factory=threading.Event)
    # Live items of the step staged here (set by the Stager), and the writer's word that
    # it has appended them all. Cleared when a step is staged, not on release: the
    # writer may release the slot before the training thread has seen the event.
    has_live: bool = False
    live_done: threading.Event = field(default_factory=threading.Event)
    # Live tensors the optimizer does not change (a gradient log's grads): the training
    # thread waits for them at the end of the update instead (Stager.wait_deferred),
    # so the writer appends them while the update runs. With their versions at staging.
    deferred: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # Bumped whenever ``buffers`` loses or replaces one (Stager's plans check it). Not when it gains
    # one: a plan's buffers are all still there then (a gradient log's keyframe adds the params'
    # buffers to a slot whose steps' plan copies the grads: that plan stays good).
    generation: int = 0

    def buffer_for(self, kind: str, name: str, src: torch.Tensor, pin: bool) -> torch.Tensor | None:
        """A buffer like ``src`` for ``(kind, name)``: the one kept from an earlier step, or a
        new one if the budget has room for it; None when it has not (the tensor goes live)."""
        key = (kind, name)
        buf = self.buffers.get(key)
        if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype:
            return buf
        if buf is not None:  # the shape changed: its bytes go back to the budget first
            self.generation += 1  # a plan that copies into the old buffer is stale now
            self.held -= _nbytes(buf)
            del self.buffers[key], self.views[key]
        need = src.numel() * src.element_size()
        if self.budget is not None and self.held + need > self.budget:
            return None
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        self.buffers[key] = buf
        self.views[key] = raw_bytes(buf)
        self.held += need
        return buf

    def raw_for(self, kind: str, name: str) -> memoryview:
        """The bytes of a buffer, made when the buffer was: building a memoryview
        through numpy costs more than the writer's other per-tensor work on small
        tensors, and the buffer is reused step after step."""
        return self.views[(kind, name)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StagingPool:
    """A fixed set of slots shared between the training thread and the writer.

    ``budget``: bytes of staging buffers for all slots together, split evenly
    (None: no limit, for ring mode, which holds whole steps by definition).
    """

    def __init__(self, slots: int, budget: int | None = None) -> None:
        # SimpleQueue: its get and put are C calls (a Queue's are a dozen Python calls, at every step).
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        self.budget = budget
        # The writer's waits for the GPU (CUDA steps): a wait for a slot they cover is the GPU's.
        self.gpu_waits = GpuWaits()
        self._slots = [Slot(i, None if budget is None else budget // slots) for i in range(slots)]
        for slot in self._slots:
            self._free.put(slot)

    @property
    def slot_budget(self) -> int | None:
        """Bytes of staging buffers one slot may hold (None: no limit)."""
        return self._slots[0].budget if self._slots else self.budget

    @property
    def staged_bytes(self) -> int:
        """Bytes of staging buffers the slots hold now (never more than the budget)."""
        return sum(slot.held for slot in self._slots)

    def wait_live(self, slot: Slot | None, writer_alive: Callable[[], bool]) -> None:
        """Backpressure for live items: wait until the writer has appended the live tensors
        of the step staged in ``slot`` (no wait if it has none). A writer that failed still
        sets the event once nothing reads those tensors any more; one that died sets nothing,
        and then nothing reads them either."""
        if slot is None or not slot.has_live or slot.deferred or slot.live_done.is_set():
            return
        with blocked(self.gpu_waits):
            while not slot.live_done.wait(timeout=0.05):
                if not writer_alive():
                    return

    def acquire(self, writer_failed: Callable[[], BaseException | None]) -> Slot:
        """Wait for a free slot; give up with the writer's error if it died."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with blocked(self.gpu_waits):  # every slot is in the writer's hands: the training thread waits for it
            while True:
                try:
                    return self._free.get(timeout=0.05)
                except queue.Empty:
                    err = writer_failed()
                    if err is not None:
                        raise WriterError(f"stepdump's writer stopped: {err}") from err

    def release(self, slot: Slot) -> None:
        slot.event = None
        slot.written.clear()
        self._free.put(slot)


def _writer_event() -> torch.cuda.Event:  # pragma: no cover - needs a GPU
    """The event the writer waits on (``event.synchronize()``) before it reads a step's staged
    bytes or device pack. Blocking: its waiting thread sleeps until the GPU gets there. A default
    event's wait spins a core for as long as the GPU is behind, which on a GPU-bound step is
    nearly the whole step (GPT-2 small on an H200: the writer burned 41.8 ms of CPU in a 43.6 ms
    step, docs/cuda.md), a core taken from the user's data loaders and counted by
    ``sys/recorder_bg_ms`` as the recorder's work. The writer is not latency-bound: a wake-up
    later by a few microseconds costs nothing."""
    return torch.cuda.Event(blocking=True)


# Tensor types a staging plan copies from as they are (a DTensor, a subclass: the per-tensor path).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Layouts whose plans a slot keeps (a gradient log alternates two: its steps and its keyframes).
_PLANS_KEPT = 4


class _Plan(NamedTuple):
    """How a layout was staged into a slot with every tensor copied into a buffer of it."""

    key: list[tuple]  # _layout_key of the entries
    items: list[Item]
    buffers: list[torch.Tensor]  # each item's buffer, in the entries' order
    generation: int  # the slot's generation then: its buffers are still those while it stays


def _layout_key(items: list[Entry]) -> list[tuple]:
    """What decides how each entry is staged (a plan's key): all but the tensor's bytes."""
    return [(e.kind, e.name, e.full, e.param, e.key, type(t), t.dtype, t.shape, t.layout, t.is_cpu, t.is_quantized)
            for e in items for t in (e.tensor,)]


def storable(kind: str, name: str, t: torch.Tensor, warned: set[tuple[str, str]]) -> torch.Tensor | None:
    """The tensor as stepdump stores it, or None (with one warning) for a kind it cannot store.

    Sparse COO gradients (``nn.Embedding(sparse=True)``) are stored as they are, indices
    (duplicates and their order) and values: the update adds duplicates one by one, so
    ``to_dense()`` is not the gradient it applies (FORMAT.md, "Sparse tensors"). Other
    sparse tensors (a sparse momentum buffer, whose exact form the step's state keeps)
    are stored dense. Quantized and meta tensors have no plain bytes to store: recording
    narrows to the tensors it can store instead of failing the step (docs/concepts.md,
    "What is supported").
    """
    if t.layout != torch.strided:
        return as_recorded(kind, t)
    if t.is_quantized or t.device.type == "meta":
        if (kind, name) not in warned:
            warned.add((kind, name))
            what = "quantized" if t.is_quantized else "meta (no data)"
            log.warning("stepdump: %s %r is a %s tensor, which stepdump cannot store; it is left out of "
                        "the record", kind, name, what)
        return None
    return t


class Stager:
    """Copies tensors of one step into a slot, on the CPU or from a CUDA device."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        # CUDA tensors fingerprinted on the device (dmix64; Recorder(fingerprint="auto"|"dmix64")),
        # their stats-only steps described there without a copy. False: "xxh3", bytes hashed on the host.
        self.device_fp = True
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()  # tensors left out, warned about once
        self._waiting: Slot | None = None  # a slot whose deferred live tensors the writer may still read
        self.defer_ok = True  # False once an update was seen changing a deferred tensor
        # slot index -> [(layout key, items, buffers, slot generation)] of the last few layouts staged
        # there with every tensor copied into a buffer: a step of one again is one copy call (_restage),
        # while the slot's buffers are still those (its generation).
        self._plans: dict[int, list[_Plan]] = {}
        # The all-device lean steps' layout, read once a step (device_pack.DeviceLean), and the
        # mixed CUDA steps' stats-only entries' heads (one list object per steady layout).
        self._device_lean = DeviceLean()
        self._mixed_heads = HeadsCache()

    def wait_deferred(self, writer_alive: Callable[[], bool], gpu: GpuWaits | None = None) -> None:
        """The update is over: wait until the writer has appended the deferred live tensors,
        then check that the update left them as they were (their version counters). ``gpu``: the
        writer's waits for the GPU (the pool's, StagingPool.gpu_waits)."""
        slot, self._waiting = self._waiting, None
        if slot is None:
            return
        if not slot.live_done.is_set():
            with blocked(gpu):
                while not slot.live_done.wait(timeout=0.05):
                    if not writer_alive():
                        break
        changed = sum(int(t._version) != v for t, v in slot.deferred)
        slot.deferred = []
        if changed and self.defer_ok:
            self.defer_ok = False
            log.warning("stepdump: optimizer.step() changed %d grad(s) in place while stepdump was writing them; "
                        "the grads this step recorded may be the changed ones (a gradient-log rebuild will say "
                        "so), and from now on grads are copied before the update (slower)", changed)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def stage(self, slot: Slot, items: list[Entry], defer: tuple[str, ...] = ()) -> list[Item]:
        """Stage entries into ``slot``: copies while
        its budget lasts, live items for the rest (first in the list returned: the writer
        takes them first, as the training thread waits for them; see :meth:`StagingPool.wait_live`).
        Live CPU tensors of the kinds in ``defer`` are waited for at the end of the update
        instead (:meth:`wait_deferred`): the optimizer does not change them. (Copies come
        first all the same: the writer's disk is often slower than the update.)"""
        if not items:  # a stats-only step whose rows are read elsewhere (capture/lean.py): nothing to stage
            slot.deferred, slot.has_live = [], False  # nothing to wait for (wait_live, wait_deferred)
            return []
        if self.device_fp and items[0].tensor.is_cuda:
            prepared = self._device_lean.prepare(items)  # (before the side stream waits: it may copy tables)
            if prepared is not None:
                self._stage_device_lean(slot, prepared)
                return []
        layout = _layout_key(items)
        plans = self._plans.setdefault(slot.index, [])
        for plan in plans:
            if plan.key == layout and plan.generation == slot.generation:
                return self._restage(slot, plan, items)
        plans[:] = [plan for plan in plans if plan.generation == slot.generation]  # the others' buffers are gone
        copied: list[Item] = []
        live: list[Item] = []
        cuda_entries = []
        # One copy call for the step's staged CPU tensors, not one per tensor: each torch call lets go
        # of the GIL, a hand-off to the writer when it waits for it.
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        slot.live_done.clear()
        slot.deferred = []
        slot.device_pack = None
        with torch.no_grad():
            for e in items:
                kind, name = e.kind, e.name
                t = storable(kind, name, local_part(e.tensor.detach()), self._warned)  # a DTensor: this rank's shard
                if t is None:
                    continue
                if t.layout == torch.sparse_coo:
                    # Copied whole, outside the budget: its nnz changes from step to step, so no
                    # buffer is reused, and a sparse grad is small beside its dense size.
                    copied.append(Item(kind, name, exact_copy(t), e.full, e.param, e.key))
                    continue
                if t.device.type == "cuda":
                    cuda_entries.append(Entry(kind, name, t, e.full, e.param, e.key))
                    continue
                buf = slot.buffer_for(kind, name, t, pin=False)
                if buf is None:
                    live.append(Item(kind, name, t, e.full, e.param, e.key, live=True))
                    if kind in defer and self.defer_ok:
                        slot.deferred.append((e.tensor, int(e.tensor._version)))
                    continue
                dsts.append(buf)
                srcs.append(t)
                copied.append(Item(kind, name, buf, e.full, e.param, e.key, raw=slot.raw_for(kind, name)))
            if dsts:
                torch._foreach_copy_(dsts, srcs)  # each as buf.copy_(t): the same bytes
            if cuda_entries:
                self._stage_cuda(slot, cuda_entries, copied, live)
        slot.has_live = bool(live)
        if not live and not cuda_entries and len(copied) == len(items) and all(i.raw is not None for i in copied) \
                and all(type(e.tensor) in _PLAIN for e in items):
            plans.insert(0, _Plan(layout, list(copied), dsts, slot.generation))
            del plans[_PLANS_KEPT:]
        if slot.deferred:
            if any(item.kind not in defer for item in live):  # some went live for the budget: wait now
                slot.deferred = []
            else:
                self._waiting = slot
        return live + copied

    @staticmethod
    def _restage(slot: Slot, plan: _Plan, items: list[Entry]) -> list[Item]:
        """:meth:`stage` of a layout staged into ``slot`` last time with every tensor copied into its
        buffer (the same items, buffers and bytes as then): one copy call, no Python per tensor."""
        slot.live_done.clear()
        slot.deferred = []
        slot.has_live = False
        if plan.buffers:  # (torch refuses an empty list)
            with torch.no_grad():
                torch._foreach_copy_(plan.buffers, [e.tensor for e in items])
        return list(plan.items)

    def _stage_device_lean(self, slot: Slot, prepared: Prepared) -> None:  # pragma: no cover - needs a GPU
        """A stats-only step whose every entry is a plain dense CUDA tensor (the common GPU lean
        step): the device pack alone, without the per-entry staging loop and layout key (740
        entries of GPT-2 small cost the training thread milliseconds there)."""
        slot.live_done.clear()
        slot.deferred = []
        slot.has_live = False
        device = prepared.tensors[0].device
        stream = self._side_stream(device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)
        with torch.no_grad(), torch.cuda.stream(stream):
            slot.device_pack = prepared.launch()
            event = _writer_event()
            event.record(stream)
        main.wait_stream(stream)  # the optimizer must not overwrite what the side stream still reads
        slot.event = event

    def _stage_cuda(self, slot: Slot, entries: list[Entry], copied: list[Item],
                    live: list[Item]) -> None:  # pragma: no cover - needs a GPU
        device = entries[0].tensor.device
        stream = self._side_stream(device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            if self.device_fp:
                # Stats-only entries: described on the device, a few numbers copied back
                # (capture/device_pack.py); no byte of them crosses to the host.
                lean = [e for e in entries if not e.full]
                if lean:
                    host = pack_on_device(lean)
                    slot.device_pack = DevicePack(self._mixed_heads(lean), host)
                entries = [e for e in entries if e.full]
            staged: list[tuple[Entry, torch.Tensor]] = []  # (entry, its pinned buffer)
            for e in entries:
                t = e.tensor
                buf = slot.buffer_for(e.kind, e.name, t, pin=True)
                if buf is None:
                    # Over the budget: the writer copies it to the host itself, one tensor at a
                    # time, after this slot's event (recorded below, after the training stream's
                    # work) fired, while the training thread waits for it.
                    live.append(Item(e.kind, e.name, t, e.full, e.param, e.key, live=True,
                                     fp_kind=DEVICE_FP_KIND if self.device_fp else None))
                    continue
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)
                staged.append((e, buf))
            if self.device_fp and staged:
                # Stats and dmix64 of the copied tensors from one device pass: the fingerprint
                # kind of a series is the same at its full and its stats-only steps.
                host = pack_on_device([e for e, _ in staged])
                for i, (e, buf) in enumerate(staged):
                    copied.append(Item(e.kind, e.name, buf, e.full, e.param, e.key,
                                       device_stats=host[i, :STATS_LEN].view(torch.float64),
                                       device_fp=host[i, STATS_LEN], fp_kind=DEVICE_FP_KIND))
            else:
                for e, buf in staged:
                    stats = device_stats(e.tensor)
                    host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
                    host_stats.copy_(stats, non_blocking=True)
                    # fingerprint="xxh3": the writer hashes the bytes on the host.
                    copied.append(Item(e.kind, e.name, buf, e.full, e.param, e.key, device_stats=host_stats))
            event = _writer_event()
            event.record(stream)
        # The optimizer must not overwrite a tensor the side stream is still reading.
        main.wait_stream(stream)
        slot.event = event
