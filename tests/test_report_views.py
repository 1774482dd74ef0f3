"""The report a user reads (issue 15): log scale where a spike would flatten the curve, tensor
names cut from the middle, per-tensor curves with a selector, one chart per quantity however many
names it is logged under, several runs overlaid, and charts that skip what a lean step did not
measure. Pure-data checks first, then the page in headless Chromium (set up as in test_report.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import open_page, record_run, tiny_batch, tiny_model
from torch import nn

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.analysis.report_scalars import group_scalars, wants_log
from stepdump.cli.main import main
from stepdump.render.html import write_report

STEPS, SPIKE = 30, 17
LONG = "encoder_stack_with_a_long_descriptive_name"  # names longer than any label column


def _series(values: list[float], start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(start, start + len(values), dtype=np.int64), np.array(values, dtype=np.float64)


# -- data -----------------------------------------------------------------------------------
def test_scalar_groups_fold_equal_and_next_step_copies_only() -> None:
    lr = [1e-3 * 0.9**t for t in range(10)]
    groups = group_scalars({
        "loss": _series([2.0, 1.5, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),
        "lr": _series(lr), "lr/1": _series(lr),
        "learning_rate": _series(lr[1:] + [lr[-1] * 0.9]),   # a Trainer's: logged after the scheduler step
        "lr_sparse": (np.array([0, 5]), np.array([lr[0], lr[5]])),  # the same rate, logged less often
        "lr_other": _series([x * 1.0000001 for x in lr]),          # close is not equal
    })
    by_name = {g.name: g for g in groups}
    assert [g.name for g in groups] == ["loss", "lr", "lr_other"]  # loss first, learning rates next
    assert by_name["lr"].aliases == ["lr/1", "lr_sparse"] and by_name["lr"].shifted == ["learning_rate"]
    assert by_name["lr"].title() == "lr = lr/1 = lr_sparse = learning_rate (one step later)"
    assert "learning_rate at step t equals lr at step t+1" in by_name["lr"].note
    assert by_name["loss"].aliases == [] and by_name["lr_other"].aliases == []


def test_log_scale_is_chosen_for_spikes_and_decades_only() -> None:
    smooth = np.linspace(2.0, 0.5, 100)
    spiky = smooth.copy()
    spiky[40] = 60.0
    assert not wants_log(smooth)                         # a linear axis shows it well
    assert wants_log(spiky)                              # the spike would flatten the rest
    assert wants_log(np.logspace(0, -3, 50))             # three decades
    assert not wants_log(np.where(np.arange(100) == 40, -60.0, smooth))  # not positive: no log axis
    assert wants_log(np.append(spiky, np.nan))           # a NaN does not decide it


def test_lean_run_charts_have_no_values_where_nothing_was_measured(tmp_path: Path) -> None:
    # Lean steps read optimizer state every 10th step only, and leave mean/std/zero fraction of
    # large tensors unmeasured (NULL): the report must have no point there, never a 0.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 64), nn.GELU(), nn.Linear(64, 4))  # 5120 > 4096 elements
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = record_run(tmp_path / "lean", steps=STEPS, model=model, opt=opt,
                      batch=lambda t: (torch.randn(8, 80, generator=torch.Generator().manual_seed(t)),
                                       torch.randn(8, 4, generator=torch.Generator().manual_seed(t + 99))),
                      every=None, stats_every=1)
    with stepdump.open(path) as run:
        stats = run.stats()
        data = build_report_data(run, findings=[])
    big = stats[(stats["name"] == "0.weight") & (stats["kind"] == "grads")]
    assert big["mean"].isna().any(), "precondition: lean steps leave the big tensor's mean unmeasured"
    for m in data["moments"]:
        assert m["x"] and all(x % 10 == 0 for x in m["x"]), m["x"]  # only where state was read
        assert all(v is not None and v > 0 for v in m["y"])
    hm = data["grad_norms"]
    row = hm["values"][hm["names"].index("0.weight")]
    assert hm["x0"] == list(range(STEPS)) and all(v is not None and v > 0 for v in row)
    assert data["param_norms"]["names"] == hm["names"]


# -- runs for the page -------------------------------------------------------------------------
class Deep(nn.Module):
    """A tiny MLP whose parameter names are long (nested containers with long keys)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleDict({LONG: nn.ModuleDict({"attention_output_projection": nn.Linear(8, 16)})})
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.blocks[LONG]["attention_output_projection"](x)))


LONG_NAME = f"blocks.{LONG}.attention_output_projection.weight"


@pytest.fixture(scope="module")
def hf_like_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two param groups (lr and lr/1 equal), a decaying schedule, ``learning_rate`` logged after
    the scheduler step as a HF Trainer does, a loss spike at SPIKE."""
    model = Deep()
    opt = torch.optim.SGD([{"params": model.blocks.parameters()}, {"params": model.head.parameters()}], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t)

    def log(t: int, loss: torch.Tensor) -> dict[str, Any]:
        return {"loss": float(loss.detach()) * (200.0 if t == SPIKE else 1.0), "learning_rate": sched.get_last_lr()[0]}

    return record_run(tmp_path_factory.mktemp("views") / "hf", steps=STEPS, model=model, opt=opt, scheduler=sched,
                      batch=tiny_batch, log=log)


def _plot(page: Any, plot_id: str) -> dict[str, Any]:
    return page.evaluate("""id => { const c = document.querySelector(`canvas[data-plot="${id}"]`); if (!c) return null;
        return {log: c.dataset.log, series: JSON.parse(c.dataset.series || "null"), range: JSON.parse(c.dataset.range || "null"),
                labels: JSON.parse(c.dataset.labels || "null"), tensor: c.dataset.tensor || null, drawn: +c.dataset.drawn}; }""",
                         plot_id)


def _plots(page: Any) -> list[str]:
    return page.evaluate("() => [...document.querySelectorAll('canvas[data-plot]')].map(c => c.dataset.plot)")


# -- the page --------------------------------------------------------------------------------
def test_page_reads_well_log_scale_labels_one_lr_chart_and_layer_selector(hf_like_run: Path, tmp_path: Path,
                                                                          browser: Any) -> None:
    with stepdump.open(hf_like_run) as run:
        out = write_report(run, tmp_path / "r.html", findings=[])
        stats, domain = run.stats(), len(run.all_steps)  # steps 0..29 and the final record
    grads = stats[stats["kind"] == "grads"]
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        # Log scale by default on the spiky loss, and the toggle turns it off.
        loss = _plot(page, "scalar:loss")
        assert loss["log"] == "1" and page.is_checked("input[data-log-for='scalar:loss']")
        page.uncheck("input[data-log-for='scalar:loss']")
        assert _plot(page, "scalar:loss")["log"] == "0"

        # lr, lr/1 and the Trainer's learning_rate: one chart, naming all three.
        plots = _plots(page)
        assert [p for p in plots if p.startswith("scalar:") and "lr" in p or "learning_rate" in p] == ["scalar:lr"]
        title = page.locator("canvas[data-plot='scalar:lr']").locator("xpath=..").locator(".card-title").inner_text()
        assert "lr/1" in title and "learning_rate" in title and "one step later" in title

        # Long tensor names: cut in the middle (head and tail kept), never from the left; full on hover.
        labels = _plot(page, "grad_norms")["labels"]
        cut = labels[0]
        assert cut != LONG_NAME and "…" in cut, cut
        head, tail = cut.split("…")
        assert LONG_NAME.startswith(head) and LONG_NAME.endswith(tail) and len(head) >= 8 and tail.endswith(".weight")
        heat = page.locator("canvas[data-plot='grad_norms']")
        heat.hover(position={"x": 20, "y": 14 + 4})  # the label column, first row
        assert page.inner_text("#tip") == LONG_NAME

        # The per-tensor selector switches all three charts to the chosen tensor, drawing its values.
        names = page.eval_on_selector_all("#layer-select option", "os => os.map(o => o.value)")
        assert names == ["blocks." + LONG + ".attention_output_projection.weight",
                         "blocks." + LONG + ".attention_output_projection.bias", "head.weight", "head.bias"]
        assert _plot(page, "layer:grad_norm")["tensor"] == names[0]
        for name in (names[2], names[1]):
            page.select_option("#layer-select", name)
            for pid in ("layer:grad_norm", "layer:param_norm", "layer:update_ratio"):
                assert _plot(page, pid)["tensor"] == name
            want = grads[grads["name"] == name]["norm"]
            lo, hi = _plot(page, "layer:grad_norm")["range"]
            assert lo == pytest.approx(want.min(), rel=1e-3) and hi == pytest.approx(want.max(), rel=1e-3)
        # Clicking a heatmap row picks that tensor too.
        heat.click(position={"x": 400, "y": 14 + 2 * (heat.bounding_box()["height"] - 14 - 54) / 4 + 3})
        assert page.input_value("#layer-select") == "head.weight"

        # Trainer step numbering: hover says global_step t + 1 (stepdump's t counts from 0).
        page.select_option("#step-numbering", "1")
        cv = page.locator("canvas[data-plot='scalar:loss']")
        box = cv.bounding_box()
        cv.hover(position={"x": 58 + (box["width"] - 70) * (SPIKE + 0.5) / domain, "y": 60})
        assert f"global_step {SPIKE + 1} (step {SPIKE})" in page.inner_text("#tip")
    finally:
        page.close()
    assert problems == []


def test_two_runs_overlaid_from_the_cli(tmp_path: Path, browser: Any) -> None:
    runs = []
    for name, lr in (("base", 1e-2), ("fast", 5e-2)):
        model = tiny_model()
        runs.append(record_run(tmp_path / name, steps=12 if name == "base" else 15, model=model,
                               opt=torch.optim.Adam(model.parameters(), lr=lr)))
    out = tmp_path / "both.html"
    assert main(["report", str(runs[0]), str(runs[1]), "--label", "baseline", "--label", "fast lr", "-o", str(out)]) == 0
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        loss = _plot(page, "scalar:loss")
        assert loss["series"] == [{"label": "baseline: loss", "points": 12}, {"label": "fast lr: loss", "points": 15}]
        legend = page.locator("canvas[data-plot='scalar:loss']").locator("xpath=..").locator(".legend").inner_text()
        assert "baseline" in legend and "fast lr" in legend
        grad = _plot(page, "layer:grad_norm")
        assert [s["label"].split(":")[0] for s in grad["series"]] == ["baseline", "fast lr"]
        assert [s["points"] for s in grad["series"]] == [12, 15]
        plots = _plots(page)
        assert {"grad_norms@0", "grad_norms@1", "moments:exp_avg"} <= set(plots)
        assert [s["label"] for s in _plot(page, "moments:exp_avg")["series"]] == ["baseline: exp_avg", "fast lr: exp_avg"]
        heads = page.eval_on_selector_all("#summary .run-head", "hs => hs.map(h => h.textContent)")
        assert len(heads) == 2 and "baseline" in heads[0] and "fast lr" in heads[1]
        steps = page.eval_on_selector_all("#summary [data-key='Steps recorded'] dd", "ds => ds.map(d => d.textContent)")
        assert steps[0].startswith("13 ") and steps[1].startswith("16 ")  # + the final record at close()
    finally:
        page.close()
    assert problems == []
    blob = out.read_text(encoding="utf-8").split('id="stepdump-data">', 1)[1].split("</script>", 1)[0]
    assert [r["label"] for r in json.loads(blob)["runs"]] == ["baseline", "fast lr"]
