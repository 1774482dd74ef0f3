"""Distributions over time of a lean (stats-only) run (issue 26 item 3).

Lean steps record, per tensor: numel, NaN/±Inf counts, min, max and the L2 norm at every step;
mean and std only for tensors of at most 4096 elements (larger ones: NULL, "not measured",
docs/performance.md), and no new summary (docs/report.md says why, with the cost measured by
benchmarks/lean_summaries.py). The report's distribution view of a lean run must therefore draw,
for every tensor, the min–max envelope at every step (exactly the recorded values), mean ± std
where they were measured and nothing (never a 0) where they were not, no quantile chart (no
tensor is stored but the final record's params), and say so on the page. Rows: a small and a large tensor, params and grads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import open_page, record_run
from torch import nn

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.render.html import write_report

STEPS = 12
SMALL, LARGE = "2.weight", "0.weight"  # 64 x 4 = 256 elements; 80 x 64 = 5120 > 4096


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return record_run(tmp_path_factory.mktemp("leandist") / "lean", steps=STEPS, model=model, opt=opt,  # type: ignore[no-any-return]
                      batch=lambda t: (torch.randn(8, 80, generator=torch.Generator().manual_seed(t)),
                                       torch.randn(8, 4, generator=torch.Generator().manual_seed(t + 99))),
                      every=None, stats_every=1)


@pytest.fixture(scope="module")
def data(lean_run: Path) -> tuple[dict[str, Any], Any]:
    with stepdump.open(lean_run) as run:
        assert run.steps == [] or run.steps == [run.meta.get("final_step")], "precondition: no full training step"
        return build_report_data(run, findings=[]), run.stats()


@pytest.mark.parametrize("kind", ["params", "grads"])
@pytest.mark.parametrize("name", [SMALL, LARGE])
def test_bands_of_a_lean_run_are_the_recorded_stats(data: tuple[dict[str, Any], Any], kind: str, name: str) -> None:
    d, stats = data
    (bands,) = d["dist"][kind]["bands"]
    rows = stats[(stats["kind"] == kind) & (stats["name"] == name)].sort_values("step")
    assert bands["x0"] == rows["step"].tolist()  # a column per recorded step (no bucketing at 12 steps)
    k = bands["names"].index(name)
    for col in ("min", "max", "mean", "std"):
        want = [None if v is None or np.isnan(v) else float(v) for v in rows[col]]
        assert bands[col][k] == want, (col, bands[col][k], want)
    measured = rows["mean"].notna()
    if name == SMALL:
        assert measured.all()  # small tensors get every stat at a lean step
    else:
        assert not measured[rows["step"] < STEPS].any()  # large: not measured at lean steps (never 0)
    assert all(v is not None for v in bands["min"][k] + bands["max"][k])  # the envelope at every step
    quantiles = d["dist"][kind]["quantiles"]
    if kind == "grads":  # nothing stored in full (the final record has no grads): no quantiles
        assert quantiles == []
    else:  # the params of the final record only (close() stores them in full)
        (q,) = quantiles
        assert q["steps"] == [STEPS] and all(v is not None for level in q["q"] for v in level[k])


def test_page_draws_the_envelope_and_says_what_was_not_measured(lean_run: Path, browser: Any, tmp_path: Path) -> None:
    with stepdump.open(lean_run) as run:
        out = write_report(run, tmp_path / "lean.html")
    page, problems = open_page(browser, out.as_uri())
    try:
        for name, unmeasured in ((SMALL, False), (LARGE, True)):
            page.select_option("#layer-select", name)
            for kind in ("params", "grads"):
                sel = f"canvas[data-plot='layer:dist:{kind}']"
                assert page.get_attribute(sel, "data-tensor") == name
                # mean points where measured: every step of the small tensor (and the final record's params),
                # only the final record's params for the large one
                cols = STEPS + (kind == "params")
                measured = (kind == "params") + (0 if unmeasured else STEPS)
                series = json.loads(page.get_attribute(sel, "data-series"))
                assert series and series[0]["points"] == measured, series
                # the min-max envelope at every column, mean ± std at the measured ones
                assert int(page.get_attribute(sel, "data-banded")) == cols + measured, (name, kind)
                note = page.eval_on_selector(sel, "c => c.closest('.card').querySelector('.note').textContent")
                said = "mean and std not measured" in note
                assert said == unmeasured, (name, kind, note)
                assert not unmeasured or f"not measured at {cols - measured} of {cols} steps" in note, note
                quantiles = page.query_selector(f"canvas[data-plot='layer:quantiles:{kind}']")
                assert (quantiles is not None) == (kind == "params")  # params: the final record's; grads: none
    finally:
        page.close()
    assert problems == []
