"""A step's small staged tensors described together on the writer thread.

A gradient log stores every grad at every step; on a small model most of them are biases and
norm weights of a few hundred elements. Describing each on its own
(:func:`stepdump.core.stats.compute_stats` and a fingerprint) would take a dozen calls per tensor,
each numpy or torch call a chance to hand the GIL to the training thread and back. Here the small
float tensors a step staged are packed into one buffer (one C call) and described by
:func:`stepdump.capture.packed.packed_rows`: a few passes over the whole buffer, the same stats
bit for bit as ``compute_stats`` gives each (tests/test_lean_packed.py, and
tests/test_gradlog_handoffs.py on the writer's rows), and the same fingerprint (xxh3 of each
tensor's bytes). Larger tensors keep ``compute_stats``: its torch path (fp32 sums) is what every
other record of them holds.

A small gradient-log step whose items were copied out of their slot (staging.Copied) goes further:
its rows are made in bulk from what its layout decides once (:class:`CopiedLayout`), and described
when its commit comes, with the other held steps of its layout (:func:`describe_copied`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import Any, NamedTuple

import numpy as np
import torch
from xxhash import xxh3_64_intdigest

from stepdump.capture.packed import FUSED_DTYPES, SMALL, Segments, blocks, copies_per_block, end_to_end, packed_rows
from stepdump.capture.staging import CopyPlan, Item
from stepdump.core.dtypes import stored_dtype
from stepdump.core.stats import StatsTuple, compute_stats, stats_from_reads
from stepdump.store.catalog import CatalogWriter
from stepdump.store.format import format_shape

_flatten = torch._C._nn.flatten_dense_tensors  # one C call: each tensor viewed flat, concatenated
# Fewer small tensors than this in a step: described one by one (packing buys nothing).
_MIN_PACKED = 2


def small_rows(items: Sequence[Item], no_stats: frozenset[str]) -> dict[int, tuple[StatsTuple, int]]:
    """``{index: (stats, fingerprint)}`` for the staged small fp32/fp64 CPU tensors of ``items``
    (kinds in ``no_stats`` left out: they get a fingerprint only); the others are not in it."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, item in enumerate(items):
        t = item.tensor
        # Staged copies only (``raw``: the slot's buffer, contiguous): a live tensor is read once, by the writer.
        if item.raw is None or item.live or item.device_stats is not None or item.kind in no_stats:
            continue
        if _packable(t):
            by_dtype.setdefault(t.dtype, []).append(i)
    out: dict[int, tuple[StatsTuple, int]] = {}
    for idx in by_dtype.values():
        if len(idx) < _MIN_PACKED:
            continue
        ts = [items[i].tensor for i in idx]
        with torch.no_grad():
            buf = _flatten(ts)
        stats, fps = packed_rows([items[i].kind for i in idx], buf, [t.numel() for t in ts])
        out.update(zip(idx, zip(stats, fps, strict=True), strict=True))
    return out


# --- A copied gradient-log step's rows, in bulk ---------------------------------------------------
#
# A small gradient-log step reaches the writer as a staging.Copied: its staged items copied end to
# end, one buffer per dtype, in a layout (the copy plan) that stays the same step after step. What
# the layout decides (series, dtype and shape texts, where each tensor's bytes lie, which tensors
# are described packed) is worked out once (:class:`CopiedLayout`); a step appends its bytes in a
# few slices (the writer) and is described when its commit comes, together with the other held
# steps of its layout (:func:`describe_copied`): the small tensors of all of them in one packed
# pass, the larger ones by compute_stats each. The rows are those the per-item path gives
# (Writer._item_row with small_rows' stats), bit for bit (tests/test_gradlog_bulk_rows.py).


class Run(NamedTuple):
    """Bytes of consecutive items lying end to end in one group buffer: one append."""

    group: int
    start: int  # byte offset in the group's buffer
    stop: int


class CopiedLayout:
    """What a copy plan's layout decides for its rows (block comment above), made once per plan.

    ``no_stats``: kinds that get a fingerprint only (the writer's); ``bulk``: whether the writer
    may take its steps this way (every item stored in full, none of a kind in ``per_item``,
    each smaller than ``max_bytes``); otherwise the per-item path does them."""

    def __init__(self, plan: CopyPlan, no_stats: frozenset[str], per_item: frozenset[str], max_bytes: int) -> None:
        items = plan.templates
        ts = [i.tensor for i in items]
        self.k = len(items)
        self.kinds = [i.kind for i in items]
        self.heads = [(i.kind, i.name, i.param, i.key) for i in items]
        self.dtypes = [stored_dtype(t) for t in ts]
        self.shapes = [format_shape(t.shape) for t in ts]
        self.numels = [t.numel() for t in ts]
        self.nbytes = [t.numel() * t.element_size() for t in ts]
        self.offsets = list(accumulate(self.nbytes[:-1], initial=0))  # of each item's bytes in the step's appends
        self.total = sum(self.nbytes)
        self.bulk = all(i.full and i.kind not in per_item for i in items) and all(b < max_bytes for b in self.nbytes)
        self.no_stats = [k in no_stats for k in self.kinds]
        # Where each item lies: its group (a dtype's buffer), its first element and first byte there.
        self.where: list[tuple[int, int, int]] = [(0, 0, 0)] * self.k
        for g, (idx, _) in enumerate(plan.groups):
            at = 0
            for n in idx:
                self.where[n] = (g, at, at * ts[n].element_size())
                at += self.numels[n]
        runs: list[Run] = []
        for n, (g, _, b) in enumerate(self.where):
            if runs and runs[-1].group == g and runs[-1].stop == b:
                runs[-1] = runs[-1]._replace(stop=b + self.nbytes[n])
            else:
                runs.append(Run(g, b, b + self.nbytes[n]))
        self.runs = runs
        # Per group (one dtype): the small fp32/fp64 tensors described packed (small_rows' choice, in
        # its order) and the element positions that gather them; the rest described one by one.
        self.packed: list[tuple[list[int], torch.Tensor | None]] = []  # (packed items, their elements' places)
        self.alone: list[int] = []
        self.itemsizes: list[int] = []
        for idx, _ in plan.groups:
            pick = [n for n in idx if not self.no_stats[n] and _packable(ts[n])]
            if len(pick) < _MIN_PACKED:
                pick = []
            # (None when the group holds the packed tensors only: its buffers are taken whole)
            gather = torch.cat([torch.arange(self.where[n][1], self.where[n][1] + self.numels[n]) for n in pick]) \
                if pick and pick != idx else None
            self.packed.append((pick, gather))
            chosen = set(pick)
            self.alone.extend(n for n in idx if n not in chosen and not self.no_stats[n])
            self.itemsizes.append(ts[idx[0]].element_size())
        self.group_sizes = [[self.numels[n] for n in idx] for idx, _ in plan.groups]  # to split a group's buffer
        self.place = [0] * self.k  # each item's place in its group
        for idx, _ in plan.groups:
            for i, n in enumerate(idx):
                self.place[n] = i
        # Per group: the steps described in one pass (packed.blocks), from its packed tensors' bytes a step.
        self.per_block = [copies_per_block(sum(self.numels[n] for n in pick) * size)
                          for (pick, _), size in zip(self.packed, self.itemsizes, strict=True)]
        self._segments: dict[int, Segments] = {}  # group -> its packed tensors, repeated per_block[g] times
        self._series: tuple[CatalogWriter, int, list[int]] | None = None  # (catalog, series generation, ids)

    def series(self, cat: CatalogWriter) -> list[int]:
        """The items' series ids (xxh3 series), looked up in item order (as the per-item path creates
        new ones) once per catalog, again when its ids may have changed (a rollback)."""
        got = self._series
        if got is not None and got[0] is cat and got[1] == cat.series_generation:
            return got[2]
        sids = [cat.series_id(k, n, p, q, None) for k, n, p, q in self.heads]
        self._series = (cat, cat.series_generation, sids)
        return sids

    def segments(self, g: int, steps: int) -> Segments:
        """Group ``g``'s packed tensors of ``steps`` steps (up to ``per_block[g]``: a block of
        packed.blocks), end to end, as :class:`Segments`: the head of the one made for a whole block."""
        seg = self._segments.get(g)
        if seg is None:
            pick, p = self.packed[g][0], self.per_block[g]
            seg = self._segments[g] = Segments([self.kinds[n] for n in pick] * p, [self.numels[n] for n in pick] * p,
                                               self.itemsizes[g])
        return seg.head(steps * len(self.packed[g][0]))

    @staticmethod
    def raws(bufs: Sequence[torch.Tensor]) -> list[memoryview]:
        """The bytes of a step's group buffers (staging.Copied.buffers: flat, contiguous, on the CPU),
        as core.hashing.raw_bytes gives them, in three C calls each."""
        return [memoryview(b.view(torch.uint8).numpy()) for b in bufs]  # type: ignore[arg-type]  # (a buffer)


def layout_key(plan: CopyPlan) -> tuple[Any, ...]:
    """What a :class:`CopiedLayout` of ``plan`` depends on: the items' heads, ``full``, dtypes and
    shapes, and the dtype groups (two plans with the same key have the same layout)."""
    return (tuple((i.kind, i.name, i.param, i.key, i.full, i.tensor.dtype, tuple(i.tensor.shape), i.tensor.is_cpu)
                  for i in plan.templates),
            tuple(tuple(idx) for idx, _ in plan.groups))


def large_stats(xs: Sequence[torch.Tensor]) -> list[StatsTuple]:
    """:func:`compute_stats` of each of ``xs`` (1-d, contiguous CPU tensors): the same stats, bit
    for bit. Those of more than ``SMALL`` fp32/fp64 elements take its torch path with the same
    reads (aminmax, sum, dot: fp32 sums for fp32, what every other record of them holds), their
    results read back together (one stack and one tolist per dtype, not one per tensor) and made
    stats by its own :func:`~stepdump.core.stats.stats_from_reads`; the others go through it whole."""
    out: list[StatsTuple | None] = [None] * len(xs)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        if x.dtype in FUSED_DTYPES and x.numel() > SMALL:
            by_dtype.setdefault(x.dtype, []).append(i)
        else:
            out[i] = compute_stats(x)
    for idx in by_dtype.values():
        reads: list[torch.Tensor] = []
        for i in idx:
            x = xs[i]
            mn, mx = torch.aminmax(x)
            reads += (mn, mx, x.sum(), torch.dot(x, x))
        got = torch.stack(reads).tolist()
        for j, i in enumerate(idx):
            out[i] = stats_from_reads(xs[i], *got[4 * j:4 * j + 4])
    return out  # type: ignore[return-value]  # every index is set


def _packable(t: torch.Tensor) -> bool:
    return t.dtype in FUSED_DTYPES and 0 < t.numel() <= SMALL and t.layout == torch.strided and t.is_cpu


class CopiedStep(NamedTuple):
    """A copied gradient-log step whose bytes are appended and whose rows wait for its commit."""

    step: int | None
    layout: CopiedLayout
    bufs: list[torch.Tensor]  # the step's copies, one per group (staging.Copied.buffers)
    raws: list[memoryview]  # their bytes
    series: list[int]  # the items' series ids, looked up when the step was written
    first_blob: int  # the items' blob ids are first_blob, first_blob + 1, ... in item order
    segment: int  # the catalog id of the segment its bytes went to
    offset: int  # where its first item's bytes begin in that segment
    codec: str  # the blobs' codec name (raw: the stored bytes are the raw bytes)


class CopiedRows(NamedTuple):
    """:func:`describe_copied`'s rows, as the writer holds them."""

    tensors: list[tuple[Any, ...]]
    blobs: list[tuple[Any, ...]]


def describe_copied(held: Sequence[CopiedStep]) -> CopiedRows:
    """The tensor and blob rows of held copied steps: per layout, the packed tensors of its steps in
    a pass per block of them (packed.blocks; a tensor's stats depend on its own elements only: the
    rows step by step), the others by :func:`compute_stats` each."""
    out = CopiedRows([], [])
    by_layout: dict[int, list[CopiedStep]] = {}
    for s in held:
        by_layout.setdefault(id(s.layout), []).append(s)
    for steps in by_layout.values():
        _describe_layout(steps, out)
    return out


def _describe_layout(steps: list[CopiedStep], out: CopiedRows) -> None:
    layout = steps[0].layout
    count = len(steps)
    stats: list[list[Any]] = [[None] * layout.k for _ in steps]
    with torch.no_grad():
        for g, (pick, gather) in enumerate(layout.packed):
            if not pick:
                continue
            p = len(pick)
            for block in blocks(count, layout.per_block[g]):
                part = steps[block.first:block.first + block.copies]
                if gather is None:  # every tensor of the group: its buffers end to end
                    bufs = [s.bufs[g] for s in part]
                else:  # only the packed tensors' elements of each step (not the larger ones') are copied
                    bufs = [s.bufs[g].index_select(0, gather) for s in part]
                got, _ = layout.segments(g, block.copies).rows(end_to_end(bufs))
                for j, row in enumerate(stats[block.first:block.first + block.copies]):
                    for n, st in zip(pick, got[j * p:(j + 1) * p], strict=True):
                        row[n] = st
        if layout.alone:
            for j, s in enumerate(steps):
                views = [b.split_with_sizes(sizes) for b, sizes in zip(s.bufs, layout.group_sizes, strict=True)]
                xs = [views[layout.where[n][0]][layout.place[n]] for n in layout.alone]
                for n, st in zip(layout.alone, large_stats(xs), strict=True):
                    stats[j][n] = st
    for n, bare in enumerate(layout.no_stats):
        if bare:
            for row in stats:
                row[n] = (layout.numels[n],) + (None,) * 9
    dtypes, shapes, nbytes, offsets, where = layout.dtypes, layout.shapes, layout.nbytes, layout.offsets, layout.where
    for s, row in zip(steps, stats, strict=True):
        spans = [s.raws[g][b:b + m] for (g, _, b), m in zip(where, nbytes, strict=True)]
        # xxh3 of each item's bytes, signed (core.hashing.fingerprint_bytes), in one C loop.
        fps = np.fromiter(map(xxh3_64_intdigest, spans), dtype=np.uint64, count=len(spans)).view(np.int64).tolist()
        blobs = range(s.first_blob, s.first_blob + layout.k)
        out.tensors.extend([(sid, s.step, d, sh, b, *st, fp) for sid, d, sh, b, st, fp in
                            zip(s.series, dtypes, shapes, blobs, row, fps, strict=True)])
        # (id, segment, offset, length, codec, raw length, checksum, base): the raw codec stores the
        # raw bytes, so the checksum (xxh3 of the stored bytes) is the fingerprint.
        out.blobs.extend(zip(blobs, repeat(s.segment), [s.offset + o for o in offsets], nbytes, repeat(s.codec),
                             nbytes, fps, repeat(None)))
