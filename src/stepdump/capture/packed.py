"""Small tensors described together: one copy per dtype, a few vectorised passes, a plan per layout.

A small model's stats-only step reads dozens of tensors of a few thousand elements each; what
it cost was Python per tensor (a dozen calls each to name, check, copy and describe it), not
the bytes. Here (issue 25):

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

The rows are those :func:`stepdump.capture.lean.lean_rows` gives by its per-tensor path, in
the same order (tests/test_lean_packed.py compares them bitwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from stepdump.core.dtypes import stored_dtype
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
_PLAIN = (torch.Tensor, torch.nn.Parameter)
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


def packable(t: torch.Tensor) -> bool:
    """Whether ``t`` (a storable tensor) is described in a packed batch."""
    return t.dtype in FUSED_DTYPES and 0 < t.numel() <= CHUNK and t.layout == torch.strided and t.device.type == "cpu"


def packed_rows(kinds: Sequence[str], buf: torch.Tensor, sizes: Sequence[int],
                starts: Sequence[int] | None = None,
                spans: Sequence[slice] | None = None,
                state: np.ndarray | None = None) -> tuple[list[StatsTuple], list[int]]:
    """(stats, fingerprints) of the tensors packed end to end in ``buf`` (one fp dtype; ``sizes``
    elements each, at most ``CHUNK``; ``starts``: their offsets, ``spans``: their byte ranges,
    ``state``: which kinds are ``state``, derived when not given), ``kinds`` their kinds.

    Four passes over the whole buffer give every tensor's min, max, sum and sum of squares
    (segmented reductions: a tensor's results depend on its own elements only, so its row is
    the same in any batch); its fingerprint is xxh3 of its bytes. Tensors up to ``SMALL``
    elements get every stat, as :func:`compute_stats` gives them (the same operations in the
    same order, column by column: IEEE results are the same bits); larger ones min, max and norm
    (mean and std not measured, as the chunked path). A tensor with a NaN or Inf gets
    :func:`compute_stats` of its bytes in ``buf``; a ``state`` tensor only its numel.
    """
    k = len(sizes)
    if starts is None:
        starts = list(accumulate(sizes[:-1], initial=0))
    if spans is None:
        isz = buf.element_size()
        spans = [slice(a * isz, (a + n) * isz) for a, n in zip(starts, sizes, strict=True)]
    x = buf.numpy()
    raw = memoryview(buf.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    fps = np.fromiter(map(xxhash.xxh3_64_intdigest, map(raw.__getitem__, spans)), dtype=np.uint64, count=k)
    n = np.asarray(sizes, dtype=np.float64)
    with np.errstate(all="ignore"):  # inf and NaN: compute_stats below
        lo = np.minimum.reduceat(x, starts)
        hi = np.maximum.reduceat(x, starts)
        sums, sqs = segment_sums_array(x, starts)
        lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
        finite3 = np.isfinite(lo64) & np.isfinite(hi64) & np.isfinite(sqs)  # what a large tensor's row needs
        finite = finite3 & np.isfinite(sums)
        signed = (lo64 > 0) | (hi64 < 0)  # of one sign: no zeros
        small = n <= SMALL
        mean = sums / n
        var = sqs / n - mean * mean
        if state is None:
            state = np.array([kd == "state" for kd in kinds], dtype=bool)
        full = small & finite & ~state
        # Cancellation regime (|mean| > 10 std, e.g. LayerNorm weights): two passes, in float64 (small_stats).
        for i in (full & (var < 1e-2 * mean * mean)).nonzero()[0].tolist():
            a, m = starts[i], sizes[i]
            d = x[a:a + m].astype(np.float64) - mean[i]
            var[i] = float(np.add.reduceat(d * d, [0])[0]) / m
        zero_frac = np.zeros(k)
        for i in (full & ~signed).nonzero()[0].tolist():  # counting zeros: only where there may be some
            a, m = starts[i], sizes[i]
            zero_frac[i] = (m - int(_count_nonzero(x[a:a + m]))) / m
        std = np.sqrt(np.maximum(var, 0.0))
        norm = np.sqrt(sqs)
    large = ~small
    mean_o, std_o, zero_o = mean.astype(object), std.astype(object), zero_frac.astype(object)
    mean_o[large] = std_o[large] = None
    zero_o[large & ~signed] = None
    zeros = [0] * k
    stats: list[Any] = list(zip(list(sizes), zeros, zeros, zeros, lo.tolist(), hi.tolist(), mean_o.tolist(),
                                std_o.tolist(), norm.tolist(), zero_o.tolist()))
    for i in (state | ~np.where(small, finite, finite3)).nonzero()[0].tolist():  # rare: one by one
        a, m = starts[i], sizes[i]
        stats[i] = (m,) + (None,) * 9 if state[i] else compute_stats(buf[a:a + m])
    return stats, fps.view(np.int64).tolist()


def layout_key(entries: Sequence[tuple]) -> list[tuple]:
    """What a :class:`Plan` depends on, per entry ``(kind, name, tensor, full, param, key)``."""
    return [(e[0], e[1], e[4], e[5], type(e[2]), e[2].dtype, e[2].shape, e[2].layout, e[2].is_cpu) for e in entries]


class _Batch:
    """Entries packed into one buffer: their indices and the columns of their rows."""

    def __init__(self, entries: Sequence[tuple], idx: list[int]) -> None:
        self.idx = idx
        es = [entries[i] for i in idx]
        ts = [e[2] for e in es]
        self.kinds = [e[0] for e in es]
        self.names = [e[1] for e in es]
        self.params = [e[4] for e in es]
        self.keys = [e[5] for e in es]
        self.dtypes = [stored_dtype(t) for t in ts]
        self.shapes = [format_shape(t.shape) for t in ts]
        self.sizes = [t.numel() for t in ts]
        self.starts = list(accumulate(self.sizes[:-1], initial=0))
        isz = ts[0].element_size()
        self.spans = [slice(a * isz, (a + m) * isz) for a, m in zip(self.starts, self.sizes, strict=True)]
        self.state = np.array([k == "state" for k in self.kinds], dtype=bool)

    def rows(self, entries: Sequence[tuple]) -> list[LeanRow]:
        ts = [entries[i][2] for i in self.idx]
        buf = _flatten(ts)
        if len(ts) == 1:
            buf = buf.clone()  # one tensor: _flatten gives a view of it, not a copy
        stats, fps = packed_rows(self.kinds, buf, self.sizes, self.starts, self.spans, self.state)
        return list(map(tuple.__new__, repeat(LeanRow), zip(self.kinds, self.names, self.params, self.keys,
                                                               self.dtypes, self.shapes, stats, fps)))


class Plan:
    """What the layout of a list of entries decides (module docstring): made once per layout."""

    def __init__(self, entries: Sequence[tuple], key: list[tuple]) -> None:
        self.key = key
        self.nbytes = sum(e[2].numel() * e[2].element_size() for e in entries)
        # Only plain, dense CPU tensors; otherwise the per-tensor path (lean.snapshot) does it all.
        self.plain = all(type(t) in _PLAIN and t.layout == torch.strided and t.is_cpu and not t.is_quantized
                         for t in (e[2] for e in entries))
        self.batches: list[_Batch] = []
        self.rest: list[int] = []  # entries described one by one (larger, or not fp32/fp64)
        if not self.plain:
            return
        # The batches lean.snapshot makes, in its order: a dtype's batch is closed when it reaches PACK.
        open_: dict[torch.dtype, list[int]] = {}
        sizes: dict[torch.dtype, int] = {}
        done: list[list[int]] = []
        for i, e in enumerate(entries):
            t = e[2]
            if not packable(t):
                self.rest.append(i)
                continue
            open_.setdefault(t.dtype, []).append(i)
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
            if sizes[t.dtype] >= PACK:
                done.append(open_[t.dtype])
                open_[t.dtype], sizes[t.dtype] = [], 0
        done.extend(b for b in open_.values() if b)
        self.batches = [_Batch(entries, b) for b in done]

    def rows(self, entries: Sequence[tuple]) -> tuple[list[LeanRow], list[tuple]]:
        """The packed entries' rows now, and the other entries as ``(kind, name, tensor, param, key)``
        (for the per-tensor path). ``entries`` must have this plan's key."""
        out: list[LeanRow] = []
        with torch.no_grad():
            for b in self.batches:
                out.extend(b.rows(entries))
        rest = [(e[0], e[1], e[2].detach(), e[4], e[5]) for e in (entries[i] for i in self.rest)]
        return out, rest


class Plans:
    """The plans of the last few layouts (a lean step alternates between two: with and without
    the optimizer state), each found again by its :func:`layout_key`."""

    def __init__(self, keep: int = 4) -> None:
        self._plans: list[Plan] = []
        self._keep = keep
        self.built = 0  # plans made so far (tests: a new layout makes one, a known one none)

    def get(self, entries: Sequence[tuple]) -> Plan:
        key = layout_key(entries)
        for plan in self._plans:
            if plan.key == key:
                return plan
        plan = Plan(entries, key)
        self.built += 1
        self._plans.insert(0, plan)
        del self._plans[self._keep:]
        return plan
