"""benchmarks/synth_run.py writes what a stats-only recording writes (issue 26 item 5).

The report's scale benchmark measures a 100,000-step run that synth_run generates inside SQLite
instead of recording; a measurement of that store says something about real runs only if its rows
are a recording's rows. Compared here against a run recorded for real with the same NaN planted:
the same tables, columns and schema text, the same series (kinds, names), and per column the same
SQLite storage class at every step (the NULL pattern: a lean step has no blob and no state; a NaN
tensor keeps its finite stats and counts the NaN; a logged NaN loss is NULL).
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

import stepdump
from stepdump.store.schema import TABLES, catalog_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synth_run import record_template, synth_run, tensor_names  # noqa: E402
from helpers import _chunk_rows_as_tensors  # noqa: E402

TENSORS, STEPS, NAN, SPIKE = 7, 30, 17, 11


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("synth")
    synth_run(d / "synth", TENSORS, STEPS, spike=SPIKE, nan_step=NAN)
    record_template(d / "real", TENSORS, STEPS, nan_step=NAN)
    return d / "synth", d / "real"


def _q(run: Path, sql: str) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"file:{catalog_path(run)}?mode=ro", uri=True)
    try:
        if "tensors" in sql:  # the stat chunks' rows too, as tensors rows (helpers.catalog_sql)
            _chunk_rows_as_tensors(con)
        return con.execute(sql).fetchall()
    finally:
        con.close()


# typeof() of every column of each table, per (step, kind, name) or (step, name): the NULL pattern
_TYPES = {
    "tensors": "SELECT t.step, s.kind, s.name, " + ", ".join(
        f"typeof(t.{c})" for c in ("series", "step", "dtype", "shape", "blob", "numel", "nan", "posinf", "neginf",
                                   "min", "max", "mean", "std", "norm", "zero_frac", "fingerprint"))
    + " FROM tensors t JOIN series s ON s.id = t.series ORDER BY t.step, s.kind, s.name",
    "steps": "SELECT step, typeof(level), typeof(skipped), typeof(time), typeof(state), level, skipped FROM steps ORDER BY step",
    "scalars": "SELECT step, name, typeof(value) FROM scalars ORDER BY step, name",
    "series": "SELECT kind, name, typeof(param), typeof(key) FROM series ORDER BY kind, name",
    "blobs": "SELECT typeof(id), typeof(segment), typeof(base), codec FROM blobs ORDER BY id",
    "segments": "SELECT count(*) FROM segments",
    "meta": "SELECT key FROM meta ORDER BY key",
}


@pytest.mark.parametrize("table", sorted(_TYPES))
def test_every_table_has_a_recordings_rows_columns_and_null_pattern(pair: tuple[Path, Path], table: str) -> None:
    synth, real = pair
    assert table in TABLES
    assert _q(synth, _TYPES[table]) == _q(real, _TYPES[table])


def test_same_schema_text_and_journal_mode(pair: tuple[Path, Path]) -> None:
    synth, real = pair
    sql = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name"
    assert _q(synth, sql) == _q(real, sql)
    assert _q(synth, "PRAGMA journal_mode") == _q(real, "PRAGMA journal_mode")
    assert _q(synth, "PRAGMA integrity_check") == [("ok",)]


def test_the_planted_nan_reads_as_a_recorded_one(pair: tuple[Path, Path]) -> None:
    synth, real = pair
    with stepdump.open(synth) as s, stepdump.open(real) as r:
        for run in (s, r):
            stats = run.stats(kind="grads", steps=NAN)
            assert [n for n, v in zip(stats["name"], stats["nan"]) if v] == [tensor_names(TENSORS)[1]]
            assert stats[["min", "max", "mean", "std", "norm"]].notna().all().all()  # the finite elements' stats
            loss = run.scalars()["loss"]  # the final record logs none: NaN in the wide frame too
            assert loss.isna().tolist() == [st in (NAN, STEPS) for st in loss.index]
        assert s.meta["final_step"] == r.meta["final_step"] == STEPS
        assert s.kinds() == r.kinds() and s.names("grads") == r.names("grads")


def test_the_planted_spike_is_where_asked_and_nowhere_else(pair: tuple[Path, Path]) -> None:
    synth, _ = pair
    rows = _q(synth, "SELECT t.step, s.name FROM tensors t JOIN series s ON s.id = t.series "
                     "WHERE s.kind = 'grads' AND t.max >= 1e4")
    assert rows == [(SPIKE, tensor_names(TENSORS)[0])]


def test_wall_clock_rises_step_by_step(pair: tuple[Path, Path]) -> None:
    synth, _ = pair
    times = [t for (t,) in _q(synth, "SELECT time FROM steps ORDER BY step")]
    assert all(b > a for a, b in zip(times, times[1:]))
