"""Columnar stats: ``stepdump export-stats RUN -o stats.parquet`` and ``run.stats(dtype_backend="pyarrow")``.

Every case exports a run (single store, multi-rank, one with NULL stats: non-finite and empty
tensors), reads the Parquet file back with pyarrow and compares every value with the catalog's
rows as ``run.stats()`` gives them: exactly (floats bit for bit; a NULL stat is an Arrow null
where the numpy frame has NaN). The Arrow-backed frame is checked against the same rows.
"""

from __future__ import annotations

import math
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import record_run, same_value
from torch import nn

import stepdump

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("columnar")
    out = {"single": record_run(root / "single", steps=4), "ranks": write_ranks(root / "ranks", 3, steps=3)}
    # NULL stats: a tensor with no finite element (min/max/mean/std/norm NULL) and an empty one.
    model = nn.ParameterDict({"w": nn.Parameter(torch.ones(3)), "empty": nn.Parameter(torch.ones(0))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(root / "nulls", model, opt) as rec:
        for s in range(3):
            model["w"].grad = torch.full((3,), math.inf if s == 1 else 1.0)
            model["empty"].grad = torch.ones(0)
            opt.step()
            rec.log(loss=float(s))
    out["nulls"] = root / "nulls"
    return {k: Path(v) for k, v in out.items()}




def assert_table_is_frame(table: pa.Table, df: pd.DataFrame) -> None:
    """``table`` holds exactly the rows and columns of ``df`` (its row order may be rank-major)."""
    assert table.column_names == list(df.columns)
    assert table.num_rows == len(df)
    keys = [c for c in ("step", "rank", "kind", "name") if c in df.columns]
    got = table.to_pylist()
    want = df.astype(object).to_dict("records")
    got.sort(key=lambda r: tuple(r[k] for k in keys))
    want.sort(key=lambda r: tuple(r[k] for k in keys))
    for g, w in zip(got, want, strict=True):
        bad = [c for c in df.columns if not same_value(w[c], g[c])]
        assert not bad, (bad, g, w)


# (run, filters): every filter the command takes, on every kind of store.
CASES = [
    ("single", {}), ("single", {"kind": "grads"}), ("single", {"name": "0.*"}), ("single", {"steps": range(1, 3)}),
    ("ranks", {}), ("ranks", {"kind": "optimizer"}), ("ranks", {"name": "*bias", "steps": range(0, 2)}),
    ("nulls", {}), ("nulls", {"kind": "grads"}),
]


def _argv(filters: dict[str, Any]) -> list[str]:
    out = []
    for k, v in filters.items():
        out += [f"--{k}", f"{v.start}:{v.stop}" if isinstance(v, range) else str(v)]
    return out


@pytest.mark.parametrize(("which", "filters"), CASES, ids=[f"{w}-{'-'.join(f) or 'all'}" for w, f in CASES])
def test_export_stats_reads_back_as_the_catalog_rows(runs: dict[str, Path], tmp_path: Path, cli: Any,
                                                     which: str, filters: dict[str, Any]) -> None:
    out = tmp_path / "stats.parquet"
    res = cli("export-stats", runs[which], "-o", out, *_argv(filters))
    table = pq.read_table(out)
    with stepdump.open(runs[which]) as run:
        df = run.stats(**filters)
        assert not df.empty
        assert_table_is_frame(table, df)
        ranked = which == "ranks"
        assert ("rank" in table.column_names) == ranked
        assert f"wrote {len(df)} rows ({'3 ranks' if ranked else '1 store'})" in res.stdout
        arrow = run.stats(**filters, dtype_backend="pyarrow")
        assert all(isinstance(t, pd.ArrowDtype) for t in arrow.dtypes), arrow.dtypes
        assert list(arrow.columns) == list(df.columns)
        # Same rows in the same order as the numpy frame.
        assert arrow[["step", "kind", "name"]].astype(object).values.tolist() == \
            df[["step", "kind", "name"]].astype(object).values.tolist()
        assert_table_is_frame(pa.Table.from_pandas(arrow, preserve_index=False), df)
    if which == "nulls":  # the NULL stats really are there (else this case checks nothing new)
        assert table.column("norm").null_count > 0 and table.column("mean").null_count > 0


def test_export_stats_of_a_multirank_run_has_every_rank_and_step(runs: dict[str, Path], tmp_path: Path,
                                                                  cli: Any) -> None:
    cli("export-stats", runs["ranks"], "-o", tmp_path / "s.parquet")
    t = pq.read_table(tmp_path / "s.parquet")
    with stepdump.open(runs["ranks"]) as run:
        per_rank = {r: len(run.rank(r).stats()) for r in run.ranks}
        steps = set(run.all_steps)
    counts = dict(zip(*[c.to_pylist() for c in t.group_by("rank").aggregate([("step", "count")]).columns],
                      strict=True))
    assert counts == per_rank and set(t.column("step").to_pylist()) == steps


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["{missing}", "-o", "{out}"], 3, "does not exist"),
    (["{single}", "-o", "{out}", "--kind", "gradz"], 2, "gradz"),
    (["{single}", "-o", "{out}", "--steps", "x"], 2, "steps"),
    (["{single}"], 2, "-o"),
    (["{corrupt}", "-o", "{out}"], 4, "wrong type"),
])
def test_export_stats_exit_codes(runs: dict[str, Path], tmp_path: Path, cli: Any, argv: list[str], code: int,
                                 says: str) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs["single"], corrupt)
    with sqlite3.connect(corrupt / "catalog.sqlite") as con:
        con.execute("UPDATE tensors SET norm = 'not a number' WHERE step = 1")
    # The export reads this catalog's rows (its stats.parquet, a copy of the rows as close() wrote
    # them, is checked against the meta only: tests/test_stats_parquet.py).
    (corrupt / "stats.parquet").unlink()
    names = {"missing": tmp_path / "nope", "out": tmp_path / "s.parquet", "single": runs["single"],
             "corrupt": corrupt}
    res = cli("export-stats", *[a.format(**names) for a in argv], ok=code)
    assert says in res.stdout + res.stderr
    assert not (tmp_path / "s.parquet").exists()  # a failed export leaves no file, partial or not
    assert not list(tmp_path.glob(".s.parquet*"))


def test_without_pyarrow_the_error_says_how_to_install_it(runs: dict[str, Path], tmp_path: Path, cli: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    res = cli("export-stats", runs["single"], "-o", tmp_path / "s.parquet", ok=5)
    assert "pip install pyarrow" in res.stdout + res.stderr
    with stepdump.open(runs["single"]) as run, pytest.raises(stepdump.StepdumpError, match="pip install pyarrow"):
        run.stats(dtype_backend="pyarrow")


def test_dtype_backend_is_checked(runs: dict[str, Path]) -> None:
    for which in ("single", "ranks"):
        with stepdump.open(runs[which]) as run, pytest.raises(stepdump.StepdumpError, match="numpy.*pyarrow"):
            run.stats(dtype_backend="arrow")
