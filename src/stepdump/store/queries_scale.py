"""Read-side aggregates for long runs: what the report and the checks ask the catalog to reduce.

A 100k-step run logs millions of scalar rows and (with 500 tensors) fifty million stats rows;
reading them into Python to draw a thousand pixels or to find one spike is the cost these
queries remove. Each returns at most a bounded number of rows (per name, per bucket, per step
window). They sit beside :class:`~stepdump.store.queries.CatalogReader` (SQL lives only in the
store layer) and run through its connection.

Non-finite scalars: SQLite stores a NaN REAL as NULL; ±Inf are stored as such (``9e999`` is
SQLite's literal for Inf), so "finite" is ``value IS NOT NULL AND abs(value) != 9e999``.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from stepdump.errors import ConfigError
from stepdump.store.queries import CatalogReader
from stepdump.store.records import as_records
from stepdump.store.schema import catalog_path

_FINITE = "(value IS NOT NULL AND abs(value) != 9e999)"


class ScalarSummary(NamedTuple):
    """One logged scalar's rows, aggregated (:func:`scalar_summary`); NULL counts where SQLite has no row."""

    name: Any
    rows: Any
    nonfinite: Any  # rows logged NaN or ±Inf
    finite: Any
    min: Any  # of the finite values
    max: Any
    nonpositive: Any  # finite rows <= 0


def scalar_summary(cat: CatalogReader) -> list[ScalarSummary]:
    """Per logged scalar name, its :class:`ScalarSummary`, in one pass over the scalars table."""
    return as_records(ScalarSummary, cat._q(
        f"SELECT name, count(*), sum(NOT {_FINITE}), sum({_FINITE}), min(CASE WHEN {_FINITE} THEN value END), "
        f"max(CASE WHEN {_FINITE} THEN value END), sum({_FINITE} AND value <= 0) FROM scalars GROUP BY name"))


def scalar_median_rows(cat: CatalogReader) -> list[tuple[Any, Any]]:
    """``(name, value)`` of the middle finite value(s) of every scalar: one row for an odd count,
    the two middle ones for an even count (numpy's median is their mean)."""
    return cat._q(
        "SELECT name, value FROM (SELECT name, value, row_number() OVER (PARTITION BY name ORDER BY value) AS rn, "
        f"count(*) OVER (PARTITION BY name) AS c FROM scalars WHERE {_FINITE}) "
        "WHERE rn = (c + 1) / 2 OR rn = c / 2 + 1 ORDER BY name, rn")


def scalar_rows_of(cat: CatalogReader, name: str) -> list[tuple[Any, Any]]:
    """``(step, value)`` of one scalar, by step (value NULL for a logged NaN)."""
    return cat._q("SELECT step, value FROM scalars WHERE name = ? ORDER BY step", (name,))


def scalar_ends(cat: CatalogReader, name: str) -> list[Any]:
    """The value of scalar ``name`` at its first and at its last logged step ([] when never logged)."""
    rows = cat._q("SELECT 0, value FROM (SELECT value FROM scalars WHERE name = ? ORDER BY step LIMIT 1) "
                  "UNION ALL SELECT 1, value FROM (SELECT value FROM scalars WHERE name = ? ORDER BY step DESC "
                  "LIMIT 1)", (name, name))
    return [v for _, v in sorted(rows, key=lambda r: r[0])]


def scalar_nonfinite_steps(cat: CatalogReader, name: str, limit: int) -> list[Any]:
    """The first ``limit`` steps at which ``name`` was logged NaN or ±Inf, in order."""
    return cat._ints(f"SELECT step FROM scalars WHERE name = ? AND NOT {_FINITE} ORDER BY step LIMIT ?",
                     (name, int(limit)))


def scalar_same_at(cat: CatalogReader, a: str, b: str, shift: int) -> tuple[int, int]:
    """How ``b`` compares with ``a`` read ``shift`` steps later: ``(rows of b considered, rows that
    differ)``. A row of ``b`` at step s differs when ``a`` has no row at s + shift or a different
    value there (NULL, a logged NaN, equals NULL). For ``shift`` > 0 only rows of ``b`` whose
    s + shift is at most ``a``'s last step are considered (the last of a shifted copy has no partner)."""
    row = cat._q(
        "SELECT count(*), coalesce(sum(x.step IS NULL OR x.value IS NOT y.value), 0) FROM scalars y "
        "LEFT JOIN scalars x ON x.name = ? AND x.step = y.step + ? "
        "WHERE y.name = ? AND (? = 0 OR y.step + ? <= (SELECT max(step) FROM scalars WHERE name = ?))",
        (a, int(shift), b, int(shift), int(shift), a))[0]
    return int(row[0]), int(row[1])


def scalar_minmax_buckets(cat: CatalogReader, name: str, rows: int, buckets: int,
                          later: Sequence[int] = (), earlier: Sequence[int] = ()) -> list[tuple[Any, Any, Any]]:
    """``(index, step, value)`` of the points :func:`~stepdump.analysis.downsample.minmax_downsample`
    keeps of scalar ``name``, chosen inside SQLite.

    The ``rows`` points (by step, index i from 0) are cut into ``buckets`` buckets, bucket
    ``((i + 1) * buckets - 1) // rows`` (the exact integer edges), moved one bucket on for the indices in
    ``later`` and one back for those in ``earlier`` (where the caller's float edges round otherwise).
    Per bucket: the first finite minimum, the first finite maximum, and the first non-finite point.
    """
    return cat._q(
        "WITH r AS (SELECT step, value, row_number() OVER (ORDER BY step) - 1 AS i FROM scalars WHERE name = ?), "
        "k AS (SELECT i, step, value, ((i + 1) * ? - 1) / ? + (i IN (SELECT value FROM json_each(?))) "
        f"- (i IN (SELECT value FROM json_each(?))) AS b, {_FINITE} AS fin FROM r), "
        "z AS (SELECT i, step, value, fin, "
        "row_number() OVER (PARTITION BY b, fin ORDER BY value, i) AS lo, "
        "row_number() OVER (PARTITION BY b, fin ORDER BY value DESC, i) AS hi, "
        "row_number() OVER (PARTITION BY b, fin ORDER BY i) AS nth FROM k) "
        "SELECT i, step, value FROM z WHERE (fin AND (lo = 1 OR hi = 1)) OR (NOT fin AND nth = 1) ORDER BY i",
        (name, int(buckets), int(rows), json.dumps([int(i) for i in later]),
         json.dumps([int(i) for i in earlier])))


# -- two runs: the relative difference of their tensor norms, per tensor and step bucket -------
_OTHER = "other_run"


@contextmanager
def attached(cat: CatalogReader, other: CatalogReader) -> Iterator[str]:
    """``other``'s catalog attached read-only to ``cat``'s connection, as the schema name yielded.

    Both catalogs were opened (and their schemas checked) by their own readers; attaching the
    second lets one query join the two runs' rows without handing them to Python."""
    if cat.has_stat_chunks or other.has_stat_chunks:
        # the join below reads the tensors tables only: rows in stat chunks would be missed
        raise ConfigError(f"{cat.path} or {other.path} keeps stats in stat chunks, which SQLite cannot join; "
                          "their norms are compared from arrays instead")
    path = catalog_path(other.path)
    cat._q(f"ATTACH DATABASE ? AS {_OTHER}", ("file:" + urllib.parse.quote(os.fsencode(path.absolute())) + "?mode=ro",))
    try:
        yield _OTHER
    finally:
        cat._q(f"DETACH DATABASE {_OTHER}")


_COMMON = (
    "WITH sa AS (SELECT DISTINCT step FROM main.tensors WHERE series IN "
    "(SELECT id FROM main.series WHERE kind = ?1)), "
    f"sb AS (SELECT DISTINCT step FROM {_OTHER}.tensors WHERE series IN "
    f"(SELECT id FROM {_OTHER}.series WHERE kind = ?1)), "
    "cs AS (SELECT step, row_number() OVER (ORDER BY step) - 1 AS i FROM sa WHERE step IN sb)"
)
_BUCKETED = (
    ", cb AS (SELECT step, ((i + 1) * ?2 - 1) / ?3 + (i IN (SELECT value FROM json_each(?4))) "
    "- (i IN (SELECT value FROM json_each(?5))) AS b FROM cs)"
)


def common_step_count(cat: CatalogReader, kind: str) -> int:
    """Steps at which both runs (``cat`` and the attached one) have ``kind`` rows."""
    return int(cat._q(f"{_COMMON} SELECT count(*) FROM cs", (kind,))[0][0])


def norm_diff_buckets(cat: CatalogReader, kind: str, common: int, buckets: int, later: Sequence[int] = (),
                      earlier: Sequence[int] = ()) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Per ``kind`` tensor of both runs and bucket of their common steps, the largest
    ``|‖A‖ − ‖B‖| / max(|‖A‖|, |‖B‖|)`` (0 where both norms are 0, NULL where either is missing).

    The ``common`` steps (by step, index i) are cut into ``buckets`` as in
    :func:`scalar_minmax_buckets`. Returns ``(rows (name, bucket, value), ranges (bucket, first
    step, last step))``: tensors x buckets rows, never tensors x steps."""
    args = (kind, int(buckets), int(common), json.dumps([int(i) for i in later]),
            json.dumps([int(i) for i in earlier]))
    rows = cat._q(
        f"{_COMMON}{_BUCKETED} SELECT na.name, cb.b, max(CASE WHEN max(abs(ta.norm), abs(tb.norm)) > 0 "
        "THEN abs(ta.norm - tb.norm) / max(abs(ta.norm), abs(tb.norm)) WHEN ta.norm = tb.norm THEN 0.0 END) "
        f"FROM main.series na JOIN {_OTHER}.series nb ON nb.kind = ?1 AND nb.name = na.name "
        "CROSS JOIN cb JOIN main.tensors ta ON ta.series = na.id AND ta.step = cb.step "
        f"JOIN {_OTHER}.tensors tb ON tb.series = nb.id AND tb.step = cb.step "
        "WHERE na.kind = ?1 GROUP BY na.id, cb.b", args)
    ranges = cat._q(f"{_COMMON}{_BUCKETED} SELECT b, min(step), max(step) FROM cb GROUP BY b ORDER BY b", args)
    return rows, ranges


# -- check: a kind's tensors in the order they first appear -----------------------------------
def series_first_steps(cat: CatalogReader, kind: str) -> list[tuple[Any, Any, Any]]:
    """``(series id, name, first step with a row)`` of every ``kind`` series that has rows, in the
    order a stats frame (by step, then series) first shows them. One key seek per series."""
    if cat.has_stat_chunks:
        names = dict(cat._q("SELECT id, name FROM series WHERE kind = ?", (kind,)))
        first: dict[int, int] = {}
        for a in cat.stat_windows(kind, columns=()):  # in step order: a series' first window has its first step
            series, at = np.unique(a.series, return_index=True)  # a's rows are by step, then series
            for sid, i in zip(series.tolist(), at.tolist(), strict=True):
                first.setdefault(sid, int(a.step[i]))
            if len(first) == len(names):
                break
        return sorted(((sid, names.get(sid), f) for sid, f in first.items()), key=lambda r: (r[2], r[0]))
    return cat._q(
        "SELECT id, name, f FROM (SELECT s.id AS id, s.name AS name, "
        "(SELECT min(t.step) FROM tensors t WHERE t.series = s.id) AS f FROM series s "
        "WHERE s.kind != 'state' AND s.kind = ?) WHERE f IS NOT NULL ORDER BY f, id", (kind,))
