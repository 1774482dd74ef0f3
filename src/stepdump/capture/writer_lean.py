"""The writer's stats-only rows: lean rows into catalog rows, and held steps' copies described.

Its own idea beside the writer (capture/writer.py): rows that carry stats and a fingerprint but
no bytes. :class:`LeanRows` is a collaborator the writer holds; every call is given the catalog
(whose series ids the rows name) and the list the rows go to, and it keeps only what is its own:
the series ids of the last device pack's heads, and which tensors it has warned about.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from stepdump.capture.device_pack import DevicePack, catalog_rows
import numpy as np

from stepdump.capture.packed import LeanRow, RowHead, Snapshot, _Batch, describe_all, describe_columns
from stepdump.core.device_lean import DEVICE_FP_KIND, HOST_FP_KIND
from stepdump.store.catalog import CatalogWriter
from stepdump.store.stat_chunk import ColumnBlock

log = logging.getLogger("stepdump.capture.writer")


class _DeviceSeries(NamedTuple):
    """The series ids of one device pack's heads, valid while heads, catalog and generation match."""

    heads: list[RowHead]
    catalog: CatalogWriter
    generation: int  # the catalog's series_generation when the ids were looked up
    sids: list[int]
    keep: list[bool] | None  # which rows are kept (a series of another kind is left out); None: all


class LeanRows:
    """The catalog rows of a step's lean rows (stats and fingerprint only, no blob) (module docstring)."""

    def __init__(self) -> None:
        self._kind_warned: set[tuple[str, str]] = set()  # lean rows of another kind than their series'
        self._device_series: _DeviceSeries | None = None  # of the last device pack
        # id(batch) -> (batch, catalog, series generation, series ids) of described copies' batches
        self._batch_sids: dict[int, tuple[_Batch, CatalogWriter, int, np.ndarray]] = {}

    def describe(self, cat: CatalogWriter, held: Sequence[tuple[int, Snapshot]], out: list[tuple[Any, ...]],
                 blocks: list[ColumnBlock]) -> None:
        """The rows of held steps' copies (``(step, StepMessage.packed)``, described in one pass per
        layout): as column blocks appended to ``blocks`` (packed.describe_columns: no tuple per row),
        or, in a store with series of another fingerprint kind than xxh3 (each row's kind is then
        checked), as rows appended to ``out`` (packed.describe_all)."""
        if not held:
            return
        try:
            self._describe(cat, held, out, blocks)
        finally:  # described (or failed): the copies' buffers are reused by the next steps' copies
            for _, snap in held:
                snap.release()

    def _describe(self, cat: CatalogWriter, held: Sequence[tuple[int, Snapshot]], out: list[tuple[Any, ...]],
                  blocks: list[ColumnBlock]) -> None:
        if cat.any_fp_kind:
            for (step, _), lean in zip(held, describe_all([snap for _, snap in held]), strict=True):
                self.rows(cat, step, lean, True, out)
            return
        for (step, _), described in zip(held, describe_columns([snap for _, snap in held]), strict=True):
            for block in described:
                b, c = block.batch, block.columns
                blocks.append(ColumnBlock(self._batch_series(cat, b), step, b.dtypes, b.shapes, c.counts, c.floats,
                                          c.fps))

    def _batch_series(self, cat: CatalogWriter, batch: _Batch) -> np.ndarray:
        """The series ids of a batch's tensors (xxh3 series: a packed copy's rows are xxh3), looked up
        once per batch and catalog, again when the catalog's ids may have changed."""
        key = id(batch)
        got = self._batch_sids.get(key)
        if got is not None and got[0] is batch and got[1] is cat and got[2] == cat.series_generation:
            return got[3]
        sids = np.asarray([cat.series_id(k, n, p, q, None) for k, n, p, q in
                           zip(batch.kinds, batch.names, batch.params, batch.keys, strict=True)], dtype=np.int64)
        if len(self._batch_sids) >= 16:
            self._batch_sids.clear()
        self._batch_sids[key] = (batch, cat, cat.series_generation, sids)
        return sids

    def rows(self, cat: CatalogWriter, step: int | None, lean: list[LeanRow], check: bool,
             out: list[tuple[Any, ...]]) -> None:
        """The catalog rows of ``lean`` (stats and fingerprint only) at ``step``, appended to ``out``;
        ``check``: whether the store has series of a kind other than xxh3 (then each row's kind is
        checked against its series')."""
        for r in lean:
            sid = cat.series_id(r.kind, r.name, r.param, r.key, r.fp_kind)
            if (check or r.fp_kind is not None) and cat.fp_kind(sid) != (r.fp_kind or HOST_FP_KIND):
                self._other_kind(cat.fp_kind(sid), r)
                continue
            out.append((sid, step, r.dtype, r.shape, None, *r.stats, r.fp))

    def device_rows(self, cat: CatalogWriter, step: int | None, pack: DevicePack, out: list[tuple[Any, ...]]) -> None:
        """The catalog rows of a lean CUDA step's device pack, appended to ``out``: the rows
        :meth:`rows` makes of ``device_pack.rows(pack)``. The series ids (and whether each
        series is dmix64) are looked up once per heads list (a steady run sends the same list
        each step: device_pack.HeadsCache) and catalog, again when its ids may have changed."""
        c = self._device_series
        if c is None or c.heads is not pack.heads or c.catalog is not cat or c.generation != cat.series_generation:
            sids: list[int] = []
            keep: list[bool] = []
            for head in pack.heads:
                sid = cat.series_id(head.kind, head.name, head.param, head.key, DEVICE_FP_KIND)
                have = cat.fp_kind(sid)
                if have != DEVICE_FP_KIND:
                    self._other_kind(have, LeanRow(*head, (), 0, DEVICE_FP_KIND))  # type: ignore[arg-type]
                sids.append(sid)
                keep.append(have == DEVICE_FP_KIND)
            c = self._device_series = _DeviceSeries(pack.heads, cat, cat.series_generation, sids,
                                                    None if all(keep) else keep)
        out.extend(catalog_rows(pack, step, c.sids, c.keep))

    def _other_kind(self, have: str, r: LeanRow) -> None:
        """A lean row whose fingerprint is not of its series' kind (a tensor that moved between the
        CPU and a GPU under fingerprint="auto"): no bytes to fingerprint again, so the row is left
        out (a row of the wrong kind would be a wrong answer); said once per tensor."""
        if (r.kind, r.name) not in self._kind_warned:
            self._kind_warned.add((r.kind, r.name))
            log.warning("stepdump: %s %r has %s fingerprints in this run, and a stats-only step gave it a %s one "
                        "(it moved between the CPU and a GPU?); its stats-only rows are left out from here. Record "
                        "with fingerprint='xxh3' or fingerprint='dmix64' to give every tensor one kind",
                        r.kind, r.name, have, r.fp_kind or HOST_FP_KIND)
