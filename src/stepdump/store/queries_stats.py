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

#: Bytes of decoded chunks a reader keeps (about 130 bytes a row: ~120,000 rows). Small on purpose:
#: an analysis that reads a window of steps at a time must not come to hold the run (decoding again
#: costs ~0.05 µs a row); one that reads every row reads them in one query.
CACHE_BYTES = 16 << 20
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
        self._cached_bytes = 0
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

    def chunk(self, cid: int, rows: int, checksum: int, columns: Sequence[str] = ALL_STATS) -> StatArrays:
        """Chunk ``cid`` decoded with (at least) the stat ``columns``, its checksum checked (cached;
        a column asked for later is decoded then, with those the cache holds)."""
        key = (cid, checksum)
        got = self._cache.get(key)
        if got is not None and all(c in got.stats for c in columns):
            self._cache.move_to_end(key)
            return got
        if got is not None:
            columns = tuple(dict.fromkeys([*got.stats, *columns]))
            self._cached_bytes -= self._cache.pop(key).nbytes
        what = f"stat chunk {cid} of {self._where}"
        data = self._q(f"SELECT data FROM {STAT_CHUNKS_TABLE} WHERE id = ?", (cid,))  # noqa: S608
        if not data or not isinstance(data[0][0], bytes):
            raise CorruptDataError(f"{what} has no bytes; the catalog is damaged: `stepdump verify` checks the run")
        blob = data[0][0]
        if stat_chunk.checksum(blob) != checksum:
            raise CorruptDataError(f"{what} does not match its checksum: its stats are damaged. `stepdump verify` "
                                   "lists the damage; the run's other records are unaffected")
        arrays = stat_chunk.decode(blob, rows, columns, what)
        self._cache[key] = arrays
        self._cached_bytes += arrays.nbytes
        while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        return arrays

    def windows(self, table_bounds: tuple[Any, Any]) -> list[tuple[int, int]]:
        """Disjoint step ranges, in order, that cover every stat row: each chunk's range (those
        that overlap merged), and the ranges between and around them where ``tensors`` rows lie
        (``table_bounds``: the table's min and max step, None when it is empty). A query per
        range reads a bounded share of a long run."""
        spans: list[list[int]] = []
        if self.present():
            for lo, hi in self._q(f"SELECT first_step, last_step FROM {STAT_CHUNKS_TABLE} "  # noqa: S608
                                  "ORDER BY first_step", ()):
                if not (isinstance(lo, int) and isinstance(hi, int)) or hi < lo:
                    raise CorruptDataError(f"{self._where}: a stat_chunks row has the step range ({lo!r}, {hi!r}); "
                                           "the catalog is damaged: `stepdump verify` checks the run")
                if spans and lo <= spans[-1][1]:  # overlapping (not just adjacent): one window
                    spans[-1][1] = max(spans[-1][1], hi)
                else:
                    spans.append([lo, hi])
        out: list[tuple[int, int]] = []
        t_lo, t_hi = table_bounds
        at = t_lo if isinstance(t_lo, int) and (not spans or t_lo < spans[0][0]) else None
        for lo, hi in spans:
            if at is not None and at < lo:
                out.append((at, lo - 1))
            out.append((lo, hi))
            at = hi + 1
        if isinstance(t_hi, int) and (not spans or t_hi > spans[-1][1]):
            out.append((spans[-1][1] + 1 if spans else t_lo, t_hi))  # type: ignore[arg-type]
        return out

    def chunk_rows(self, series: np.ndarray | None, steps: StepSelect,
                   columns: Sequence[str] = ALL_STATS) -> list[StatArrays]:
        """The chunk rows of ``series`` (None: every series) at ``steps``, with (at least) stat
        ``columns``, chunk by chunk in commit order."""
        if steps.none:
            return []
        out = []
        for cid, n, checksum in self.chunks_between(steps.lo, steps.hi):
            a = self.chunk(cid, n, checksum, columns)
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
    st, se = rows.step, rows.series
    if np.all((st[1:] > st[:-1]) | ((st[1:] == st[:-1]) & (se[1:] > se[:-1]))):
        return rows  # in order already, each (series, step) once (a chunk as the writer wrote it): as it is
    # priority: 0 for the table, then later chunks before earlier ones
    prio = np.concatenate([np.full(len(p), 0 if i == 0 else len(parts) - i, np.int64) for i, p in enumerate(parts)])
    rows = rows.take(np.lexsort((prio, rows.series, rows.step)))
    # one row per (series, step), whatever the sources (a damaged chunk may repeat one): the first
    keep = np.ones(len(rows), bool)
    keep[1:] = (rows.step[1:] != rows.step[:-1]) | (rows.series[1:] != rows.series[:-1])
    return rows if keep.all() else rows.take(keep)


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


class Buckets:
    """``CatalogReader.stat_buckets`` over a kind's rows given a window of steps at a time, in step
    order (:meth:`add`), so that memory holds one window and the partial aggregates (tensors x
    buckets), never the run.

    ``floor``: buckets by floor division (the key walk's ranges) rather than SQLite's truncating
    integer division (the one-query path); they differ only below ``first``. ``change``: each
    row's ``|norm - previous norm| / previous norm``, the previous norm being the series' row
    before it (carried across windows), NULL where that is NULL or 0 (SQLite's x / 0)."""

    _PARTS = ("series", "bucket", "lo", "hi", "rows", "norm", "min", "max", "mean_sum", "mean_n", "std_sum", "std_n",
              "change", "bad")

    def __init__(self, first: int, width: int, *, change: bool, floor: bool) -> None:
        self.first, self.width, self.change, self.floor = first, width, change, floor
        self._last: dict[int, float] = {}  # series -> its last row's norm (NaN: NULL)
        self._parts: list[dict[str, np.ndarray]] = []

    def add(self, rows: StatArrays) -> None:
        """One window's rows (every row of the kind at those steps; windows in step order)."""
        if not len(rows):
            return
        r = rows.take(np.lexsort((rows.step, rows.series)))
        d = r.step - self.first
        w = self.width
        b = d // w if self.floor else np.where(d >= 0, d // w, -((-d) // w))
        norm = r.stats["norm"]
        starts_s = np.flatnonzero(np.r_[True, r.series[1:] != r.series[:-1]])
        with np.errstate(all="ignore"):
            if self.change:
                prev = np.empty(len(r))
                prev[1:] = norm[:-1]
                prev[starts_s] = [self._last.get(int(x), np.nan) for x in r.series[starts_s].tolist()]
                ratio = np.abs(norm - prev) / prev
                ratio[prev == 0] = np.nan  # SQLite: x / 0 is NULL
            else:
                ratio = np.full(len(r), np.nan)
        ends_s = np.r_[starts_s[1:], len(r)] - 1
        self._last.update(zip(r.series[ends_s].tolist(), norm[ends_s].tolist(), strict=True))
        starts = np.flatnonzero(np.r_[True, (r.series[1:] != r.series[:-1]) | (b[1:] != b[:-1])])
        ends = np.r_[starts[1:], len(r)]

        def summed(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            ok = ~np.isnan(v)
            return np.add.reduceat(np.where(ok, v, 0.0), starts), np.add.reduceat(ok.astype(np.int64), starts)

        mean_sum, mean_n = summed(r.stats["mean"])
        std_sum, std_n = summed(r.stats["std"])
        self._parts.append({
            "series": r.series[starts], "bucket": b[starts], "lo": r.step[starts], "hi": r.step[ends - 1],
            "rows": ends - starts, "norm": np.fmax.reduceat(norm, starts),
            "min": np.fmin.reduceat(r.stats["min"], starts), "max": np.fmax.reduceat(r.stats["max"], starts),
            "mean_sum": mean_sum, "mean_n": mean_n, "std_sum": std_sum, "std_n": std_n,
            "change": np.fmax.reduceat(ratio, starts), "bad": np.add.reduceat(nonfinite(r).astype(np.int64), starts)})

    def rows(self) -> list[tuple[Any, ...]]:
        """``(series id, bucket, first step, last step, rows, max(norm), min(min), max(max),
        avg(mean), avg(std), change, steps with any NaN/±Inf element)`` per tensor and bucket."""
        if not self._parts:
            return []
        p = {k: np.concatenate([x[k] for x in self._parts]) for k in self._PARTS}
        order = np.lexsort((p["lo"], p["bucket"], p["series"]))
        p = {k: v[order] for k, v in p.items()}
        g = np.flatnonzero(np.r_[True, (p["series"][1:] != p["series"][:-1]) | (p["bucket"][1:] != p["bucket"][:-1])])
        ends = np.r_[g[1:], len(order)]

        def avg(total: str, n: str) -> np.ndarray:
            s, c = np.add.reduceat(p[total], g), np.add.reduceat(p[n], g)
            with np.errstate(all="ignore"):
                return np.where(c > 0, s / np.maximum(c, 1), np.nan)

        cols = [p["series"][g].tolist(), p["bucket"][g].tolist(), p["lo"][g].tolist(), p["hi"][ends - 1].tolist(),
                np.add.reduceat(p["rows"], g).tolist(), _nan_none(np.fmax.reduceat(p["norm"], g)),
                _nan_none(np.fmin.reduceat(p["min"], g)), _nan_none(np.fmax.reduceat(p["max"], g)),
                _nan_none(avg("mean_sum", "mean_n")), _nan_none(avg("std_sum", "std_n")),
                _nan_none(np.fmax.reduceat(p["change"], g)) if self.change else [None] * len(g),
                np.add.reduceat(p["bad"], g).tolist()]
        return list(zip(*cols, strict=True))


__all__ = ["ALL_STATS", "STAT_COLUMNS", "Buckets", "StatSource", "StepSelect", "merged", "table_arrays"]
