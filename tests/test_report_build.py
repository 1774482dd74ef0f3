"""Building the report's data at scale: the stats of each kind are read in one pass.

``build_report_data`` used to ask the catalog once per stat column per kind (norm for the
heatmaps, min/max/mean/std for the distribution bands: ten queries of every row of a
stats-only run; 36 s at 300 tensors x 5,000 steps). It now reads each kind's columns in one
query (``CatalogReader.stat_columns``) and pivots them once. These tests pin that (one query
per kind and store) and that the one-pass matrices are bit for bit what a query per column
gives, over runs with full steps, lean steps (mean/std unmeasured: NULL), tensors missing at
some steps and several ranks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import record_run
from torch import nn

import stepdump
from stepdump.analysis.matrices import stat_matrices, stat_matrix
from stepdump.analysis.report import build_report_data
from stepdump.store.queries import CatalogReader

COLUMNS = ("norm", "min", "max", "mean", "std", "nan", "zero_frac")


class _Partly(nn.Module):
    """Two layers; the second gets no gradient at odd steps (its grads row is absent there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 80)  # 640 weights
        self.b = nn.Linear(80, 64)  # 5120 weights: above the lean path's small size, mean/std NULL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _record(path: Path, shape: str) -> Path:
    if shape == "full":
        return record_run(path, steps=6, every=1)  # type: ignore[no-any-return]
    model = _Partly()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_fn(t: int, m: nn.Module, b: Any) -> torch.Tensor:
        x = b[0]
        h = torch.relu(m.a(x))  # type: ignore[operator]
        out = m.b(h) if t % 2 == 0 else h[:, :64]  # type: ignore[operator]
        return out.pow(2).mean()

    opt.zero_grad()
    kwargs: dict[str, Any] = {"every": None, "stats_every": 1} if shape == "lean" else {"every": 3}
    return record_run(path, steps=8, model=model, opt=opt, loss_fn=loss_fn,  # type: ignore[no-any-return]
                      before_step=_drop_b_grads, **kwargs)


def _drop_b_grads(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if t % 2:
        for p in model.b.parameters():  # type: ignore[union-attr]
            p.grad = None  # absent at odd steps: no grads row for b.* there


def _reference(run: Any, kind: str, column: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """One query per column (the old path), pivoted here independently."""
    series = run.catalog.matching_series(kind, None)
    rows = run.catalog.stat_column(kind, column)
    steps = sorted({s for _, s, _ in rows})
    values = np.full((len(series), len(steps)), np.nan)
    row_of = {sid: i for i, (sid, _, _) in enumerate(series)}
    for sid, s, v in rows:
        values[row_of[sid], steps.index(s)] = np.nan if v is None else float(v)
    return [n for _, _, n in series], np.array(steps, dtype=np.int64), values


@pytest.fixture(scope="module", params=["full", "lean", "partly"])
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp(request.param) / "run", request.param)


@pytest.mark.parametrize("kind", ["params", "grads", "optimizer"])
def test_one_pass_matrices_equal_one_query_per_column(run_dir: Path, kind: str) -> None:
    with stepdump.open(run_dir) as run:
        got = stat_matrices(run, kind, COLUMNS)
        for column in COLUMNS:
            names, steps, values = _reference(run, kind, column)
            m = got[column]
            assert m.names == names and m.names
            np.testing.assert_array_equal(m.steps, steps)
            assert m.values.dtype == np.float64 and m.values.shape == values.shape
            assert np.array_equal(m.values, values, equal_nan=True), column  # bit for bit, NaN where absent
            single = stat_matrix(run, kind, column)
            assert single.names == names and np.array_equal(single.values, values, equal_nan=True)


def test_shapes_hold_what_the_cases_claim(run_dir: Path) -> None:
    """The run shapes really have the gaps the equality test is meant to cover."""
    with stepdump.open(run_dir) as run:
        m = stat_matrices(run, "grads", ("mean",))["mean"]
        missing = int(np.isnan(m.values).sum())
    if run_dir.parent.name.startswith("full"):
        assert missing == 0
    else:
        assert missing > 0  # lean: NULL means of b.weight; partly: b.* absent at odd steps


def test_build_reads_each_kind_once(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[tuple[str, str]] = Counter()
    one, many = CatalogReader.stat_column, CatalogReader.stat_columns

    def spy_one(self: CatalogReader, kind: str, column: str, name_glob: str | None = None) -> Any:
        calls[("stat_column", kind)] += 1
        return one(self, kind, column, name_glob)

    def spy_many(self: CatalogReader, kind: str, columns: Any, name_glob: str | None = None) -> Any:
        calls[("stat_columns", kind)] += 1
        return many(self, kind, columns, name_glob)

    monkeypatch.setattr(CatalogReader, "stat_column", spy_one)
    monkeypatch.setattr(CatalogReader, "stat_columns", spy_many)
    with stepdump.open(run_dir) as run:
        data = build_report_data(run, findings=[], quantile_steps=0)
    assert data["grad_norms"] is not None and data["dist"]["grads"]["bands"]
    assert calls == Counter({("stat_columns", "params"): 1, ("stat_columns", "grads"): 1})


def test_bands_and_heatmaps_from_one_pass_equal_per_column(run_dir: Path) -> None:
    """What the page gets is unchanged: heatmap values and bands equal those built from a query per column."""
    from stepdump.analysis.report_heatmaps import heatmap_data
    from stepdump.analysis.report_dist import stat_bands

    with stepdump.open(run_dir) as run:
        data = build_report_data(run, findings=[], quantile_steps=0, max_points=10, dist_points=3)
        names, steps, norms = _reference(run, "grads", "norm")
        from stepdump.analysis.matrices import StatMatrix

        want = heatmap_data(StatMatrix(names, steps, norms), 10, "grad L2 norm")
        bands = stat_bands(run, "grads", 3)
    assert want is not None and bands is not None
    assert data["grad_norms"]["values"] == want["values"] and data["grad_norms"]["x0"] == want["x0"]
    entry = data["dist"]["grads"]["bands"][0]
    for c in ("min", "max", "mean", "std"):
        assert entry[c] == [[None if not np.isfinite(v) else float(v) for v in row] for row in bands[c]]
