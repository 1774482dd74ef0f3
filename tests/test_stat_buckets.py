"""CatalogReader.stat_buckets walks each bucket's key range instead of sorting every row (issue 26 item 5).

The report of a long run reads each kind's per-tensor stats bucketed in SQLite. One query grouping
by ``(series, (step - first) / width)`` made SQLite sort every row of the kind before aggregating
(it cannot tell that the bucket rises with the step): most of build_report_data's time on a
100,000-step run. stat_buckets now asks per bucket, grouping by series over a key range, which
SQLite aggregates as it walks. Checked here: the same rows as the single sorted query (kept below
as the reference) for every width and both ``change`` modes, on a run where one tensor misses steps
(the previous-row lookup of the norm change), and no sorting step in the plain query's plan.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

import stepdump
from stepdump.store.queries import WALK_WIDTH
from stepdump.store.schema import catalog_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synth_run import synth_run, to_chunks  # noqa: E402


def _close(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> bool:
    """Equal rows, each average equal to SQLite's up to its summation order (numpy sums a bucket
    in another order than SQLite's avg(): the last bits of a mean of 1000 values may differ);
    every other value, counts and extremes, exactly."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            if i in (8, 9) and a is not None and b is not None:
                if abs(a - b) > 1e-12 * max(1.0, abs(b)):
                    return False
            elif a != b:
                return False
    return True

TENSORS, STEPS = 8, 300
GAPS = (5, 6, 7, 49, 50, 51, 52, 120, 299)  # steps the third tensor's params and grads miss


def _reference(con: sqlite3.Connection, kind: str, first: int, width: int, change: bool) -> list[tuple[Any, ...]]:
    """The single query stat_buckets ran before: one GROUP BY (series, bucket) over a lag() window."""
    prev = "lag(t.norm) OVER (PARTITION BY t.series ORDER BY t.step)" if change else "NULL"
    return con.execute(
        "SELECT series, b, min(step), max(step), count(*), max(norm), min(mn), max(mx), avg(mean), avg(std), "
        "max(abs(norm - prev) / prev), sum(bad) FROM (SELECT t.series AS series, t.step AS step, "
        "(t.step - ?) / ? AS b, t.norm AS norm, t.min AS mn, t.max AS mx, t.mean AS mean, t.std AS std, "
        "(coalesce(t.nan, 0) + coalesce(t.posinf, 0) + coalesce(t.neginf, 0) > 0) AS bad, "
        f"{prev} AS prev FROM tensors t WHERE t.series IN "
        "(SELECT s.id FROM series s WHERE s.kind != 'state' AND s.kind = ?)) GROUP BY series, b",
        (first, width, kind)).fetchall()


@pytest.fixture(scope="module")
def gappy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run with its stats as ``tensors`` rows (the layout before stat chunks): what the
    reference query reads."""
    path = synth_run(tmp_path_factory.mktemp("buckets") / "run", TENSORS, STEPS, spike=77, nan_step=151, chunks=False)
    con = sqlite3.connect(catalog_path(path))
    try:
        ids = [i for (i,) in con.execute("SELECT id FROM series WHERE name = 'h_0_mlp_w'")]
        assert len(ids) == 2  # its params and grads
        con.executemany("DELETE FROM tensors WHERE series = ? AND step = ?", [(i, s) for i in ids for s in GAPS])
        con.commit()
    finally:
        con.close()
    return path


@pytest.fixture(scope="module")
def chunked(gappy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same rows in stat chunks, as a recording stores them (read by arrays, not SQL)."""
    path = tmp_path_factory.mktemp("buckets-chunked") / "run"
    shutil.copytree(gappy, path)
    to_chunks(path, window=37)  # windows that do not line up with the buckets
    return path


@pytest.mark.parametrize("change", [False, True], ids=["plain", "change"])
@pytest.mark.parametrize("kind", ["params", "grads"])
@pytest.mark.parametrize("width", [1, 7, 16, 50, 1000])
def test_same_rows_as_the_single_sorted_query(gappy: Path, chunked: Path, kind: str, width: int, change: bool) -> None:
    con = sqlite3.connect(f"file:{catalog_path(gappy)}?mode=ro", uri=True)
    try:
        want = sorted(_reference(con, kind, 0, width, change))
    finally:
        con.close()
    with stepdump.open(gappy) as run:
        got = sorted(tuple(r) for r in run.catalog.stat_buckets(kind, 0, width, change=change))
    assert got == want
    with stepdump.open(chunked) as run:
        assert run.catalog.has_stat_chunks
        from_arrays = sorted(tuple(r) for r in run.catalog.stat_buckets(kind, 0, width, change=change))
    assert _close(from_arrays, want)
    assert len({r[0] for r in got}) == TENSORS and len({r[1] for r in got}) == -(-(STEPS + (kind == "params")) // width)
    if change and width == 1:  # a bucket per step: the change after a gap is against the row before the gap
        assert any(r[10] is not None for r in got if r[2] == 53)


def test_plain_query_walks_the_key_without_sorting(gappy: Path) -> None:
    """EXPLAIN QUERY PLAN of the per-bucket query: a key range search, no temp B-tree."""
    with stepdump.open(gappy) as run:
        cat = run.catalog
        seen: list[str] = []
        real = cat._q

        def spy(sql: str, args: Any = ()) -> list[Any]:
            if "GROUP BY" in sql and not seen:
                seen.extend(str(r[-1]) for r in real("EXPLAIN QUERY PLAN " + sql, args))
            return real(sql, args)

        cat._q = spy  # type: ignore[method-assign]
        cat.stat_buckets("grads", 0, WALK_WIDTH)
    assert seen and not any("TEMP B-TREE" in s for s in seen), seen
    assert any("PRIMARY KEY (series=? AND step>? AND step<?)" in s for s in seen), seen
