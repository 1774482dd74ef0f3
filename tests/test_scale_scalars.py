"""Scalar charts of a long run shrunk inside SQLite (issue 26 item 5): same points as the Python path.

A run whose scalars are longer than the chart's budget is bucketed in the catalog
(:func:`stepdump.analysis.scalar_charts.scalar_charts`, ``in_sql=True``): per bucket the first minimum,
the first maximum and the first NaN/Inf. Each row here plants something in a synthetic run's
scalars (a spike, a NaN, an Inf, a dip, an alias, a copy one step later, a near copy) and checks
that the SQL path draws exactly what reading every row and downsampling in Python draws, that the
planted point is among the drawn ones, and that the catalog handed back a bounded number of rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import catalog_sql
from torch import nn

import stepdump
from stepdump.analysis.scalar_charts import ScalarChart, scalar_charts

STEPS, BUDGET = 3000, 200
SPIKE, NAN, INF, DIP = 1777, 901, 2222, 333


def _plant(run: Path, plant: str) -> tuple[str, int, float]:
    """Change the run's scalars as ``plant`` says; (scalar, step, value) a chart must show."""
    if plant == "spike":
        catalog_sql(run, "UPDATE scalars SET value = 1e3 WHERE name = 'loss' AND step = ?", (SPIKE,))
        return "loss", SPIKE, 1e3
    if plant == "nan":  # a logged NaN is a NULL value
        catalog_sql(run, "UPDATE scalars SET value = NULL WHERE name = 'loss' AND step = ?", (NAN,))
        return "loss", NAN, float("nan")
    if plant == "inf":
        catalog_sql(run, "UPDATE scalars SET value = 9e999 WHERE name = 'loss' AND step = ?", (INF,))
        return "loss", INF, float("inf")
    if plant == "dip":
        catalog_sql(run, "UPDATE scalars SET value = -5 WHERE name = 'loss' AND step = ?", (DIP,))
        return "loss", DIP, -5.0
    if plant in ("alias", "shifted", "near"):
        shift = 1 if plant == "shifted" else 0
        scale = 1.0000001 if plant == "near" else 1.0
        catalog_sql(run, "UPDATE scalars SET value = 50 WHERE name = 'loss' AND step = ?", (SPIKE,))
        catalog_sql(run, "INSERT INTO scalars(step, name, value) SELECT step - ?, 'loss_copy', value * ? "
                    "FROM scalars WHERE name = 'loss' AND step - ? >= 0", (shift, scale, shift))
        return "loss", SPIKE, 50.0
    if plant == "ties":  # equal minima and maxima: the first of each is drawn
        catalog_sql(run, "UPDATE scalars SET value = round(value * 100) / 100 WHERE name = 'loss'")
        return "loss", 0, 1.0
    raise AssertionError(plant)


PLANTS = ["spike", "nan", "inf", "dip", "alias", "shifted", "near", "ties"]


def long_scalars(path: Path, steps: int) -> Path:
    """A run recorded for two steps (scalars only), its loss and lr then logged for ``steps`` steps
    straight into the catalog (a recording of that length would take minutes): loss 1 / (1 + step)
    with a little hashed noise, lr decaying by 0.999 a step."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(path, model, opt, every=None, capture=("params",)) as rec:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=1.0)
    catalog_sql(path, "DELETE FROM scalars")
    catalog_sql(path, "INSERT INTO scalars(step, name, value) WITH RECURSIVE c(s) AS (SELECT 0 UNION ALL "
                "SELECT s + 1 FROM c WHERE s + 1 < ?) SELECT s, 'loss', 1.0 / (1 + s) + "
                "((s * 1103515245 + 12345) % 1000003) / 1e8 FROM c UNION ALL SELECT s, 'lr', 0.1 * "
                "exp(-0.001 * s) FROM c", (steps,))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_scalars(tmp_path_factory.mktemp("scalars") / "run", STEPS)


def _copy(base: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(base, dest)
    return dest


def _key(c: ScalarChart) -> tuple[Any, ...]:
    return (c.group.name, c.group.aliases, c.group.shifted, c.points, c.log, c.nonfinite_steps.tolist(),
            c.x.tolist())


class _Counting:
    """Counts the rows the catalog hands back (wraps ``CatalogReader._q``)."""

    def __init__(self, cat: Any) -> None:
        self.rows, self._q = 0, cat._q

    def __call__(self, sql: str, args: Any = ()) -> Any:
        out = self._q(sql, args)
        self.rows += len(out)
        return out


# 228 and 171: budgets whose float bucket edges (bucket_edges) round differently from the exact
# integer ones at some edges, for a finite series (2 points a bucket) and one with a NaN/Inf (3).
@pytest.mark.parametrize("budget", [BUDGET, 228, 171])
@pytest.mark.parametrize("plant", PLANTS)
def test_sql_buckets_draw_what_python_draws_and_keep_the_planted_point(
        base: Path, tmp_path: Path, plant: str, budget: int) -> None:
    run_dir = _copy(base, tmp_path / "run")
    name, step, value = _plant(run_dir, plant)
    with stepdump.open(run_dir) as run:
        python = scalar_charts(run, budget, in_sql=False)
        counting = _Counting(run.catalog)
        run.catalog._q = counting  # type: ignore[method-assign]
        sql = scalar_charts(run, budget)  # picked by itself: the series are longer than the budget
        rows = counting.rows
    assert [_key(c) for c in sql] == [_key(c) for c in python]
    for a, b in zip(sql, python):
        assert np.array_equal(a.y, b.y, equal_nan=True), a.group.name
        assert a.x.size <= budget
    chart = next(c for c in sql if c.group.name == name)
    assert chart.points > budget  # it was bucketed
    drawn = dict(zip(chart.x.tolist(), chart.y.tolist()))
    assert step in drawn and np.array_equal(drawn[step], value, equal_nan=True)
    if plant in ("nan", "inf"):
        assert chart.nonfinite_steps.tolist() == [step]
    if plant == "alias":
        assert chart.group.aliases == ["loss_copy"]
    if plant == "shifted":
        assert chart.group.shifted == ["loss_copy"]
    if plant == "near":
        assert any(c.group.name == "loss_copy" for c in sql)
    # the catalog handed back per name a summary, the middle values and the drawn points, not every row
    assert rows <= len(sql) * (budget + 8) + 32, rows


def test_the_budgets_above_move_some_points_across_an_edge() -> None:
    from stepdump.analysis.scalar_charts import edge_moves

    assert edge_moves(STEPS, 228 // 2) != ([], []) and edge_moves(STEPS, 171 // 3) != ([], [])


def test_sql_path_is_taken_only_past_the_budget(base: Path) -> None:
    with stepdump.open(base) as run:
        counting = _Counting(run.catalog)
        run.catalog._q = counting  # type: ignore[method-assign]
        short = scalar_charts(run, STEPS + 10)  # every series fits: the rows are read as they are
        assert counting.rows >= STEPS
        assert [_key(c) for c in short] == [_key(c) for c in scalar_charts(run, STEPS + 10, in_sql=True)]
