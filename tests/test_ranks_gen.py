"""benchmarks/ranks_gen.py writes what a real multi-rank recording writes, rank for rank.

One real 2-process gloo DDP job records the generator's loop (``ranks_gen.py --real``); the
generator writes 2 ranks of the same loop in this process. Both must have the same files, the
same catalog tables and columns, the same rows of each kind (series, steps, scalars, meta keys),
and read the same way through ``stepdump.open`` -- the benchmarks that time analyses on 256
generated ranks stand for real ones only if this holds. Values are compared where they must be
equal bit for bit (step 0's parameters, each rank's step-0 loss; after that, real DDP averages
per-rank gradients where the generator takes the global batch's gradient: same math, other
rounding).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from gloo_fork import run_ranks
from helpers import assert_same

import stepdump
from stepdump.analysis.cross_rank import cross_rank

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from ranks_gen import real_rank, write_ranks  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ranksgen")
    real, gen = root / "real", root / "gen"
    run_ranks(lambda rank: real_rank(str(real), STEPS), 2, root / "logs")  # ranks forked from this process
    write_ranks(gen, 2, steps=STEPS)
    return real, gen


def _tables(catalog: Path) -> dict[str, list[str]]:
    with sqlite3.connect(f"file:{catalog}?mode=ro", uri=True) as con:
        names = [n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {n: [c[1] for c in con.execute(f"PRAGMA table_info({n})")] for n in names}


def _rows(catalog: Path, sql: str) -> list[Any]:
    with sqlite3.connect(f"file:{catalog}?mode=ro", uri=True) as con:
        return sorted(con.execute(sql).fetchall())


# What must be the same in each rank's store (queries that name the kinds of rows, not values).
ROW_KINDS = {
    "series": "SELECT kind, name FROM series",
    "tensor rows": "SELECT t.step, s.kind, s.name, t.dtype, t.shape, t.blob IS NOT NULL FROM tensors t "
                   "JOIN series s ON s.id = t.series",
    "steps": "SELECT step FROM steps",
    "scalar names": "SELECT DISTINCT step, name FROM scalars",
    "meta keys": "SELECT key FROM meta",
}


def test_same_files_and_ranks_json(pair: tuple[Path, Path]) -> None:
    real, gen = pair
    assert sorted(p.name for p in real.iterdir()) == sorted(p.name for p in gen.iterdir()) == \
        ["rank00000", "rank00001", "ranks.json"]
    a, b = (json.loads((d / "ranks.json").read_text()) for d in pair)
    assert a.pop("backend") == "gloo" and b.pop("backend") == "fake"  # the one difference, named
    assert a == b
    for r in ("rank00000", "rank00001"):
        files = [sorted(str(p.relative_to(d / r)) for p in (d / r).rglob("*") if "lock" not in p.name) for d in pair]
        assert files[0] == files[1], r


@pytest.mark.parametrize("rank", [0, 1])
def test_same_tables_and_columns(pair: tuple[Path, Path], rank: int) -> None:
    real, gen = (d / f"rank{rank:05d}" / "catalog.sqlite" for d in pair)
    assert _tables(real) == _tables(gen)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("what", list(ROW_KINDS))
def test_same_kinds_of_rows(pair: tuple[Path, Path], rank: int, what: str) -> None:
    real, gen = (d / f"rank{rank:05d}" / "catalog.sqlite" for d in pair)
    a, b = _rows(real, ROW_KINDS[what]), _rows(gen, ROW_KINDS[what])
    assert a and a == b


def test_open_reads_both_the_same_way(pair: tuple[Path, Path]) -> None:
    real, gen = pair
    with stepdump.open(real) as a, stepdump.open(gen) as b:
        assert type(a) is type(b) and type(a).__name__ == "DistributedRun"
        assert (a.world_size, a.ranks, a.primary) == (b.world_size, b.ranks, b.primary) == (2, [0, 1], 0)
        assert a.steps == b.steps == list(range(STEPS + 1))
        assert a.kinds() == b.kinds()
        for k in a.kinds():
            assert a.names(k) == b.names(k)
        sa, sb = a.stats(), b.stats()
        assert list(sa.columns) == list(sb.columns) and sa.dtypes.equals(sb.dtypes)
        assert sa[["step", "rank", "kind", "name", "dtype", "shape"]].equals(sb[["step", "rank", "kind", "name",
                                                                                "dtype", "shape"]])
        for r in (0, 1):
            da, db = a.rank(r).meta["distributed"], b.rank(r).meta["distributed"]
            assert da.pop("backend") == "gloo" and db.pop("backend") == "fake"
            assert da == db and da["rank"] == r
            assert list(a.scalars(rank=r).columns) == list(b.scalars(rank=r).columns)
            # Bit for bit where the two must agree: the initial replica and each rank's own first loss.
            assert a.scalars(rank=r)["loss"].iloc[0] == b.scalars(rank=r)["loss"].iloc[0]
            for n in a.names("params"):
                assert_same(a.tensor(n, 0, rank=r), b.tensor(n, 0, rank=r), f"rank {r} {n}")
        # Replicas agree in both (DDP); the analyses see the same structure.
        assert cross_rank(a) == [] and cross_rank(b) == []
        assert a.state_dict(STEPS).keys() == b.state_dict(STEPS).keys()


def test_copied_ranks_are_what_a_recorded_rank_writes(tmp_path: Path) -> None:
    """``write_ranks(recorded=k)`` (what benchmarks/ranks_scale.py uses for 64 and 256 ranks):
    ranks past k are copies whose stores hold the rows, tensors and meta a recorded rank would
    (DDP replicas: the same bytes), only their logged loss is the copied rank's."""
    full = write_ranks(tmp_path / "full", 3, steps=2)
    part = write_ranks(tmp_path / "part", 3, steps=2, recorded=1)
    assert (full / "ranks.json").read_bytes() == (part / "ranks.json").read_bytes()
    for what, sql in ROW_KINDS.items():
        a, b = (_rows(d / "rank00002" / "catalog.sqlite", sql) for d in (full, part))
        assert a and a == b, what
    with stepdump.open(full) as a, stepdump.open(part) as b:
        assert a.stats().equals(b.stats())  # every rank's stats and fingerprints, bit for bit
        ma, mb = a.rank(2).meta, b.rank(2).meta
        assert ma["distributed"] == mb["distributed"] and mb["distributed"]["rank"] == 2
        # fresh per store, as recorded (stats_parquet names the run id, and the time it took)
        assert {k for k in ma if ma[k] != mb[k]} == {"run_id", "created", "stats_parquet"}
        assert ma["stats_parquet"]["xxh3"] == mb["stats_parquet"]["xxh3"]  # the same rows, rank 2's
        assert mb["stats_parquet"]["run_id"] == mb["run_id"] and mb["stats_parquet"]["rank"] == 2
        assert len({b.rank(r).meta["run_id"] for r in b.ranks}) == 3
        assert not a.scalars(rank=2)["loss"].equals(b.scalars(rank=2)["loss"])  # the one known gap
        assert b.scalars(rank=2)["loss"].equals(b.scalars(rank=0)["loss"])
        assert stepdump.check(a) == stepdump.check(b) == []
