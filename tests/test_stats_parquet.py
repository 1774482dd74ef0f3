"""A run's stats.parquet: written by ``Recorder.close()``, queried in place by DuckDB, trusted only
while it is what close() wrote for the run as it is (core/stats_file.py, FORMAT.md "stats.parquet").

* DuckDB reads ``RUN/stats.parquet`` (and ``RUN/*/stats.parquet`` over the ranks of a multi-rank
  run) with no export step, and its answers equal ``run.stats()``'s exactly (floats bit for bit);
* a resumed recording removes the copy when it opens and writes a new one that covers every step;
* a copy that is truncated, changed, stale or another store's is never served: ``export-stats``
  reads the catalog instead and says why;
* a failure to write it (a directory in the way: a real failure, not a mock) is one warning and
  ``close()`` returns with the run complete and readable (strict: raised after the run is released).
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import record_run, rewrite_tensor_rows, same_value

import stepdump
from stepdump.core import stats_file
from stepdump.store.catalog import CatalogWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(record_run(tmp_path_factory.mktemp("pq") / "run", steps=6))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Ranks 0 and 1 recorded, rank 2 a copy of rank 0's store with its own meta (ranks_gen.py).
    return write_ranks(tmp_path_factory.mktemp("pq") / "ranks", 3, steps=3, recorded=2)




def _assert_rows_equal(got: list[dict[str, Any]], df: pd.DataFrame, keys: tuple[str, ...]) -> None:
    want = df.astype(object).to_dict("records")
    assert len(got) == len(want) > 0
    got = sorted(got, key=lambda r: tuple(r[k] for k in keys))
    want = sorted(want, key=lambda r: tuple(r[k] for k in keys))
    for g, w in zip(got, want, strict=True):
        bad = [c for c in df.columns if not same_value(w[c], g[c])]
        assert not bad, (bad, g, w)


def _records(sql: str, *args: Any) -> list[dict[str, Any]]:
    rel = duckdb.execute(sql, list(args))
    names = [d[0] for d in rel.description]
    return [dict(zip(names, row, strict=True)) for row in rel.fetchall()]


def test_duckdb_queries_a_closed_run_in_place(single: Path) -> None:
    path = str(single / "stats.parquet")
    with stepdump.open(single) as run:
        df = run.stats()
        # Every row and column, as run.stats() has them.
        got = _records("SELECT * FROM read_parquet(?)", path)
        assert list(got[0]) == list(df.columns)
        _assert_rows_equal(got, df, ("step", "kind", "name"))
        # The largest grad norm of each step.
        per_step = duckdb.execute("SELECT step, max(norm) FROM read_parquet(?) WHERE kind = 'grads' "
                                  "GROUP BY step ORDER BY step", [path]).fetchall()
        want = df[df.kind == "grads"].groupby("step")["norm"].max()
        assert [s for s, _ in per_step] == list(want.index) == run.steps[:-1]  # the final record has no grads
        assert [v.hex() for _, v in per_step] == [float(v).hex() for v in want]
        # One tensor's history.
        hist = duckdb.execute("SELECT step, mean, std FROM read_parquet(?) WHERE kind = 'params' AND name = "
                              "'0.weight' ORDER BY step", [path]).fetchall()
        one = run.stats(kind="params", name="0.weight")
        assert [(s, m.hex(), d.hex()) for s, m, d in hist] == \
            [(int(s), float(m).hex(), float(d).hex()) for s, m, d in one[["step", "mean", "std"]].values]
        assert run.meta["stats_parquet"]["rows"] == len(df)


def test_duckdb_over_the_ranks_of_a_multirank_run(ranks: Path) -> None:
    glob = str(ranks / "*" / "stats.parquet")
    with stepdump.open(ranks) as run:
        df = run.stats()
        got = _records("SELECT * FROM read_parquet(?)", glob)
        _assert_rows_equal(got, df, ("step", "rank", "kind", "name"))
        per = duckdb.execute("SELECT rank, step, max(norm) FROM read_parquet(?) WHERE kind = 'grads' "
                             "GROUP BY rank, step ORDER BY rank, step", [glob]).fetchall()
        want = df[df.kind == "grads"].groupby(["rank", "step"])["norm"].max()
        assert [(r, s, v.hex()) for r, s, v in per] == [(r, s, float(v).hex()) for (r, s), v in want.items()]
        assert sorted({r for r, _, _ in per}) == run.ranks == [0, 1, 2]
        # The copied rank's file is its own (rank 2), written again after its meta was rewritten.
        assert run.rank(2).meta["stats_parquet"]["rank"] == 2
        assert run.rank(2).meta["stats_parquet"]["run_id"] == run.rank(2).meta["run_id"]


def test_export_stats_copies_a_valid_file_and_concatenates_ranks(single: Path, ranks: Path, tmp_path: Path,
                                                                 cli: Any) -> None:
    res = cli("export-stats", single, "-o", tmp_path / "one.parquet")
    assert "copied from the run's stats.parquet (1 of 1 store" in res.stdout
    assert (tmp_path / "one.parquet").read_bytes() == (single / "stats.parquet").read_bytes()
    res = cli("export-stats", ranks, "-o", tmp_path / "all.parquet")
    assert "copied from the run's stats.parquet (3 of 3 ranks" in res.stdout
    with stepdump.open(ranks) as run:
        _assert_rows_equal(pq.read_table(tmp_path / "all.parquet").to_pylist(), run.stats(),
                           ("step", "rank", "kind", "name"))


def _damage(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    f = dst / "stats.parquet"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "changed":  # same length, one byte flipped in the middle (a row value, not the footer)
        i = len(data) // 2
        f.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif how == "foreign":  # a whole store copied, given its own run id: its copy is the other run's
        cat = CatalogWriter(dst)
        cat.set_meta("run_id", "another-run")
        cat.close()
    elif how == "absent":
        f.unlink()
    elif how == "rows edited":  # a stat row changed in the catalog after close (by hand, a tool)
        rewrite_tensor_rows(dst, "step = 1 AND series = (SELECT min(id) FROM series WHERE kind = 'params')", (),
                            lambda r: (*r[:13], 12345.0, *r[14:]))


@pytest.mark.parametrize(("how", "says"), [
    ("truncated", "is truncated"), ("changed", "changed since it was written"),
    ("foreign", "written for run"), ("absent", "cannot be read"),
    ("rows edited", "stat rows changed since it was written"),
])
def test_a_damaged_or_foreign_copy_is_never_served(single: Path, tmp_path: Path, cli: Any, how: str,
                                                    says: str) -> None:
    run_dir = tmp_path / "run"
    _damage(single, run_dir, how)
    res = cli("export-stats", run_dir, "-o", tmp_path / "out.parquet")
    assert says in res.stdout and "read from the catalog" in res.stdout and "copied" not in res.stdout
    with stepdump.open(run_dir) as run:
        assert stats_file.check(run.path, run.catalog).data is None
        _assert_rows_equal(pq.read_table(tmp_path / "out.parquet").to_pylist(), run.stats(),
                           ("step", "kind", "name"))


def test_a_resumed_run_removes_its_copy_at_open_and_writes_one_for_every_step(single: Path, tmp_path: Path,
                                                                               cli: Any) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(single, run_dir)
    old = (run_dir / "stats.parquet").read_bytes()
    model_steps = 6

    def while_open(t: int, model: Any, opt: Any) -> None:
        if t == model_steps:  # the resumed Recorder is open: the stale copy is gone already
            assert not (run_dir / "stats.parquet").exists()
            with stepdump.open(run_dir) as live:
                assert live.meta["stats_parquet"] is None

    record_run(run_dir, steps=3, start=model_steps, before_step=while_open)
    with stepdump.open(run_dir) as run:
        df = run.stats()
        assert run.meta["stats_parquet"]["last_step"] == run.all_steps[-1] == model_steps + 3
        assert run.meta["stats_parquet"]["resumes"] == 1
        _assert_rows_equal(pq.read_table(run_dir / "stats.parquet").to_pylist(), df,
                           ("step", "kind", "name"))
    # The old copy put back (a sync tool, a backup): stale, and said so.
    (run_dir / "stats.parquet").write_bytes(old)
    res = cli("export-stats", run_dir, "-o", tmp_path / "out.parquet")
    assert "changed since it was written" in res.stdout or "is longer" in res.stdout or "is truncated" in res.stdout
    assert pq.read_table(tmp_path / "out.parquet").num_rows == len(df)


def _in_the_way(run_dir: Path) -> Any:
    """A before_step hook that puts a non-empty directory where close() renames stats.parquet to."""
    def hook(t: int, model: Any, opt: Any) -> None:
        if t == 0:
            (run_dir / "stats.parquet").mkdir()
            (run_dir / "stats.parquet" / "mine.txt").write_text("not yours")
    return hook


def test_a_failed_compaction_is_one_warning_and_close_returns(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              cli: Any) -> None:
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        record_run(run_dir, steps=3, before_step=_in_the_way(run_dir))
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "could not write" in warned[0].getMessage(), [r.getMessage() for r in warned]
    assert "stats.parquet" in warned[0].getMessage() and "readable" in warned[0].getMessage()
    assert (run_dir / "stats.parquet" / "mine.txt").read_text() == "not yours"
    assert not list(run_dir.glob(".stats.parquet*"))  # no partial file left
    with stepdump.open(run_dir) as run:
        assert run.meta.get("stats_parquet") is None and run.steps == [0, 1, 2, 3] and stepdump.verify(run).ok
        n = len(run.stats())
    res = cli("export-stats", run_dir, "-o", tmp_path / "out.parquet")
    assert "read from the catalog" in res.stdout and pq.read_table(tmp_path / "out.parquet").num_rows == n


def test_a_failed_compaction_raises_when_strict_once_the_run_is_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(stepdump.WriterError, match="could not write .*stats.parquet"):
        record_run(run_dir, steps=2, before_step=_in_the_way(run_dir), on_error="raise")
    with stepdump.open(run_dir) as run:
        assert run.steps == [0, 1, 2] and not run.live
    shutil.rmtree(run_dir / "stats.parquet")
    record_run(run_dir, steps=1, start=2, on_error="raise")  # the lock was released: resumable
    assert (run_dir / "stats.parquet").is_file()


def test_turned_off_or_without_pyarrow_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    record_run(tmp_path / "off", steps=2, stats_parquet=False)
    assert not (tmp_path / "off" / "stats.parquet").exists()
    with pytest.raises(stepdump.ConfigError, match="stats_parquet='yes'"):
        record_run(tmp_path / "bad", steps=1, stats_parquet="yes")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with caplog.at_level(logging.INFO, logger="stepdump"):
        record_run(tmp_path / "bare", steps=2)
    assert not (tmp_path / "bare" / "stats.parquet").exists()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r for r in caplog.records if "pyarrow is not installed" in r.getMessage()]
