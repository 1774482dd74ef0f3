"""``cross_rank`` compares each rank's catalog rows as plain tuples: the same keys as the frames.

The comparison of replicas across ranks reads each rank's stat rows once as tuples (no pandas
frame per rank: 256 ranks went from seconds to a fraction). Checked here against the frames'
way it replaced (kept for tensors fingerprinted in two kinds and for rows a frame would convert),
on a 4-rank DDP recording (benchmarks/ranks_gen.py) with a fingerprint changed on one rank and a
row missing on another; and a stat that is not a number is refused as the frames refuse it.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

import stepdump
from stepdump.analysis.cross_rank import CrossRank, cross_rank
from stepdump.errors import CorruptDataError
from stepdump.store import ranks as ranks_file
from stepdump.store.schema import catalog_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402

RANKS = 4


def _both(root: Path) -> tuple[list[tuple[int, str, str, str]] | None, list[tuple[int, str, str, str]]]:
    with stepdump.open(root) as run:
        rule = CrossRank()
        common = sorted(set.intersection(*(set(rr.all_steps) for _, rr in run.stores())))
        rows = rule._split_from_rows(run, common, RANKS)
        frames = rule._split_from_frames(run, common, RANKS, {}, [])
    return rows, frames


def _sql(root: Path, rank: int, sql: str, *args: object) -> None:
    con = sqlite3.connect(catalog_path(ranks_file.local_rank_dir(root, rank)))
    try:
        with con:
            con.execute(sql, args)
    finally:
        con.close()


def _row(kind: str, name: str, step: int) -> str:
    return (f"UPDATE tensors SET fingerprint = fingerprint + 1 WHERE step = {step} AND series = "
            f"(SELECT id FROM series WHERE kind = '{kind}' AND name = '{name}')")


def test_rows_find_what_the_frames_find(tmp_path: Path) -> None:
    root = write_ranks(tmp_path / "run", RANKS, steps=3)
    rows, frames = _both(root)
    assert rows == frames == []  # DDP replicas agree
    assert [f for f in cross_rank(stepdump.open(root)) if f.severity.name == "ERROR"] == []

    _sql(root, 2, _row("grads", "module.2.weight", 1))  # rank 2's grad differs at step 1
    _sql(root, 3, "DELETE FROM tensors WHERE step = 2 AND series = "
                  "(SELECT id FROM series WHERE kind = 'params' AND name = 'module.0.bias')")  # rank 3 lacks a row
    rows, frames = _both(root)
    assert rows is not None
    assert set(rows) == set(frames) == {(1, "grads", "module.2.weight", "replica"), (2, "params", "module.0.bias", "replica")}
    with stepdump.open(root) as run:
        found = cross_rank(run)
    assert [(f.step, f.kind, f.tensor) for f in found] == [(1, "grads", "module.2.weight")]
    assert "rank 2 (norm" in found[0].message and "ranks 0, 1, 3 (norm" in found[0].message


def test_a_stat_that_is_not_a_number_is_refused_as_before(tmp_path: Path) -> None:
    root = write_ranks(tmp_path / "run", RANKS, steps=2)
    _sql(root, 1, "UPDATE tensors SET norm = 'abc' WHERE step = 0 AND series = "
                  "(SELECT id FROM series WHERE kind = 'params' AND name = 'module.0.weight')")
    with stepdump.open(root) as run:
        common = sorted(set.intersection(*(set(rr.all_steps) for _, rr in run.stores())))
        assert CrossRank()._split_from_rows(run, common, RANKS) is None  # text: left to the frames
        with pytest.raises(CorruptDataError, match="not numbers"):
            cross_rank(run)
