"""Lean capture: stats and fingerprints of the live tensors, off the training thread, no copy.

A stats-only record does not need the tensors' bytes, only what they say: their
health stats and an exact fingerprint. Copying the whole record into staging to
compute those later is what made stats-only steps cost ~1.3x. Here the
training thread hands *references* to a worker thread, which reads the live
tensors while the forward and backward run:

* params and optimizer state of update *t* are submitted at the iteration's first
  training forward (:meth:`LeanCapture.forward_started`; submitted again at a later
  forward when no backward ran since, so an evaluation with grad enabled before the
  training forward is not what gets read) and collected at the optimizer pre-hook
  (:meth:`LeanJob.rows_for`);
* grads are final at the pre-hook and no torch optimizer writes into them, so
  they are submitted there and collected at the post-hook, while the update runs.

Nothing guarantees that the params the worker read are the ones the optimizer steps
from: user code may swap other weights in through ``.data`` (an EMA evaluated with grad
enabled), copy into them through ``.data`` or a numpy view (no version bump), or
re-initialise them between backward and step. So the content is checked where it
counts: at the pre-hook, on the training thread, the exact fingerprint of each param
(and of the optimizer state read) is computed from the live bytes, one xxh3 pass, and
a worker row is used only when its fingerprint is that one; any other row is computed
again there, from the bytes the update reads. For the stats of a used row to describe
those same bytes, the worker reads each tensor through a private buffer, chunk by
chunk (``private``): its stats and its fingerprint come from the same copied bytes, so
a fingerprint equal to the live one proves the stats are the live bytes' too, even if
the tensor was changed and changed back while the worker read it. Version counters
(bumped by in-place ops) and object identity are checked as well: a tensor replaced
(a new param group, ``load_state_dict``) is computed again.

Stats per tensor: numel, NaN/+Inf/-Inf counts (exact), min, max and L2 norm; for the
large float tensors they come from the chunks (the norm as the root of the sum of the
chunks' squared norms), small tensors (most of a transformer's, few of its bytes) get
every stat of :func:`stepdump.core.stats.compute_stats`. The fingerprint is the same
exact xxh3 of the bytes as at a full step (xxh3 streamed over the chunks equals xxh3 of
the whole), so ``diff`` and gradient-log verification can trust it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from operator import attrgetter, is_
from typing import Any, NamedTuple, TypeVar, cast

import torch
import xxhash

from stepdump.capture.packed import (CHUNK, FUSED_DTYPES, PACK, SMALL, LeanRow, Plan, Plans, RowHead, batch_key,
                                     packable, packed_rows, tensor_attrs)
from stepdump.capture.profiling import blocked
from stepdump.capture.staging import storable
from stepdump.capture.step_state import Entry
from stepdump.core.dtensor import local_part
from stepdump.core.device_lean import DEVICE_FP_KIND, device_fingerprint
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import PLAIN_TENSORS, LiveHasher, fingerprint, signed64
from stepdump.core.stats import StatsTuple, compute_stats
from stepdump.store.format import format_shape
from stepdump.store.records import as_records

log = logging.getLogger(__name__)

# Tensors up to this many elements go through compute_stats (its numpy path is
# cheaper than four torch dispatches); larger fp32/fp64 ones take the chunked path.
_SMALL = SMALL
_FUSED_DTYPES = FUSED_DTYPES
# Elements per chunk of the chunked path: 512 KiB of fp32, so that the copy, the hash, the
# norm and min/max of a chunk read it from the core's L2 cache, not from memory four times.
_CHUNK = CHUNK
__all__ = ["LeanRow"]  # defined in packed.py (it builds them), imported from here by the writer and readers


def lean_rows(entries: Sequence[Entry], warned: set[tuple[str, str]], private: bool = False,
              plan: Plan | None = None, rest_only: bool = False) -> list[LeanRow]:
    """Stats and fingerprint rows of ``entries`` (live tensors), computed now, on this thread.

    ``private``: read each tensor through a private copy (a chunk at a time for the large
    ones), so that its row describes one set of bytes even if the tensor is written
    meanwhile; a tensor whose exact NaN/Inf counts that would need is left out (the
    caller computes it where nothing writes it). The rows are the same either way.

    The fp32/fp64 tensors up to ``_CHUNK`` elements (most tensors of most models, few of the
    bytes of a large one) are copied into one private buffer per dtype, a batch at a time,
    and described together (:func:`snapshot`, :func:`~stepdump.capture.packed.packed_rows`): a few vectorised passes
    over the batch instead of several torch calls per tensor, which is what a small model's
    step paid for.

    ``plan``: ``entries``' :class:`~stepdump.capture.packed.Plan` (their layout's, cached by the
    caller): the same rows, without the per-tensor work of naming and packing them.
    ``rest_only``: ``entries`` are those a plan did not pack
    (:meth:`~stepdump.capture.packed.Plan.others`): each is described by itself.
    """
    rows: list[LeanRow]
    if rest_only:
        rows, rest = [], list(entries)
    elif plan is not None and plan.plain and not private:
        rows, rest = plan.rows(entries)
    else:
        rest, packed = snapshot(entries, warned)
        rows = packed()
    if not rest:
        return rows
    buffers: dict[torch.dtype, torch.Tensor] = {}
    with torch.no_grad():
        for e in rest:
            t = e.tensor
            got = _stats_and_fp(e.kind, t, buffers if private else None)
            if got is not None:
                rows.append(LeanRow(e.kind, e.name, e.param, e.key, stored_dtype(t), format_shape(t.shape), *got))
    return rows


def as_dmix64(rows: Sequence[LeanRow], entries: Sequence[Entry], warned: set[tuple[str, str]]) -> list[LeanRow]:
    """``rows`` with their fingerprints taken again as dmix64 (``Recorder(fingerprint="dmix64")``),
    of ``entries``' tensors as they are now: the caller computed ``rows`` from these same tensors
    on this thread, just before, so both describe one set of bytes. One tensor at a time, by
    torch ops (core/device_lean.py): an opt-in for comparing CPU runs with GPU runs, not the
    fast path."""
    tensors = {(e.kind, e.name): e.tensor for e in entries}
    out = []
    with torch.no_grad():
        for r in rows:
            t = storable(r.kind, r.name, local_part(tensors[(r.kind, r.name)].detach()), warned)
            if t is not None:  # lean_rows made a row of it, so it is storable
                out.append(r._replace(fp=int(device_fingerprint(t)), fp_kind=DEVICE_FP_KIND))
    return out


def snapshot(entries: Sequence[Entry], warned: set[tuple[str, str]]) -> tuple[list[Entry], Callable[[], list[LeanRow]]]:
    """Copy the packable tensors among ``entries`` now (one ``torch.cat`` per batch); return the
    others (storable ones, each with its tensor as stored) and a function that gives the copies'
    rows, as of now, on any thread, later. The copy is the only work done here: the training
    thread can take a snapshot and leave its description to the worker."""
    rest: list[Entry] = []
    batches: dict[tuple[torch.dtype, bool], list[tuple[tuple, torch.Tensor]]] = {}  # a RowHead's fields, the tensor
    sizes: dict[tuple[torch.dtype, bool], int] = {}
    done: list[tuple[list[RowHead], torch.Tensor, list[int]]] = []
    with torch.no_grad():
        for e in entries:
            t = storable(e.kind, e.name, local_part(e.tensor.detach()), warned)
            if t is None:
                continue
            if not _packable(t):
                rest.append(Entry(e.kind, e.name, t, e.full, e.param, e.key))
                continue
            key = batch_key(t)
            batch = batches.setdefault(key, [])
            batch.append(((e.kind, e.name, e.param, e.key, stored_dtype(t), format_shape(t.shape)), t))
            sizes[key] = sizes.get(key, 0) + t.numel()
            if sizes[key] >= _PACK:
                done.append(_pack(batch))
                batches[key], sizes[key] = [], 0
        done.extend(_pack(batch) for batch in batches.values() if batch)

    def describe() -> list[LeanRow]:  # packed.packed_rows: a few vectorised passes per batch
        return [LeanRow(*head, *got) for heads, buf, ns in done
                for head, got in zip(heads, zip(*packed_rows([h.kind for h in heads], buf, ns)), strict=True)]

    return rest, describe


_PACK = PACK  # elements per packed batch (packed.py)
_packable = packable


def _pack(batch: list[tuple[tuple, torch.Tensor]]) -> tuple[list[RowHead], torch.Tensor, list[int]]:
    """One private copy of a batch's tensors, end to end: (their row heads, the copy, their sizes)."""
    flat = [t.reshape(-1) for _h, t in batch]
    buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
    return as_records(RowHead, [h for h, _t in batch]), buf, [f.numel() for f in flat]


def _stats_and_fp(kind: str, t: torch.Tensor,
                  buffers: dict[torch.dtype, torch.Tensor] | None) -> tuple[StatsTuple, int] | None:
    """(stats, fingerprint) of ``t``, read through a private copy when ``buffers`` is given."""
    if t.dtype in _FUSED_DTYPES and t.numel() > _SMALL and t.device.type == "cpu" \
            and t.layout == torch.strided:  # a sparse grad: compute_stats, over its values
        return _chunked(t, buffers)
    if buffers is not None:
        t = t.clone()  # small, or not fp32/fp64: one private copy (for as long as this tensor is read)
    stats = compute_stats(t) if kind != "state" else (t.numel(),) + (None,) * 9
    return stats, fingerprint(t)  # type: ignore[return-value]


def _chunked(t: torch.Tensor, buffers: dict[torch.dtype, torch.Tensor] | None) -> tuple[StatsTuple, int] | None:
    """Stats of a large fp32/fp64 tensor and its fingerprint, in one read of each chunk.

    Mean, std and the zero fraction would take two more passes over every large
    tensor (a sum; ``count_nonzero``, the costliest of all), which is most of
    what a stats-only step costs; they are NULL ("not measured", FORMAT.md) at
    lean steps, except a zero fraction that min and max prove to be 0. A tensor
    whose norm is not finite gets every stat, the exact counts included (read
    privately: None, it is computed where nothing writes it).

    Per chunk: xxh3 (which lets the GIL go while it hashes), the norm, and min and max as
    ``amin`` and ``amax`` (two vectorised passes cost two thirds of one ``aminmax`` on the
    CPU); the chunk's results stay tensors until one conversion at the end. Min and max are
    exact whatever computes them, and the norm is the root of the sum of the chunks' squared
    norms, as before.
    """
    flat = t.reshape(-1)
    if not flat.is_contiguous():  # a strided 1-d view: its bytes in order, as fingerprint() hashes them
        flat = flat.contiguous()
    n = flat.numel()
    size = flat.element_size()
    buf: torch.Tensor | None = None
    if buffers is not None:
        buf = buffers.get(t.dtype)
        if buf is None:
            buf = buffers[t.dtype] = torch.empty(_CHUNK, dtype=t.dtype)
    # One byte view (of the tensor, or of the private buffer); each chunk's is a slice of it.
    raw = memoryview((flat if buf is None else buf).view(torch.uint8).numpy())  # type: ignore[arg-type]
    h = xxhash.xxh3_64()
    norm_of, amin, amax = torch.linalg.vector_norm, torch.amin, torch.amax
    norms: list[torch.Tensor] = []
    los: list[torch.Tensor] = []
    his: list[torch.Tensor] = []
    for start in range(0, n, _CHUNK):
        c = flat[start:start + _CHUNK]
        if buf is None:
            h.update(raw[start * size:(start + c.numel()) * size])
        else:
            c = buf[:c.numel()].copy_(c)
            h.update(raw[:c.numel() * size])
        norms.append(norm_of(c))
        los.append(amin(c))
        his.append(amax(c))
    k = len(norms)
    got = torch.stack(norms + los + his).tolist()
    norm = got[0] if k == 1 else math.sqrt(math.fsum(v * v for v in got[:k]))
    if not math.isfinite(norm):  # a NaN or Inf somewhere (rare): the exact counts, the slow way
        return None if buf is not None else (compute_stats(t), fingerprint(t))
    lo, hi = min(got[k:2 * k]), max(got[2 * k:])
    zero_frac = 0.0 if lo > 0 or hi < 0 else None
    return (n, 0, 0, 0, lo, hi, None, None, norm, zero_frac), signed64(h.intdigest())


_T = TypeVar("_T")


def _result(future: Future[_T]) -> _T:
    """``future.result()``, a wait for the stats worker counted as the hook's (profiling.blocked)."""
    if future.done():
        return future.result()
    with blocked():
        return future.result()


class LeanJob:
    """Rows being computed on the worker for tensors whose versions were noted at submit."""

    def __init__(self, entries: list[Entry], pool: ThreadPoolExecutor,
                 compute: Callable[[list[Entry]], list[LeanRow | None]]) -> None:
        self._entries = entries
        self._versions = list(map(_VERSION_OF, map(_TENSOR, entries)))  # before the worker may read them
        self._future: Future[list[LeanRow | None]] = pool.submit(compute, entries)

    def rows_for(self, entries: Sequence[Entry], warned: set[tuple[str, str]], recompute: bool = True,
                 live: Mapping[str, int] | None = None,
                 hasher: LiveHasher | None = None, texts: RowTexts | None = None) -> tuple[list[LeanRow], int]:
        """Rows for ``entries`` (the tensors as they are now): the worker's where the same
        tensor is unchanged since submit, else computed here (``recompute``) or left out;
        and how many were not the worker's. With ``live`` (params and optimizer state at the
        pre-hook: name -> fingerprint of the params now, where the caller has it), a worker
        row is used only if it describes the bytes the tensor holds now (module docstring);
        ``hasher`` computes the other fingerprints now (exact, its byte views reused); ``texts``
        (kept by the caller from step to step) lets every row be checked at once (:meth:`_all_good`)."""
        results = _result(self._future)
        if (live is None or (hasher is not None and texts is not None)) \
                and (good := self._all_good(entries, results, live, hasher, texts)) is not None:
            return good, 0
        # A row is good for an entry when it was computed from the same tensor object,
        # and no in-place op touched that tensor from submit until now.
        ready: dict[tuple[str, str], tuple[torch.Tensor, LeanRow]] = {}
        for e, v0, row in zip(self._entries, self._versions, results, strict=True):
            if row is not None and _version(e.tensor) == v0:
                ready[(e.kind, e.name)] = (e.tensor, row)
        out: list[LeanRow] = []
        redo: list[Entry] = []
        for e in entries:
            hit = ready.get((e.kind, e.name))
            if hit is None:
                redo.append(e)
                continue
            tensor, row = hit
            if tensor is e.tensor and (live is None or _describes(row, e, live, warned, hasher)):
                out.append(row)
            else:
                redo.append(e)
        if redo and recompute:
            out.extend(lean_rows(redo, warned))
        return out, len(redo)


    def _all_good(self, entries: Sequence[Entry], results: list[LeanRow | None], live: Mapping[str, int] | None,
                  hasher: LiveHasher | None, texts: RowTexts | None) -> list[LeanRow] | None:
        """The worker's rows for ``entries`` where every one of them is good, decided for all at once
        with no Python call per entry: the entries are the ones submitted (the same tensor objects, in
        order), no in-place op touched them since, and (with ``live``) each row's dtype, shape and
        fingerprint are those of its tensor's bytes now: the params' from ``live``, the others' hashed
        now by ``hasher``. The same test as the per-entry path's (:func:`_describes`); None where any
        entry fails it, or is not a plain tensor, and that path decides each."""
        mine = self._entries
        if len(entries) != len(mine) or None in results:
            return None
        tensors = list(map(_TENSOR, entries))
        if not all(map(is_, tensors, map(_TENSOR, mine))) or list(map(_VERSION_OF, tensors)) != self._versions:
            return None
        rows = cast("list[LeanRow]", results)
        if live is None:
            return list(rows)
        if hasher is None or texts is None:
            return None
        made = texts(tensors)
        if made is None or list(map(_ROW_DTYPE, rows)) != made[0] or list(map(_ROW_SHAPE, rows)) != made[1]:
            return None
        # Each param's fingerprint now from ``live`` where it has one; every other tensor's hashed now.
        known = [f if k == "params" else None for f, k in zip(map(live.get, map(_NAME, entries)), map(_KIND, entries))]
        if [f for f in known if f is not None] != [r.fp for r, f in zip(rows, known) if f is not None]:
            return None
        need = [t for t, f in zip(tensors, known) if f is None]
        if need and hasher.fingerprint_seq(need) != [r.fp for r, f in zip(rows, known) if f is None]:
            return None
        return list(rows)


_TENSOR = attrgetter("tensor")
_KIND, _NAME = attrgetter("kind"), attrgetter("name")
_VERSION_OF = attrgetter("_version")
_ROW_DTYPE, _ROW_SHAPE = attrgetter("dtype"), attrgetter("shape")
_TEXT_KEY = attrgetter("dtype", "shape", "layout", "device", "is_quantized")


class RowTexts:
    """The dtype and shape texts (a row's ``dtype`` and ``shape``) of a list of tensors, made again only
    where one's type, dtype, shape, layout, device or quantization changed; None where one is not a
    plain dense tensor stored as it is (:func:`~stepdump.capture.staging.storable` would change it).
    The last two lists are kept: a lean step checks its params, and every tenth step its params and
    optimizer state."""

    def __init__(self) -> None:
        self._kept: list[tuple[tuple[list[Any], list[Any]], tuple[list[str], list[str]] | None]] = []

    def __call__(self, tensors: list[torch.Tensor]) -> tuple[list[str], list[str]] | None:
        key = (list(map(type, tensors)), list(map(_TEXT_KEY, tensors)))
        for k, texts in self._kept:
            if k == key:
                return texts
        plain = all(type(t) in PLAIN_TENSORS and t.layout == torch.strided and not t.is_quantized
                    and t.device.type != "meta" for t in tensors)
        made = ([stored_dtype(t) for t in tensors], [format_shape(t.shape) for t in tensors]) if plain else None
        self._kept = [(key, made), *self._kept[:1]]
        return made


def _describes(row: LeanRow, e: Entry, live: Mapping[str, int], warned: set[tuple[str, str]],
               hasher: LiveHasher | None = None) -> bool:
    """Whether ``row`` describes the bytes entry ``e``'s tensor holds now (exact fingerprint,
    dtype and shape); ``live`` gives the params' fingerprints already computed now."""
    kind, name = e.kind, e.name
    t = storable(kind, name, local_part(e.tensor.detach()), warned)
    if t is None or row.dtype != stored_dtype(t) or row.shape != format_shape(t.shape):
        return False
    fp = live.get(name) if kind == "params" else None
    if fp is None:
        fp = hasher(t, (kind, name)) if hasher is not None else fingerprint(t)
    return row.fp == fp


def _version(t: torch.Tensor) -> int:
    return int(t._version)


class LeanWorker:
    """One background thread computing lean rows (torch reductions and xxh3 release the GIL)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []  # the worker, once started (its CPU time: sys/recorder_bg_ms)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepdump-stats",
                                        initializer=lambda: self.threads.append(threading.current_thread()))
        self._warned: set[tuple[str, str]] = set()
        # The pre-hook's exact fingerprints of the live tensors, on the training thread (rows_for).
        self.hasher = LiveHasher()
        self.texts = RowTexts()  # the rows' dtype and shape texts of the tensors checked at the pre-hook

    @property
    def warned(self) -> set[tuple[str, str]]:
        return self._warned

    def submit(self, entries: Sequence[Entry], private: bool = False) -> LeanJob:
        """Compute ``entries``' rows on the worker (``private``: see :func:`lean_rows`)."""
        return LeanJob(list(entries), self._pool, lambda es: self._compute(es, private))

    def run(self, describe: Callable[[], list[LeanRow]]) -> Future[list[LeanRow]]:
        """Run ``describe`` (a :func:`snapshot`'s) on the worker."""
        return self._pool.submit(describe)

    def _compute(self, entries: list[Entry], private: bool) -> list[LeanRow | None]:
        rows = {(r.kind, r.name): r for r in lean_rows(entries, self._warned, private)}
        return [rows.get((e.kind, e.name)) for e in entries]

    def close(self) -> None:
        self._pool.shutdown(wait=True)



# Optimizer state at a lean step only every this many steps. Adam's state is two
# thirds of the bytes a stats-only step reads; its stats move slowly, and the
# fingerprints of the params (every step) show the first step an update differed.
OPTIMIZER_EVERY = 10


# A lean step whose params, grads (and optimizer state, when read) hold at most this many
# bytes is read whole at the optimizer pre-hook on the training thread (LeanCapture.take).
INLINE_BYTES = 2 << 20
# Such a record's copies are described by the writer thread (StepMessage.packed), not at the
# pre-hook (False: at the pre-hook, on the training thread; benchmarks compare both).
DEFER_PACKED = True


def _grad_marks(entries: list[Entry]) -> dict[str, tuple[int, int]]:
    """Each grad among ``entries`` as (object id, version): a backward creates or adds into it."""
    return {e.name: (id(e.tensor), _version(e.tensor)) for e in entries if e.kind == "grads"}


def _param_grad_marks(params: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, int]]:
    """:func:`_grad_marks` of the grads of ``params`` as they are now."""
    return {n: (id(g), _version(g)) for n, p in params if (g := p.grad) is not None}


def _before_update(step: int, entries: list[Entry], every: int | None) -> list[Entry]:
    """What the worker reads before update ``step``: params, and optimizer state every ``every``
    steps (None: OPTIMIZER_EVERY)."""
    if _reads_optimizer(step, every):
        return [e for e in entries if e.kind != "grads"]
    return [e for e in entries if e.kind != "grads" and e.kind != "optimizer"]


def _reads_optimizer(step: int, every: int | None) -> bool:
    return step % (OPTIMIZER_EVERY if every is None else every) == 0


class _Steady(NamedTuple):
    """The plan of a lean step of a layout's params and grads alone (:meth:`LeanCapture.steady`)."""

    layout: object  # the caller's layout, whose selected params and their grads the plan's entries are
    plan: Plan


class LeanCapture:
    """The Recorder's side of lean capture: when to submit what, and the message held
    until the step's grads are read (the post-hook sends it). Not ``enabled`` (the ring,
    CUDA): every method is a no-op and stats-only steps are copied like full ones."""

    def __init__(self, enabled: bool = True, grads_at_capture: bool = False, dmix64: bool = False) -> None:
        """``grads_at_capture``: the grads change between the record and the update by design
        (a framework that clips after the record: Lightning), so read them at the record.
        ``dmix64``: the rows' fingerprints are dmix64 (``Recorder(fingerprint="dmix64")``): every
        lean step is read whole at the pre-hook, on the training thread (:func:`as_dmix64`)."""
        self.enabled = enabled
        self.dmix64 = dmix64
        # Steps between reads of the optimizer state (None: OPTIMIZER_EVERY); a gradient log
        # reads it every step, so that a rebuild is verified at the step it is read at.
        self.optimizer_every: int | None = None
        self._worker = LeanWorker()
        self._before: LeanJob | None = None  # params + optimizer state of the coming update
        self._marks: dict[str, tuple[int, int]] = {}  # the grads when _before was submitted: a backward changes them
        self._params: list[tuple[str, torch.Tensor]] = []  # the params read then, whose grads _marks notes
        # (message, grads job, grad entries, rows of what was copied at the pre-hook)
        self._pending: tuple[Any, LeanJob, list[Entry], Future[list[LeanRow]] | None] | None = None
        # Grads computed at the pre-hook (from the start when they change after the record by design;
        # else after one was changed during a step).
        self._grads_now = grads_at_capture
        # The last lean step's bytes were at most INLINE_BYTES: the whole step is read at the
        # pre-hook, nothing is handed to the worker at the forward (see take()).
        self._inline = False
        # What the layout of a step's tensors decides, made once per layout (packed.py): a steady
        # inline step does no per-tensor Python but the key that finds it.
        self.plans = Plans()
        # The plan of the last step taken whole whose entries were its params and grads alone (take's
        # ``steady``) and its layout: the next such step is found by its tensors' attributes (:meth:`steady`).
        self._steady: _Steady | None = None

    def reads_optimizer(self, step: int) -> bool:
        """Whether lean step ``step`` reads the optimizer state (every ``optimizer_every`` steps)."""
        return _reads_optimizer(step, self.optimizer_every)

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker thread, once it has started."""
        return self._worker.threads

    def forward_started(self, step: int, entries: Callable[[], list[Entry]], again: bool = False) -> None:
        """A training forward of iteration ``step`` (``again``: not its first; ``entries``: the
        step's live tensors). The first submits the params and optimizer state it runs with; a
        later one submits them again when no backward ran since: that forward was an evaluation
        with grad enabled, perhaps with other weights swapped in (an EMA), and the training
        forward's params are the likelier ones. Which ones were read only costs time: the
        pre-hook uses a row only if it describes the params then (:meth:`take`)."""
        if self._inline or self.dmix64 or (self._before is not None and not again):
            return
        if self._before is not None and self._params:
            # A later forward: a backward since it was submitted (gradient accumulation) is seen in the
            # grads of the params read then, without listing the step's tensors again.
            if any(self._marks.get(n) != m for n, m in _param_grad_marks(self._params).items()):
                return
        now = entries()
        marks = _grad_marks(now)
        if self._before is not None and any(self._marks.get(n) != m for n, m in marks.items()):
            return  # a backward since: a micro-batch of the same step (gradient accumulation)
        self._before = self._worker.submit(_before_update(step, now, self.optimizer_every), private=True)
        self._marks = marks
        # Where the grads of the entries are the params' own (as tensor_entries lists them).
        params = [(e.name, e.tensor) for e in now if e.kind == "params"]
        self._params = params if {n for n, _ in params} >= set(marks) else []

    def take(self, msg: Any, entries: list[Entry], live: Mapping[str, int] | None = None,
             steady: object | None = None) -> bool:
        """Fill ``msg.lean`` for the step's ``entries`` (live tensors, none stored in full); the
        grads' rows follow in :meth:`finish`, so the message is held until then (True; False:
        no grads among ``entries``, the message is complete). ``live``: the params'
        fingerprints now, where the caller computed them already (else computed here).
        ``steady``: the layout (the caller's) whose selected params, then their grads, in its order,
        are ``entries``, and nothing else: a next step of it laid out the same may take :meth:`steady`."""
        before = _before_update(msg.step, entries, self.optimizer_every)
        grads = [e for e in entries if e.kind == "grads"]
        job, self._before = self._before, None
        # A small record is copied here, whole, on this thread (one copy per dtype): for a small
        # model the worker's hand-offs (a thread wake-up per submit, the GIL going to and fro
        # while the forward and backward run) cost more than the reading, and rows of a copy made
        # here describe the bytes the update reads by construction (no fingerprint check needed).
        # The copy is described by the writer thread, with the step's other rows.
        todo = [*before, *grads]
        plan = self.plans.get(todo)
        self._inline = plan.nbytes <= INLINE_BYTES
        if self.dmix64:  # read here, whole, then fingerprinted again as dmix64: the same bytes
            msg.lean.extend(as_dmix64(lean_rows(todo, self._worker.warned, plan=plan), todo, self._worker.warned))
            return False
        if self._inline:
            if plan.plain and DEFER_PACKED:
                # Copied now (the bytes the update reads), described by the writer (StepMessage.packed):
                # the numpy passes leave this thread and mostly run without the GIL, on another core.
                msg.packed = plan.snapshot(todo)
                msg.lean.extend(lean_rows(plan.others(todo), self._worker.warned, rest_only=True))
                if steady is not None and not plan.rest:
                    self._steady = _Steady(steady, plan)
            else:
                msg.lean.extend(lean_rows(todo, self._worker.warned, plan=plan))
            return False
        now: list[Entry] = []  # read here, at the pre-hook
        if job is not None:  # used only where it describes the bytes the update reads
            rows, _ = job.rows_for(before, self._worker.warned, live=live or {}, hasher=self._worker.hasher,
                                   texts=self._worker.texts)
            msg.lean.extend(rows)
        else:  # no forward seen (a closure optimizer, a model called through something else)
            now.extend(before)
        if self._grads_now:
            now.extend(grads)
            grads = []
        copies = None
        if now:  # the small tensors copied now (the bytes the update reads), described on the worker
            rest, packed = snapshot(now, self._worker.warned)
            msg.lean.extend(lean_rows(rest, self._worker.warned))
            copies = self._worker.run(packed)
        if not grads:
            if copies is not None:
                msg.lean.extend(_result(copies))
            return False
        self._pending = (msg, self._worker.submit(grads), grads, copies)
        return True

    def steady(self, msg: Any, layout: object, tensors: list[torch.Tensor]) -> bool:
        """A stats-only step of ``layout``'s selected params, then their grads (the caller's word),
        found by its tensors alone: where the last ``steady`` :meth:`take` was of this layout and
        their :func:`~stepdump.capture.packed.tensor_attrs` are that step's plan's, the step is copied
        as that plan copies (``msg.packed``) and True; else nothing is done (False). Each step's
        tensors are looked at: a param given other memory, a grad of another dtype or shape, is
        another plan (the general path makes it)."""
        got = self._steady
        if got is None or got.layout is not layout or self._before is not None or not self._inline:
            return False
        plan = got.plan
        if tensor_attrs(tensors) != plan.key[1]:
            return False
        msg.packed = plan.snapshot_tensors(tensors)
        return True

    def finish(self) -> Any:
        """The update is over: the held message, complete (None if there is none)."""
        if self._pending is None:
            return None
        msg, job, grads, copies = self._pending
        self._pending = None
        if copies is not None:
            msg.lean.extend(_result(copies))
        rows, changed = job.rows_for(grads, self._worker.warned, recompute=False)
        msg.lean.extend(rows)
        if changed and not self._grads_now:
            self._grads_now = True
            log.warning("stepdump: %d grad(s) changed in place during optimizer.step() at step %s before stepdump "
                        "read them; their stats are left out of that step, and from now on grads are read "
                        "before the update (slower)", changed, msg.step)
        return msg

    def drop(self) -> None:
        """Forget what is in flight (the Recorder stepped aside)."""
        self._before, self._pending, self._steady = None, None, None

    def close(self) -> None:
        self.drop()
        self._worker.close()
