"""Reading stat rows as arrays: the catalog's tensor rows and its stat chunks, merged.

A store keeps a tensor's stats in one of two places (FORMAT.md "Stat chunks"): a ``tensors`` row
(every row with bytes, and every row of a store written before chunks) or a row of a stat chunk
(a stats-only row). :class:`StatSource` gives the rows of both as one :class:`StatArrays`, with
the same selection a SQL query over ``tensors`` would make (series, steps), so each query of
:class:`~stepdump.store.queries.CatalogReader` is written once over arrays.

Should a (series, step) have rows in both places (a damaged or hand-made store: the writer puts
each row in one), the ``tensors`` row wins, then the chunk committed last: what ``INSERT OR
REPLACE`` into ``tensors`` made of the same rows before chunks.

Decoded chunks are kept per reader (checksum-keyed, a bounded number of rows) so that the many
queries of one report decode each chunk once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stepdump.errors import CorruptDataError
from stepdump.store import stat_chunk
from stepdump.store.stat_chunk import COUNT_STATS, FLOAT_STATS, StatArrays
from stepdump.store.schema import STAT_CHUNKS_TABLE, STAT_COLUMNS
from stepdump.store.step_range import as_step, clamped

#: Decoded chunk rows a reader keeps (about 140 bytes a row: ~140 MB).
CACHE_ROWS = 1_000_000
ALL_STATS = COUNT_STATS + FLOAT_STATS

Query = Callable[[str, Sequence[Any]], list[Any]]


class StepSelect:
    """A ``steps=`` selection (queries.StepRange) as bounds for the chunk index and a mask."""

    def __init__(self, steps: Any) -> None:
        self.lo: int | None = None
        self.hi: int | None = None
        self.stride: int = 1
        self.values: np.ndarray | None = None
        self.none = False
        if steps is None:
            return
        if not isinstance(steps, (slice, range)) and hasattr(steps, "__index__"):
            self.lo = self.hi = as_step(steps)
            return
        if isinstance(steps, slice):
            steps = range(steps.start if steps.start is not None else 0,
                          steps.stop if steps.stop is not None else 2**62, steps.step or 1)
        if isinstance(steps, range):
            if steps.step < 0:
                if not steps:
                    self.none = True
                    return
                steps = range(steps[-1], steps.start + 1, -steps.step)
            steps = clamped(steps)
            if not steps:
                self.none = True
                return
            self.lo, self.hi, self.stride = steps.start, steps.stop - 1, steps.step
            return
        lst = sorted({as_step(s) for s in steps})
        if not lst:
            self.none = True
            return
        self.lo, self.hi = lst[0], lst[-1]
        self.values = np.asarray(lst, dtype=np.int64)

    def mask(self, step: np.ndarray) -> np.ndarray | None:
        """Which of ``step`` are selected (None: all)."""
        if self.none:
            return np.zeros(len(step), bool)
        if self.lo is None:
            return None
        m = (step >= self.lo) & (step <= self.hi)  # type: ignore[operator]
        if self.stride != 1:
            m &= (step - self.lo) % self.stride == 0
        if self.values is not None:
            m &= np.isin(step, self.values)
        return m


class StatSource:
    """The stat rows of one catalog, tensors table and chunks merged (module docstring)."""

    def __init__(self, query: Query, where: str) -> None:
        self._q = query
        self._where = where  # names the catalog in errors
        self._cache: OrderedDict[tuple[int, int], StatArrays] = OrderedDict()
        self._cached_rows = 0
        self._present: bool | None = None

    def present(self) -> bool:
        """Whether the catalog has any stat chunk. Asked again until it has one: a live run's
        reader sees its first chunk commit (chunks never go away once there)."""
        if not self._present:
            has = self._q("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (STAT_CHUNKS_TABLE,))
            self._present = bool(has) and bool(self._q(f"SELECT 1 FROM {STAT_CHUNKS_TABLE} LIMIT 1", ()))  # noqa: S608
        return bool(self._present)

    def chunks_between(self, lo: int | None, hi: int | None) -> list[tuple[int, int, int]]:
        """(id, rows, checksum) of the chunks that may hold rows at steps ``lo..hi`` (None: open)."""
        if not self.present():
            return []
        lo_v = -(2**63) if lo is None else lo
        hi_v = 2**63 - 1 if hi is None else hi
        rows = self._q(f"SELECT id, rows, checksum FROM {STAT_CHUNKS_TABLE} WHERE last_step >= ? "  # noqa: S608
                       "AND first_step <= ? ORDER BY id", (lo_v, hi_v))
        out = []
        for cid, n, checksum in rows:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (cid, n, checksum)):
                raise CorruptDataError(f"{self._where}: a stat_chunks row holds ({cid!r}, {n!r}, {checksum!r}); "
                                       "the catalog is damaged: `stepdump verify` checks the run")
            out.append((cid, n, checksum))
        return out

    def chunk(self, cid: int, rows: int, checksum: int) -> StatArrays:
        """Chunk ``cid`` decoded with every stat column, its checksum checked (cached)."""
        key = (cid, checksum)
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            return got
        what = f"stat chunk {cid} of {self._where}"
        data = self._q(f"SELECT data FROM {STAT_CHUNKS_TABLE} WHERE id = ?", (cid,))  # noqa: S608
        if not data or not isinstance(data[0][0], bytes):
            raise CorruptDataError(f"{what} has no bytes; the catalog is damaged: `stepdump verify` checks the run")
        blob = data[0][0]
        if stat_chunk.checksum(blob) != checksum:
            raise CorruptDataError(f"{what} does not match its checksum: its stats are damaged. `stepdump verify` "
                                   "lists the damage; the run's other records are unaffected")
        arrays = stat_chunk.decode(blob, rows, ALL_STATS, what)
        self._cache[key] = arrays
        self._cached_rows += len(arrays)
        while self._cached_rows > CACHE_ROWS and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_rows -= len(old)
        return arrays

    def chunk_rows(self, series: np.ndarray | None, steps: StepSelect) -> list[StatArrays]:
        """The chunk rows of ``series`` (None: every series) at ``steps``, chunk by chunk in commit order."""
        if steps.none:
            return []
        out = []
        for cid, n, checksum in self.chunks_between(steps.lo, steps.hi):
            a = self.chunk(cid, n, checksum)
            m = steps.mask(a.step)
            if series is not None:
                s = np.isin(a.series, series)
                m = s if m is None else m & s
            out.append(a if m is None else a.take(m))
        return out


def table_arrays(rows: list[Any], columns: Sequence[str]) -> StatArrays:
    """Rows ``(series, step, blob, dtype, shape, *columns, fingerprint)`` from ``tensors`` as arrays."""
    if not rows:
        return stat_chunk.empty(columns)
    cols = list(zip(*rows, strict=True))
    try:
        stats = {}
        for i, c in enumerate(columns):
            v = cols[5 + i]
            stats[c] = _counts(v) if c in COUNT_STATS else np.asarray(v, dtype=np.float64)
        blob = np.asarray([-1 if b is None else b for b in cols[2]], dtype=np.int64)
        return StatArrays(np.asarray(cols[0], dtype=np.int64), np.asarray(cols[1], dtype=np.int64),
                          np.asarray(cols[-1], dtype=np.int64), blob, np.asarray(cols[3], dtype=object),
                          np.asarray(cols[4], dtype=object), stats)
    except (TypeError, ValueError, OverflowError) as e:
        raise CorruptDataError(f"a tensor row of the catalog holds a value of the wrong type ({e}); the catalog "
                               "is damaged: `stepdump verify` checks the run") from None


def _counts(values: Sequence[Any]) -> np.ndarray:
    """A count column of ``tensors`` rows as int64 (-1 for NULL); a value that is no count (negative,
    fractional, past 2**62, text) is damage."""
    with np.errstate(invalid="ignore"):
        f = np.asarray(values, dtype=np.float64)
        ok = np.isnan(f) | ((f >= 0) & (f < 2.0**62) & (f == np.floor(f)))
    if not ok.all():
        raise ValueError(f"a count of {f[~ok][0]!r}")
    return np.where(np.isnan(f), -1, f).astype(np.int64)


def merged(table: StatArrays, chunks: list[StatArrays], columns: Sequence[str]) -> StatArrays:
    """``table`` rows and ``chunks`` rows as one, by step then series, one row per (series, step):
    the table's row first, then the chunk committed last (module docstring)."""
    if not chunks:
        parts = [table]
    else:
        parts = [table, *(c if set(c.stats) == set(columns) else
                          StatArrays(c.series, c.step, c.fingerprint, c.blob, c.dtype, c.shape,
                                     {k: c.stats[k] for k in columns}) for c in chunks)]
    rows = StatArrays.concat(parts, columns)
    if not len(rows):
        return rows
    # priority: 0 for the table, then later chunks before earlier ones
    prio = np.concatenate([np.full(len(p), 0 if i == 0 else len(parts) - i, np.int64) for i, p in enumerate(parts)])
    order = np.lexsort((prio, rows.series, rows.step))
    rows = rows.take(order)
    if len(parts) > 1:
        keep = np.ones(len(rows), bool)
        keep[1:] = (rows.step[1:] != rows.step[:-1]) | (rows.series[1:] != rows.series[:-1])
        if not keep.all():
            rows = rows.take(keep)
    return rows


def py_rows(rows: StatArrays, columns: Sequence[str]) -> list[list[Any]]:
    """Each stat column of ``rows`` as Python values, NULL as None."""
    return stat_chunk.row_values(rows, columns)


def stored_flags(rows: StatArrays) -> list[int]:
    """1 where a row's bytes are in a blob, else 0 (SQLite's ``blob IS NOT NULL``)."""
    return (rows.blob >= 0).astype(np.int64).tolist()


def blob_values(rows: StatArrays) -> list[Any]:
    """Each row's blob id, None where it has no bytes."""
    return [None if b < 0 else b for b in rows.blob.tolist()]


def nonfinite(rows: StatArrays) -> np.ndarray:
    """Rows with any NaN, +Inf or -Inf element (a NULL count is 0)."""
    return (np.maximum(rows.stats["nan"], 0) + np.maximum(rows.stats["posinf"], 0)
            + np.maximum(rows.stats["neginf"], 0)) > 0


def _nan_none(v: np.ndarray) -> list[Any]:
    return [None if x != x else x for x in v.tolist()]


def buckets(rows: StatArrays, first: int, width: int, *, change: bool, floor: bool) -> list[tuple[Any, ...]]:
    """The rows of ``CatalogReader.stat_buckets`` over ``rows`` (one kind's, by step then series).

    ``floor``: buckets by floor division (the key walk's ranges) rather than SQLite's truncating
    integer division (the one-query path); they differ only below ``first``."""
    if not len(rows):
        return []
    order = np.lexsort((rows.step, rows.series))
    r = rows.take(order)
    d = r.step - first
    b = d // width if floor else np.where(d >= 0, d // width, -((-d) // width))
    norm = r.stats["norm"]
    with np.errstate(all="ignore"):
        if change:
            prev = np.full(len(r), np.nan)
            same = r.series[1:] == r.series[:-1]
            prev[1:] = np.where(same, norm[:-1], np.nan)
            ratio = np.abs(norm - prev) / prev
            ratio[prev == 0] = np.nan  # SQLite: x / 0 is NULL
        else:
            ratio = np.full(len(r), np.nan)
    # groups: (series, bucket), rows in order within a series
    starts = np.flatnonzero(np.r_[True, (r.series[1:] != r.series[:-1]) | (b[1:] != b[:-1])])
    ends = np.r_[starts[1:], len(r)]

    def fmax(v: np.ndarray) -> np.ndarray:
        return np.fmax.reduceat(v, starts)

    def fmin(v: np.ndarray) -> np.ndarray:
        return np.fmin.reduceat(v, starts)

    def avg(v: np.ndarray) -> np.ndarray:
        ok = ~np.isnan(v)
        n = np.add.reduceat(ok.astype(np.int64), starts)
        s = np.add.reduceat(np.where(ok, v, 0.0), starts)
        with np.errstate(all="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1), np.nan)

    bad = np.add.reduceat(nonfinite(r).astype(np.int64), starts)
    cols = [r.series[starts].tolist(), b[starts].tolist(), r.step[starts].tolist(), r.step[ends - 1].tolist(),
            (ends - starts).tolist(), _nan_none(fmax(norm)), _nan_none(fmin(r.stats["min"])),
            _nan_none(fmax(r.stats["max"])), _nan_none(avg(r.stats["mean"])), _nan_none(avg(r.stats["std"])),
            _nan_none(fmax(ratio)) if change else [None] * len(starts), bad.tolist()]
    return list(zip(*cols, strict=True))


__all__ = ["ALL_STATS", "STAT_COLUMNS", "StatSource", "StepSelect", "buckets", "merged", "table_arrays"]
