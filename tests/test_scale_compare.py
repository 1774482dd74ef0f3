"""Comparison heatmaps of long runs read buckets, not every step (issue 26 item 5).

The ``norm_diff`` heatmap (relative difference of two runs' tensor norms) of two runs sharing
more steps than the page draws is computed inside SQLite, the second catalog attached to the
first (:func:`stepdump.analysis.report_compare.norm_diff`). Rows here: the catalog path
(forced) draws exactly the values, bucket bounds and names that reading every norm draws, on
short recorded runs that part at a known step (several budgets, both kinds) and on two long
synthetic runs with spikes at different steps; and on the long pair the catalog hands back
tensors x buckets rows, not tensors x steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import record_run

import stepdump
from stepdump.analysis.report_compare import divergence, norm_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synth_run import synth_run, tensor_names  # noqa: E402

PART = 7  # the step where run b's gradient is doubled
TENSORS, LONG = 24, 1500


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")

    def double(t: int, model: Any, opt: Any) -> None:
        if t == PART:
            for p in model.parameters():
                p.grad.mul_(2)

    a = record_run(root / "a", steps=30, every=None, stats_every=1, capture=("params", "grads"))
    b = record_run(root / "b", steps=30, every=None, stats_every=1, capture=("params", "grads"), before_step=double)
    return a, b


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("long")
    return (synth_run(root / "a", TENSORS, LONG, spike=700, nan_step=900),
            synth_run(root / "b", TENSORS, LONG, spike=1100, nan_step=900))


def _same(sql: dict[str, Any] | None, python: dict[str, Any] | None) -> None:
    assert sql is not None and python is not None
    for key in ("names", "x0", "x1", "values", "steps", "label", "note"):
        assert sql[key] == python[key], key


@pytest.mark.parametrize("kind", ["grads", "params"])
# 22 and 26: budgets whose float bucket edges round otherwise than the exact ones for 30 steps
@pytest.mark.parametrize("budget", [10, 13, 22, 26, 64])
def test_catalog_path_draws_what_reading_every_norm_draws(pair: tuple[Path, Path], kind: str, budget: int) -> None:
    with stepdump.open(pair[0]) as a, stepdump.open(pair[1]) as b:
        sql = norm_diff(a, b, kind, budget, "x", in_sql=True)
        python = norm_diff(a, b, kind, budget, "x", in_sql=False)
        _same(sql, python)
        assert divergence(a, b, 1)["step"] == PART  # the page's marker: where diff says they part
    assert sql is not None
    # the runs part at PART: every bucket before it is black (equal norms), the one holding it is not
    at = PART if kind == "grads" else PART + 1  # the doubled grads change the weights one record later
    for x0, x1, col in zip(sql["x0"], sql["x1"], zip(*sql["values"])):
        if x1 < at:
            assert all(v == 0 for v in col), (x0, x1)
        elif x0 <= at <= x1:
            assert any(v and v > 0 for v in col), (x0, x1)


class _Counting:
    def __init__(self, cat: Any) -> None:
        self.rows, self.statements, self._q = 0, 0, cat._q

    def __call__(self, sql: str, args: Any = ()) -> Any:
        out = self._q(sql, args)
        self.rows += len(out)
        self.statements += 1
        return out


@pytest.mark.parametrize("kind", ["grads", "params"])
def test_long_runs_are_compared_in_buckets(long_pair: tuple[Path, Path], kind: str) -> None:
    budget = 200
    with stepdump.open(long_pair[0]) as a, stepdump.open(long_pair[1]) as b:
        python = norm_diff(a, b, kind, budget, "x", in_sql=False)
        ca, cb = _Counting(a.catalog), _Counting(b.catalog)
        a.catalog._q, b.catalog._q = ca, cb  # type: ignore[method-assign]
        sql = norm_diff(a, b, kind, budget, "x")  # picked by itself: more common steps than the budget
    _same(sql, python)
    assert sql is not None and len(sql["x0"]) == budget and sql["steps"] == LONG + (kind == "params")  # + the final record
    rows = ca.rows + cb.rows
    assert rows <= TENSORS * budget + 2 * TENSORS + budget + 8, rows  # names x buckets, not names x steps
    assert ca.statements + cb.statements <= 8
    if kind == "grads":  # the spikes (700 in a, 1100 in b) show in the first tensor's row
        row = sql["values"][sql["names"].index(tensor_names(TENSORS)[0])]
        hot = [x0 for x0, x1, v in zip(sql["x0"], sql["x1"], row) if v and v > 0.5]
        assert any(x0 <= 700 <= x1 for x0, x1 in zip(sql["x0"], sql["x1"]) if x0 in hot)
        assert any(x0 <= 1100 <= x1 for x0, x1 in zip(sql["x0"], sql["x1"]) if x0 in hot)
