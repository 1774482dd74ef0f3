"""Small tensors described together: one copy per dtype, a few vectorised passes, a plan per layout.

A small model's stats-only step reads dozens of tensors of a few thousand elements each; what
it costs is Python per tensor (a dozen calls each to name, check, copy and describe it), not
the bytes. Here:

* :func:`packed_rows` describes every tensor packed end to end in one buffer with a few
  passes over the whole buffer (segmented min, max, sum and sum of squares, computed as
  :func:`stepdump.core.stats.compute_stats` computes them for a small tensor, so the stats are
  the same bit for bit) and whole-column arithmetic, with Python per tensor left only for the
  rare ones that need it (a NaN or Inf to count, a mixed-sign small tensor's zeros, a mean
  large against its spread);
* a :class:`Plan` is what a list of entries' *layout* decides, made once: which tensors are
  packed into which buffer, their rows' names, dtype and shape texts, the byte ranges to hash,
  the record's size. :class:`Plans` keeps the last few, found again by a key of each entry's
  kind, name, tensor type, dtype, shape, layout and device: a param added to the optimizer,
  a grad that became None, a param given other memory of another shape or dtype is another key
  and so another plan. A step whose key matches does no per-tensor Python but building the key.

* :meth:`Plan.snapshot` copies a step's packed tensors (one copy per batch, at the optimizer
  pre-hook) into a :class:`Snapshot` that any thread describes later: the writer does, when the
  step commits, and :func:`describe_all` describes the held steps' small copies of one layout
  together, a pass per block of them (:func:`blocks`: a group commit's numpy calls are paid once
  a block, not once a step, and a layout needs one :class:`Segments`, whatever the count).

The rows are those :func:`stepdump.capture.lean.lean_rows` gives by its per-tensor path, in
the same order (tests/test_lean_packed.py compares them bitwise; tests/test_lean_deferred.py the
snapshots' rows, alone and together).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from stepdump.capture.step_state import Entry
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import PLAIN_TENSORS
from stepdump.core.stats import StatsTuple, compute_stats, segment_sums_array
from stepdump.store.format import format_shape

# Tensors up to this many elements get every stat (as compute_stats's numpy path gives them);
# larger ones min, max and norm (lean.py's chunked path measures no more).
SMALL = 4096
FUSED_DTYPES = (torch.float32, torch.float64)
# Elements of the largest tensor packed (lean.py: its chunk).
CHUNK = 1 << 17
# Elements per packed batch (4 MiB of fp32): bounds the private copy a batch needs.
PACK = 1 << 20
# Tensor types a plan packs; any other (a DTensor, a subclass) makes the step take the per-tensor path.
_PLAIN = PLAIN_TENSORS
_set_grad_enabled = torch._C._set_grad_enabled
# Copies of a batch kept for reuse, at most this many bytes (the writer holds up to
# writer.HELD_PACKED_BYTES of them for a commit): a copy made into fresh memory each step
# faulted its pages in on the training thread (30-200 page faults a step on a 100 k-param model,
# docs/design-measurements.md).
POOL_BYTES = 16 << 20
_foreach_copy = torch._foreach_copy_  # one C call: every tensor into its view of the buffer
_flatten = torch._C._nn.flatten_dense_tensors  # one C call: each tensor contiguous, viewed flat, concatenated
# np.count_nonzero without its Python wrapper (two Python calls per small tensor), where numpy has it.
_count_nonzero = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "count_nonzero", np.count_nonzero)


class LeanRow(NamedTuple):
    """One tensor's row of a stats-only record, ready for the catalog."""

    kind: str
    name: str
    param: str | None
    key: str | None
    dtype: str
    shape: str
    stats: StatsTuple
    fp: int
    fp_kind: str | None = None  # None: xxh3 (core.hashing); "dmix64": computed on the device (capture/device_pack.py)


class RowHead(NamedTuple):
    """A :class:`LeanRow`'s fields before its stats and fingerprint (``LeanRow(*head, stats, fp)``)."""

    kind: str
    name: str
    param: str | None
    key: str | None
    dtype: str  # as stored (core.dtypes.stored_dtype)
    shape: str  # as the catalog writes it (store.format.format_shape)


def packable(t: torch.Tensor) -> bool:
    """Whether ``t`` (a storable tensor) is described in a packed batch."""
    return t.dtype in FUSED_DTYPES and 0 < t.numel() <= CHUNK and t.layout == torch.strided and t.device.type == "cpu"


def batch_key(t: torch.Tensor) -> tuple[torch.dtype, bool]:
    """Which batch a packable tensor goes to: one per dtype, the small tensors (every stat) apart from
    the large ones (min, max, norm), so that a batch of large ones skips the passes only small
    ones need (their sums and zeros: :class:`Segments`)."""
    return t.dtype, t.numel() <= SMALL


# Vectorised over the whole buffer (one pass) when more than this many tensors need a zero count
# or a two-pass variance, else one call per such tensor (a few of them in a large buffer).
VECTOR_MIN = 4
# The whole-buffer two-pass variance (five passes over a float64 copy of the buffer) only when the
# tensors needing it are at least one per this many elements of the buffer: a few LayerNorm weights
# in a model's buffer (nanoGPT tiny: 5 tensors, 320 of 216,704 elements) cost ~5 us each one by
# one, where the whole-buffer passes cost ~10 ns an element of the buffer.
VECTOR_SPAN = 512


class StatColumns(NamedTuple):
    """The rows of tensors packed in one buffer, as columns (:meth:`Segments.columns`)."""

    counts: np.ndarray  # (4, k) int64: numel, nan, posinf, neginf; -1 where not measured
    floats: np.ndarray  # (6, k) float64: min, max, mean, std, norm, zero_frac; NaN where not measured
    fps: np.ndarray  # (k,) int64: xxh3-64 of each tensor's bytes, signed


class _Passes(NamedTuple):
    lo: np.ndarray
    hi: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    norm: np.ndarray
    zero_frac: np.ndarray
    signed: np.ndarray
    odd: np.ndarray
    fps: np.ndarray


class Segments:
    """What :func:`packed_rows` needs of a packed buffer's layout (its tensors' sizes, offsets, byte
    spans, which are ``state``), as columns made once: a :class:`Plan` keeps it for its layout."""

    def __init__(self, kinds: Sequence[str], sizes: Sequence[int], itemsize: int) -> None:
        self.k = k = len(sizes)
        self.itemsize = itemsize
        self.sizes = list(sizes)
        self.starts_list = list(accumulate(self.sizes[:-1], initial=0))
        self.starts = np.asarray(self.starts_list, dtype=np.intp)
        self.spans = [slice(a * itemsize, (a + m) * itemsize) for a, m in zip(self.starts_list, self.sizes, strict=True)]
        self.n = np.asarray(self.sizes, dtype=np.float64)
        self.total = sum(self.sizes)
        self.small = self.n <= SMALL
        self.large = ~self.small
        self.any_large = bool(_count_nonzero(self.large))
        self.state = np.array([kd == "state" for kd in kinds], dtype=bool)
        self.described = self.small & ~self.state  # every stat measured, where finite
        # Only a described tensor's row needs its sum (mean, std) and its zeros counted: a batch of
        # large tensors (Plan batches them apart from the small ones) skips those passes.
        self.sums = bool(_count_nonzero(self.described))
        self.one = self.n == 1  # one element: its two-pass variance is 0 (x - x)
        self.zeros = [0] * k

    def head(self, k: int) -> Segments:
        """The first ``k`` tensors of this layout, as ``Segments`` of their own (what one made of
        their kinds and sizes is), made of views of these columns: no object per tensor. A block of
        fewer copies than a batch's block size is described by the head of its Segments."""
        if k == self.k:
            return self
        h = Segments.__new__(Segments)
        h.k, h.itemsize = k, self.itemsize
        h.sizes, h.starts_list, h.spans, h.zeros = self.sizes[:k], self.starts_list[:k], self.spans[:k], self.zeros[:k]
        h.starts, h.n, h.small, h.large = self.starts[:k], self.n[:k], self.small[:k], self.large[:k]
        h.state, h.described, h.one = self.state[:k], self.described[:k], self.one[:k]
        h.total = sum(h.sizes)
        h.any_large = bool(_count_nonzero(h.large))
        h.sums = bool(_count_nonzero(h.described))
        return h

    def columns(self, buf: torch.Tensor) -> StatColumns:
        """:meth:`rows` as columns: the same values (None as -1 in the counts, NaN in the floats),
        with no Python object per value (what the writer puts in a stat chunk)."""
        k = self.k
        c = self._passes(buf)
        floats = np.empty((6, k))
        floats[0], floats[1], floats[4] = c.lo, c.hi, c.norm
        floats[2], floats[3], floats[5] = c.mean, c.std, c.zero_frac
        if self.any_large:  # mean and std not measured; the zero fraction only where min and max prove it 0
            floats[2][self.large] = floats[3][self.large] = np.nan
            floats[5][self.large & ~c.signed] = np.nan
        counts = np.zeros((4, k), dtype=np.int64)
        counts[0] = self.sizes
        if _count_nonzero(c.odd):  # rare: one by one, as rows() does
            state, sizes, starts_l = self.state, self.sizes, self.starts_list
            for i in c.odd.nonzero()[0].tolist():
                a, m = starts_l[i], sizes[i]
                st = (m,) + (None,) * 9 if state[i] else compute_stats(buf[a:a + m])
                counts[:, i] = [-1 if v is None else v for v in st[:4]]
                floats[:, i] = [np.nan if v is None else v for v in st[4:]]
        return StatColumns(counts, floats, c.fps.view(np.int64))

    def _passes(self, buf: torch.Tensor) -> _Passes:
        """The column passes :meth:`rows` and :meth:`columns` share (the same arithmetic)."""
        k, starts, n = self.k, self.starts, self.n
        x = buf.numpy()
        raw = memoryview(buf.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        fps = np.fromiter(map(xxhash.xxh3_64_intdigest, map(raw.__getitem__, self.spans)), dtype=np.uint64, count=k)
        with np.errstate(all="ignore"):  # inf and NaN: compute_stats
            lo = np.minimum.reduceat(x, starts)
            hi = np.maximum.reduceat(x, starts)
            # The sum and the sum of squares in float64, in element order: core.stats' own definition.
            # (Casting inside reduceat instead is a buffered reduction: slower in a training loop.)
            sums, sqs = segment_sums_array(x, starts, self.sums)  # (no sums where no row needs them)
            finite3 = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(sqs)  # what a large tensor's row needs
            finite = finite3 & np.isfinite(sums)
            signed = (lo > 0) | (hi < 0)  # of one sign: no zeros (-0.0 > 0 is False, as in the count)
            mean = sums / n
            msq = mean * mean
            var = sqs / n - msq
            full = finite & self.described
            # Cancellation regime (|mean| > 10 std, e.g. LayerNorm weights): two passes, in float64 (small_stats).
            again = full & (var < 1e-2 * msq)
            if _count_nonzero(again):
                var[again & self.one] = 0.0  # x - mean is exactly 0: the two-pass variance of one element
                self._two_pass(x, mean, var, again & ~self.one)
            need = full & ~signed  # counting zeros: only where there may be some
            zero_frac = self._zero_frac(x, need) if _count_nonzero(need) else np.zeros(k)
            std = np.sqrt(np.maximum(var, 0.0))
            norm = np.sqrt(sqs)
        odd = ~(finite3 & (finite | self.large)) | self.state  # small: finite; large: finite3
        return _Passes(lo.astype(np.float64), hi.astype(np.float64), mean, std, norm, zero_frac, signed, odd, fps)

    def rows(self, buf: torch.Tensor) -> tuple[list[StatsTuple], list[int]]:
        """(stats, fingerprints) of the tensors packed in ``buf`` (:func:`packed_rows`)."""
        c = self._passes(buf)
        if self.any_large:  # mean and std not measured; the zero fraction only where min and max prove it 0
            large = self.large
            mean_l, std_l, zero_l = c.mean.astype(object), c.std.astype(object), c.zero_frac.astype(object)
            mean_l[large] = std_l[large] = None
            zero_l[large & ~c.signed] = None
            mean_c, std_c, zero_c = mean_l.tolist(), std_l.tolist(), zero_l.tolist()
        else:
            mean_c, std_c, zero_c = c.mean.tolist(), c.std.tolist(), c.zero_frac.tolist()
        zeros = self.zeros
        stats: list[Any] = list(zip(self.sizes, zeros, zeros, zeros, c.lo.tolist(), c.hi.tolist(), mean_c, std_c,
                                    c.norm.tolist(), zero_c))
        if _count_nonzero(c.odd):  # rare: one by one
            state, sizes, starts_l = self.state, self.sizes, self.starts_list
            for i in c.odd.nonzero()[0].tolist():
                a, m = starts_l[i], sizes[i]
                stats[i] = (m,) + (None,) * 9 if state[i] else compute_stats(buf[a:a + m])
        return stats, c.fps.view(np.int64).tolist()

    def _two_pass(self, x: np.ndarray, mean: np.ndarray, var: np.ndarray, which: np.ndarray) -> None:
        """``var`` of the tensors ``which`` again, in two passes: the mean, then the squared deviations
        (small_stats's arithmetic, segment by segment in element order, so the same bits)."""
        idx = which.nonzero()[0]
        if len(idx) > VECTOR_MIN and len(idx) * VECTOR_SPAN >= x.size:
            d = x.astype(np.float64)
            d -= np.repeat(mean, self.sizes)
            np.multiply(d, d, out=d)
            var[idx] = np.add.reduceat(d, self.starts)[idx] / self.n[idx]
            return
        starts, sizes = self.starts_list, self.sizes
        for i in idx.tolist():
            a, m = starts[i], sizes[i]
            d1 = x[a:a + m].astype(np.float64) - mean[i]
            var[i] = float(np.add.reduceat(d1 * d1, [0])[0]) / m

    def _zero_frac(self, x: np.ndarray, need: np.ndarray) -> np.ndarray:
        """The fraction of zeros of the tensors ``need`` (0.0 elsewhere): one pass over the buffer when
        they are many, else one count per tensor."""
        idx = need.nonzero()[0]
        if len(idx) > VECTOR_MIN:
            # Exact counts from where the zeros are (few, in trained weights and grads), each placed in
            # its tensor by the starts: zc / n is (n - nonzero) / n. One compare over the buffer; a
            # reduceat of the compare casting bools to ints cost 4-10x that in a training loop.
            at = np.searchsorted(self.starts, np.flatnonzero(x == 0), side="right") - 1
            frac = np.bincount(at, minlength=self.k) / self.n
            frac[~need] = 0.0
            return frac
        out = np.zeros(self.k)
        starts, sizes = self.starts_list, self.sizes
        for i in idx.tolist():
            a, m = starts[i], sizes[i]
            out[i] = (m - int(_count_nonzero(x[a:a + m]))) / m
        return out


def packed_rows(kinds: Sequence[str], buf: torch.Tensor, sizes: Sequence[int]) -> tuple[list[StatsTuple], list[int]]:
    """(stats, fingerprints) of the tensors packed end to end in ``buf`` (one fp dtype; ``sizes``
    elements each, at most ``CHUNK``), ``kinds`` their kinds.

    Four passes over the whole buffer give every tensor's min, max, sum and sum of squares
    (segmented reductions: a tensor's results depend on its own elements only, so its row is
    the same in any batch); its fingerprint is xxh3 of its bytes. Tensors up to ``SMALL``
    elements get every stat, as :func:`compute_stats` gives them (the same operations in the
    same order, column by column: IEEE results are the same bits); larger ones min, max and norm
    (mean and std not measured, as the chunked path). A tensor with a NaN or Inf gets
    :func:`compute_stats` of its bytes in ``buf``; a ``state`` tensor only its numel.
    """
    return Segments(kinds, sizes, buf.element_size()).rows(buf)


_HEAD = attrgetter("kind", "name", "param", "key")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_TENSOR = attrgetter("tensor")
_ATTRS = attrgetter("__class__", "dtype", "shape", "layout", "is_cpu")


def layout_key(entries: Sequence[Entry]) -> tuple[list[tuple], list[tuple]]:
    """What a :class:`Plan` depends on, per entry: its kind, name, param and key, its tensor's
    type, dtype, shape, layout and device (C calls only: this is the per-step price of finding
    the plan)."""
    return list(map(_HEAD, entries)), tensor_attrs(list(map(_TENSOR, entries)))


def tensor_attrs(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """The tensors' part of :func:`layout_key`: each one's type, dtype, shape, layout and device."""
    return list(map(_ATTRS, tensors))


# Copies described together (describe_all) go in passes over blocks of at most this many bytes
# and MANY_COPIES copies: a pass over a buffer past the L2 cache costs more a copy (Segments.columns
# alone on a 2 MiB-L2 EPYC core, PPO-sized copies of 153 KiB: 41-45 us a copy in passes over
# 0.6-2.4 MiB, 49 us over 4.8 MiB, 74 us over 9.6 MiB; copies of 15 KiB: 12 us a copy from 32 of
# them on, 16 us for 4: past 64 copies a pass's fixed cost is nothing to save).
MANY_BYTES = 2 << 20
MANY_COPIES = 64


class Block(NamedTuple):
    """Consecutive copies described in one pass: the first one's index and how many."""

    first: int
    copies: int


def copies_per_block(copy_bytes: int) -> int:
    """How many copies of ``copy_bytes`` bytes fit in ``MANY_BYTES`` (at least one, at most
    ``MANY_COPIES``): the block size of :func:`blocks`."""
    return max(1, min(MANY_COPIES, MANY_BYTES // max(1, copy_bytes)))


def blocks(m: int, per_block: int) -> list[Block]:
    """The passes describing ``m`` consecutive copies: blocks of ``per_block`` while they fit, then
    one of the rest (m = 8 + 8 + 5). A layout keeps one :class:`Segments` for a block of
    ``per_block`` copies and describes a smaller block by its :meth:`Segments.head`, whatever ``m``
    a commit window holds (a Segments per ``m``, a slice per tensor per copy, was built for most
    windows); a pass's numpy calls are paid once a block, not once a copy."""
    out = [Block(first, per_block) for first in range(0, m - m % per_block, per_block)]
    if m % per_block:
        out.append(Block(m - m % per_block, m % per_block))
    return out


def end_to_end(bufs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``bufs`` end to end (one of them: itself), as a block of copies is described (:func:`blocks`)."""
    return bufs[0] if len(bufs) == 1 else torch.cat(list(bufs))


class _Batch:
    """Entries packed into one buffer: their indices and the columns of their rows."""

    def __init__(self, entries: Sequence[Entry], idx: list[int]) -> None:
        self.idx = idx
        self.take = itemgetter(*idx) if len(idx) > 1 else (lambda es: (es[idx[0]],))
        es = [entries[i] for i in idx]
        ts = [e.tensor for e in es]
        self.kinds = [e.kind for e in es]
        self.names = [e.name for e in es]
        self.params = [e.param for e in es]
        self.keys = [e.key for e in es]
        self.dtypes = [stored_dtype(t) for t in ts]
        self.shapes = [format_shape(t.shape) for t in ts]
        self.segs = Segments(self.kinds, [t.numel() for t in ts], ts[0].element_size())
        self._block: Segments | None = None  # the layout repeated _per_block times (_repeated)
        self._shapes = [t.shape for t in ts]
        # Buffers given back (:meth:`give_back`), each with its views shaped as the batch's tensors.
        # deque's append and pop are atomic: the writer gives back while the training thread takes.
        self._free: deque[tuple[torch.Tensor, list[torch.Tensor]]] = deque()
        self._total = sum(self.segs.sizes)
        self._keep = max(2, POOL_BYTES // max(1, self._total * self.segs.itemsize))
        self._per_block = copies_per_block(self._total * self.segs.itemsize)

    def copy(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The batch's tensors among ``tensors`` (the plan's entries' tensors, in their order), copied
        end to end into a buffer (one given back before, else a new one); the buffer and its views,
        for :meth:`give_back`."""
        ts = list(self.take(tensors))
        if self._free:  # only the thread taking copies pops: not emptied between the test and the pop
            buf, views = self._free.pop()
            _foreach_copy(views, ts)  # as _flatten: each tensor's elements in order, end to end
            return buf, views
        # None given back yet (a layout's first steps, or all held for a commit): new memory.
        buf = _flatten(ts)
        return (buf.clone() if len(ts) == 1 else buf), None  # one tensor: _flatten gives a view of it

    def give_back(self, buf: torch.Tensor, views: list[torch.Tensor] | None) -> None:
        """``buf`` (a :meth:`copy`'s) is described and no longer read: the next copy may reuse it
        (its views shaped as the batch's tensors made here, on the thread giving it back)."""
        if len(self._free) >= self._keep:
            return
        if views is None:
            views = [buf[a:a + m].view(shape) for a, m, shape in
                     zip(self.segs.starts_list, self.segs.sizes, self._shapes, strict=True)]
        self._free.append((buf, views))

    def rows_many(self, bufs: Sequence[torch.Tensor]) -> list[list[LeanRow]]:
        """The rows of copies (:meth:`copy`), one list per copy: a pass per block of them put end to
        end (:func:`blocks`; a tensor's row depends on its own elements only: the same rows)."""
        out: list[list[LeanRow]] = []
        k = self.segs.k
        for block in blocks(len(bufs), self._per_block):
            c = block.copies
            stats, fps = self._repeated(c).rows(end_to_end(bufs[block.first:block.first + c]))
            out.extend(self._rows(stats[j * k:(j + 1) * k], fps[j * k:(j + 1) * k]) for j in range(c))
        return out

    def rows(self, buf: torch.Tensor) -> list[LeanRow]:
        """The rows of the batch's tensors copied into ``buf`` (:meth:`copy`)."""
        return self._rows(*self.segs.rows(buf))

    def columns_many(self, bufs: Sequence[torch.Tensor]) -> list[StatColumns]:
        """:meth:`rows_many` as columns, one :class:`StatColumns` per copy."""
        out: list[StatColumns] = []
        k = self.segs.k
        for block in blocks(len(bufs), self._per_block):
            c = block.copies
            col = self._repeated(c).columns(end_to_end(bufs[block.first:block.first + c]))
            if c == 1:
                out.append(col)
                continue
            out.extend(StatColumns(col.counts[:, j * k:(j + 1) * k], col.floats[:, j * k:(j + 1) * k],
                                   col.fps[j * k:(j + 1) * k]) for j in range(c))
        return out

    def _repeated(self, c: int) -> Segments:
        """The layout repeated ``c`` times (``c`` up to the batch's block size): the head of the one
        Segments of a whole block, made once."""
        if c == 1:
            return self.segs
        if self._block is None:
            p = self._per_block
            self._block = Segments(self.kinds * p, self.segs.sizes * p, self.segs.itemsize)
        return self._block.head(c * self.segs.k)

    def _rows(self, stats: list[StatsTuple], fps: list[int]) -> list[LeanRow]:
        return list(map(tuple.__new__, repeat(LeanRow), zip(self.kinds, self.names, self.params, self.keys,
                                                               self.dtypes, self.shapes, stats, fps,
                                                               repeat(None))))  # fp_kind: xxh3


class Plan:
    """What the layout of a list of entries decides (module docstring): made once per layout."""

    def __init__(self, entries: Sequence[Entry], key: tuple[list[tuple], list[tuple]]) -> None:
        self.key = key
        self.nbytes = sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
        # Only plain, dense CPU tensors; otherwise the per-tensor path (lean.snapshot) does it all.
        self.plain = all(type(t) in _PLAIN and t.layout == torch.strided and t.is_cpu and not t.is_quantized
                         for t in (e.tensor for e in entries))
        self.batches: list[_Batch] = []
        self.rest: list[int] = []  # entries described one by one (larger, or not fp32/fp64)
        if not self.plain:
            return
        # The batches lean.snapshot makes, in its order (batch_key): a batch is closed when it reaches PACK.
        open_: dict[tuple[torch.dtype, bool], list[int]] = {}
        sizes: dict[tuple[torch.dtype, bool], int] = {}
        done: list[list[int]] = []
        for i, e in enumerate(entries):
            t = e.tensor
            if not packable(t):
                self.rest.append(i)
                continue
            bk = batch_key(t)
            open_.setdefault(bk, []).append(i)
            sizes[bk] = sizes.get(bk, 0) + t.numel()
            if sizes[bk] >= PACK:
                done.append(open_[bk])
                open_[bk], sizes[bk] = [], 0
        done.extend(b for b in open_.values() if b)
        self.batches = [_Batch(entries, b) for b in done]

    def rows(self, entries: Sequence[Entry]) -> tuple[list[LeanRow], list[Entry]]:
        """The packed entries' rows now, and the other entries (:meth:`others`: for the per-tensor
        path). ``entries`` must have this plan's key."""
        snap = self.snapshot(entries)
        rows = snap.rows()
        snap.release()
        return rows, self.others(entries)

    def snapshot(self, entries: Sequence[Entry]) -> Snapshot:
        """The packed entries copied now (one copy per batch, the bytes as they are now); their rows
        are described later, on any thread (:meth:`Snapshot.rows`). ``entries``: this plan's key."""
        return self.snapshot_tensors(list(map(_TENSOR, entries)))

    def snapshot_tensors(self, tensors: Sequence[torch.Tensor]) -> Snapshot:
        """:meth:`snapshot` of the entries whose tensors are ``tensors`` (in their order; the caller
        knows their heads are this plan's, and their :func:`tensor_attrs` too)."""
        grad = torch.is_grad_enabled()
        _set_grad_enabled(False)  # torch.no_grad() without its Python context manager (a few calls a step)
        try:
            return Snapshot(self.batches, [b.copy(tensors) for b in self.batches])
        finally:
            _set_grad_enabled(grad)

    def others(self, entries: Sequence[Entry]) -> list[Entry]:
        """The entries not packed, their tensors detached (the per-tensor path's)."""
        return [Entry(e.kind, e.name, e.tensor.detach(), e.full, e.param, e.key)
                for e in (entries[i] for i in self.rest)] if self.rest else []


class Snapshot:
    """A plan's packed tensors, copied: what their rows describe, whatever the tensors become after."""

    __slots__ = ("_batches", "_bufs", "_views")

    def __init__(self, batches: list[_Batch], copies: list[tuple[torch.Tensor, list[torch.Tensor] | None]]) -> None:
        self._batches = batches
        self._bufs = list(map(_FIRST, copies))  # no Python call a step (a comprehension is one)
        self._views = list(map(_SECOND, copies))

    def release(self) -> None:
        """The copies are described and no longer read: their buffers go back to their batches for
        reuse. Nothing may read this snapshot after."""
        batches, bufs, views = self._batches, self._bufs, self._views
        self._batches, self._bufs, self._views = [], [], []
        for b, buf, vs in zip(batches, bufs, views, strict=True):
            b.give_back(buf, vs)

    @property
    def nbytes(self) -> int:
        """The bytes of the copies (what holding this snapshot keeps in memory)."""
        return sum(map(_nbytes, self._bufs))

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The copies, one flat buffer per batch of the plan (its tensors end to end, in order)."""
        return self._bufs

    def rows(self) -> list[LeanRow]:
        """The rows of the copied tensors, in the plan's order (numpy passes: on any thread)."""
        out: list[LeanRow] = []
        for b, buf in zip(self._batches, self._bufs, strict=True):
            out.extend(b.rows(buf))
        return out


# Copies of at most this many bytes are described together (describe_all): for larger ones the
# numpy calls' fixed cost is small beside the pass, and putting them end to end is one more copy.
TOGETHER_BYTES = 256 << 10


def describe_all(snaps: Sequence[Snapshot]) -> list[list[LeanRow]]:
    """Each snapshot's :meth:`Snapshot.rows` (the same rows), the small copies of one batch layout
    described together: put end to end, a pass per block of them (:func:`blocks`). A small model's
    steps held for a group commit (capture/writer.py) pay the passes' numpy calls once per block of
    up to ``MANY_COPIES`` steps, not per step."""
    out: list[list[LeanRow]] = [[] for _ in snaps]
    groups: dict[int, tuple[_Batch, list[tuple[int, torch.Tensor]]]] = {}  # in order of first sight
    for i, snap in enumerate(snaps):
        for b, buf in zip(snap._batches, snap._bufs, strict=True):
            groups.setdefault(id(b), (b, []))[1].append((i, buf))
    for b, items in groups.values():
        small = [(i, buf) for i, buf in items if _nbytes(buf) <= TOGETHER_BYTES]
        if len(small) < 2:  # nothing to put together
            small = []
        alone = [(i, buf) for i, buf in items if not small or _nbytes(buf) > TOGETHER_BYTES]
        for i, buf in alone:
            out[i].extend(b.rows(buf))
        if small:
            for (i, _), rows in zip(small, b.rows_many([buf for _, buf in small]), strict=True):
                out[i].extend(rows)
    return out


class StatBlock(NamedTuple):
    """One batch's rows in one snapshot, as columns: the batch names them (kinds, names, dtypes,
    shapes; the same at every step of its layout), ``columns`` holds their values."""

    batch: _Batch
    columns: StatColumns


def describe_columns(snaps: Sequence[Snapshot]) -> list[list[StatBlock]]:
    """:func:`describe_all` as columns: each snapshot's batches' :class:`StatBlock`, the small copies
    of one batch layout described together, a pass per block (:func:`blocks`)."""
    out: list[list[StatBlock]] = [[] for _ in snaps]
    groups: dict[int, tuple[_Batch, list[tuple[int, torch.Tensor]]]] = {}
    for i, snap in enumerate(snaps):
        for b, buf in zip(snap._batches, snap._bufs, strict=True):
            groups.setdefault(id(b), (b, []))[1].append((i, buf))
    for b, items in groups.values():
        small = [(i, buf) for i, buf in items if _nbytes(buf) <= TOGETHER_BYTES]
        if len(small) < 2:
            small = []
        alone = [(i, buf) for i, buf in items if not small or _nbytes(buf) > TOGETHER_BYTES]
        for i, buf in alone:
            out[i].append(StatBlock(b, b.segs.columns(buf)))
        if small:
            for (i, _), cols in zip(small, b.columns_many([buf for _, buf in small]), strict=True):
                out[i].append(StatBlock(b, cols))
    return out


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


class Plans:
    """The plans of the last few layouts (a lean step alternates between two: with and without
    the optimizer state), each found again by its :func:`layout_key`."""

    def __init__(self, keep: int = 4) -> None:
        self._plans: list[Plan] = []
        self._keep = keep
        self.built = 0  # plans made so far (tests: a new layout makes one, a known one none)

    def get(self, entries: Sequence[Entry]) -> Plan:
        key = layout_key(entries)
        for plan in self._plans:
            if plan.key == key:
                return plan
        plan = Plan(entries, key)
        self.built += 1
        self._plans.insert(0, plan)
        del self._plans[self._keep:]
        return plan
