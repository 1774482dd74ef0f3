"""A NaN or ±Inf inside a heatmap bucket is drawn (issue 26 item 5: downsampling keeps NaNs).

A tensor's stats row keeps the norm of its finite elements and counts the NaN/±Inf ones, so a
heatmap coloured by norm shows nothing where a gradient went non-finite; the catalog counts them
per bucket. The page paints such a cell in a colour the scale does not use and lists it
(``data-nonfinite``), the hover says so, and the tensor's norm chart gets a red tick at that bucket
(``data-bad``). Each case plants one non-finite element at one step of one tensor in a real
recording, read exactly (every step a column) or bucketed in the catalog (max_points=10), and checks
that exactly the bucket holding that step is marked, in that tensor's row only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import open_page
from torch import nn

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.render.html import render_report

STEPS, AT, NAMES, BAD = 60, 37, ("a", "b", "c"), "b"
VALUES = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf")}
NONFINITE_RGB = [0xFF, 0x1F, 0x5A]  # report_heat.js NONFINITE


def _record(path: Path, value: float) -> None:
    torch.manual_seed(0)
    model = nn.ParameterDict({n: nn.Parameter(torch.randn(8)) for n in NAMES})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1, capture=("params", "grads")) as rec:
        for s in range(STEPS):
            for j, n in enumerate(NAMES):
                g = torch.full((8,), 0.01 * (1 + (s + j) % 5))
                if s == AT and n == BAD:
                    g[2] = value
                model[n].grad = g
            opt.step()
            with torch.no_grad():  # keep the parameters finite: only the gradient is planted
                for p in model.values():
                    p.nan_to_num_(0.0, 0.0, 0.0)
            rec.log(loss=1.0 / (1 + s))


@pytest.fixture(scope="module", params=sorted(VALUES))
def planted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param) / "run"
    _record(path, VALUES[request.param])
    return request.param, path


def _column(hm: dict[str, Any], step: int) -> int:
    hits = [i for i, (a, b) in enumerate(zip(hm["x0"], hm["x1"])) if a <= step <= b]
    assert len(hits) == 1, (step, hits)
    return hits[0]


@pytest.mark.parametrize("max_points", [10, 200], ids=["bucketed", "exact"])
def test_page_marks_the_bucket_holding_the_nonfinite_step(browser: Any, planted: tuple[str, Path], max_points: int,
                                                          tmp_path: Path) -> None:
    kind, path = planted
    with stepdump.open(path) as run:
        data = build_report_data(run, findings=[], max_points=max_points, quantile_steps=0)
    hm = data["grad_norms"]
    assert (hm["steps"] > len(hm["x0"])) == (max_points == 10)  # bucketed or not, as the case says
    col, row = _column(hm, AT), hm["names"].index(BAD)
    assert hm["nonfinite"] == [[row, col]], kind
    assert data["param_norms"]["nonfinite"] == []  # the parameters stayed finite
    out = tmp_path / "report.html"
    out.write_text(render_report(data), encoding="utf-8")
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        cv = page.locator("canvas[data-plot='grad_norms']")
        cv.wait_for(timeout=15_000)
        marks = json.loads(cv.get_attribute("data-nonfinite") or "null")
        assert [(m["tensor"], m["x0"], m["x1"]) for m in marks] == [(BAD, hm["x0"][col], hm["x1"][col])]
        assert marks[0]["x0"] <= AT <= marks[0]["x1"]
        # the marked cell is painted in the non-finite colour, nothing else in its row or another row is
        def reds(y: float) -> list[float]:
            return page.evaluate(
                "([y, rgb]) => { const c = document.querySelector(\"canvas[data-plot='grad_norms']\"),"
                " d = c.width / c.clientWidth, w = c.width, px = c.getContext('2d').getImageData(0, Math.floor(y * d), w, 1).data,"
                " out = []; for (let i = 0; i < w; i++) if (px[4 * i] === rgb[0] && px[4 * i + 1] === rgb[1]"
                " && px[4 * i + 2] === rgb[2]) out.push(i / d); return out; }", [y, NONFINITE_RGB])
        m = marks[0]
        hot = reds(m["y"])
        assert hot and all(m["x"] - m["w"] / 2 - 1 <= x <= m["x"] + m["w"] / 2 + 1 for x in hot), (hot, m)
        rows = json.loads(cv.get_attribute("data-rows") or "[]")
        other = next(i for i, r in enumerate(rows) if r.get("name") == "a")
        assert reds(m["y"] + (other - m["row"]) * m["h"]) == []
        # the tensor's gradient-norm chart ticks that bucket; another tensor's chart ticks nothing
        for name, want in ((BAD, [hm["x0"][col]]), ("a", [])):
            page.select_option("#layer-select", name)
            chart = page.locator("canvas[data-plot='layer:grad_norm']")
            assert json.loads(chart.get_attribute("data-bad") or "null") == want, name
        # this test's own pixel reads make chromium suggest willReadFrequently; the page's problems are the point
        assert [p for p in problems if "willReadFrequently" not in p] == [], problems
    finally:
        page.close()
