"""The report as a dashboard (issue 26): where two runs part, the run table, smoothing, shared zoom
and hover, sys/* in their own section, empty sections folded, value distributions over time and
tensors grouped by block and kind. Pure-data checks first, then the pages in one headless
Chromium (set up as in test_report.py)."""

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
from stepdump.analysis.report_dist import QUANTILES, sample_quantiles, stat_bands
from stepdump.analysis.report_groups import kind_of, tensor_groups
from stepdump.analysis.report_overlay import build_overlay_data
from stepdump.render.html import render_report

STEPS, BUMP = 20, 7  # run B's lr goes from 1e-2 to 5e-2 at update BUMP


def _pair_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two runs equal up to update BUMP, where B's lr changes; profiled (sys/* scalars)."""
    root = tmp_path_factory.mktemp("dash")
    paths = []
    for name, lr in (("a", 1e-2), ("b", 5e-2)):
        model, opt = _pair_model()

        def before(t: int, model: nn.Module, opt: torch.optim.Optimizer, lr: float = lr) -> None:
            if t >= BUMP:
                for g in opt.param_groups:
                    g["lr"] = lr
        paths.append(record_run(root / name, steps=STEPS, model=model, opt=opt, before_step=before, profile=True,
                                metadata={"batch_size": 16}))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def pair_data(pair: tuple[Path, Path]) -> dict[str, Any]:
    with stepdump.open(pair[0]) as a, stepdump.open(pair[1]) as b:
        return build_overlay_data([a, b], ["a", "b"])


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")  # installed with the test extras; the import is slow elsewhere
    from tiny_gpt2 import tiny_gpt2, token_dataset

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_dataset(4)
    path = tmp_path_factory.mktemp("gpt2") / "run"
    with stepdump.Recorder(path, model, opt) as rec:
        for t in range(3):
            opt.zero_grad()
            loss = model(input_ids=data[t]["input_ids"][None], labels=data[t]["labels"][None]).loss
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    return path


# -- data -------------------------------------------------------------------------------------
def test_comparison_data_names_where_and_what(pair: tuple[Path, Path], pair_data: dict[str, Any]) -> None:
    with stepdump.open(pair[0]) as a, stepdump.open(pair[1]) as b:
        want = stepdump.diff(a, b)
    (div,) = pair_data["divergence"]
    assert div["step"] == want.first_step == BUMP and div["reading"] == want.reading and "lr" in div["cause"]
    charts = {c["id"]: c for c in pair_data["scalars"]}
    assert charts["lr"]["diff"][0]["first_differs"] == BUMP      # the lr itself, at the update it changed
    assert charts["loss"]["diff"][0]["first_differs"] == BUMP + 1  # the loss, one update later
    d = charts["lr"]["diff"][0]
    assert all(y == 0 for x, y in zip(d["x"], d["y"]) if x < BUMP) and min(d["y"]) == pytest.approx(1e-2 - 5e-2)
    assert {c["id"]: c["section"] for c in pair_data["scalars"]} == {
        "loss": "scalars", "lr": "scalars", "sys/iter_ms": "sys", "sys/peak_mem_mb": "sys", "sys/recorder_bg_ms": "sys",
        "sys/recorder_hooks_ms": "sys", "sys/recorder_ms": "sys", "sys/recorder_wait_ms": "sys"}
    rows = {r["key"]: r for r in pair_data["run_table"]}
    assert rows["lr (first, last)"]["differs"] and rows["lr (first, last)"]["values"] == ["0.01, 0.01", "0.01, 0.05"]
    for same in ("torch_version", "cpu_capability", "blas", "metadata batch_size", "param group 0 momentum", "capture"):
        assert not rows[same]["differs"], same
    for nd in pair_data["norm_diff"]:  # equal norms (exact 0) up to where the tensors part
        hm = nd["heatmap"]
        first = BUMP + 1  # update BUMP's grads are equal (same params); params and grads part after it
        cols = [max(v or 0 for v in col) for col in zip(*hm["values"])]
        assert all(c == 0 for c in cols[:first]) and cols[first] > 0, (nd["kind"], cols)


@pytest.mark.parametrize("name,kind", [
    ("transformer.h.3.attn.c_attn.weight", "attention"), ("transformer.h.3.mlp.c_proj.weight", "mlp"),
    ("transformer.h.3.ln_1.bias", "norm"), ("transformer.wte.weight", "embedding"), ("lm_head.weight", "head"),
    ("model.layers.5.self_attn.q_proj.weight", "attention"), ("model.layers.5.mlp.gate_proj.weight", "mlp"),
    ("model.layers.5.input_layernorm.weight", "norm"), ("model.embed_tokens.weight", "embedding"),
    ("bert.encoder.layer.2.attention.output.dense.weight", "attention"),
    ("bert.encoder.layer.2.intermediate.dense.weight", "mlp"), ("layer1.0.bn1.weight", "norm"),
    ("blocks.4.norm1.weight", "norm"), ("blocks.4.attn.qkv.weight", "attention"), ("blocks.4.mlp.fc1.weight", "mlp"),
    ("0.weight", "other"), ("encoder.weird_thing.weight", "other"),
])
def test_kind_of_names(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_groups_keep_blocks_in_model_order() -> None:
    names = [f"h.{i}.{p}" for i in (0, 1, 2, 10, 11) for p in ("attn.w", "mlp.w")] + ["wte.weight", "ln_f.weight"]
    names = names[-2:-1] + names[:-2] + names[-1:]  # wte first, as a model registers it
    g = tensor_groups(names, embeddings=["wte.weight"])
    assert g["blocks"] == ["wte", "h.0", "h.1", "h.2", "h.10", "h.11", "ln_f"]
    assert g["order"][:3] == ["wte.weight", "h.0.attn.w", "h.0.mlp.w"] and sorted(g["order"]) == sorted(names)
    assert g["kind"]["wte.weight"] == "embedding" and g["block"]["h.10.mlp.w"] == "h.10"


def test_distributions_from_stats_and_stored_tensors(pair: tuple[Path, Path]) -> None:
    with stepdump.open(pair[0]) as run:
        stats = run.stats()
        full = stat_bands(run, "grads", 1000)
        few = stat_bands(run, "grads", 4)
        q = sample_quantiles(run, "params", max_steps=5)
        tensor = run.tensor("0.weight", q["steps"][2] if q else 0)
    assert full is not None and few is not None and q is not None
    g = stats[(stats["kind"] == "grads") & (stats["name"] == "0.weight")]
    k = full["names"].index("0.weight")
    np.testing.assert_array_equal(full["min"][k], g["min"].to_numpy())
    np.testing.assert_array_equal(full["max"][k], g["max"].to_numpy())
    assert len(few["x0"]) == 4 and few["x0"][0] == 0 and few["x1"][-1] == STEPS - 1
    assert few["max"][k].max() == g["max"].max() and few["min"][k].min() == g["min"].min()  # envelope exact
    assert len(q["steps"]) == 5 and q["sampled"] == []  # small tensors: exact quantiles
    want = torch.quantile(tensor.double().reshape(-1), torch.tensor(QUANTILES, dtype=torch.float64)).numpy()
    np.testing.assert_array_equal(q["q"][:, q["names"].index("0.weight"), 2], want)


def test_large_tensors_give_strided_sample_quantiles(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(300, 300)
    path = record_run(tmp_path / "big", steps=2, model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1),
                      batch=lambda t: (torch.randn(4, 300), torch.randn(4, 300)))
    with stepdump.open(path) as run:
        q = sample_quantiles(run, "params", sample=1000)
        w = run.tensor("weight", q["steps"][0]).reshape(-1)[::90].double()
    assert q["sampled"] == ["weight"]
    want = torch.quantile(w, torch.tensor(QUANTILES, dtype=torch.float64)).numpy()
    np.testing.assert_array_equal(q["q"][:, 0, 0], want)


# -- the pages ---------------------------------------------------------------------------------
_CANVASES = """() => [...document.querySelectorAll('canvas[data-plot]')].map(c => ({id: c.dataset.plot,
    domain: JSON.parse(c.dataset.domain), divergence: JSON.parse(c.dataset.divergence || "null"),
    section: c.closest('section').id, drawn: +c.dataset.drawn}))"""


def _ema(ys: list[float], w: float) -> list[float]:
    out, last = [], 0.0
    for n, v in enumerate(ys, 1):
        last = last * w + (1 - w) * v
        out.append(last / (1 - w**n))
    return out


def test_comparison_page(pair_data: dict[str, Any], tmp_path: Path, browser: Any) -> None:
    out = tmp_path / "cmp.html"
    out.write_text(render_report(pair_data), encoding="utf-8")
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        charts = page.evaluate(_CANVASES)
        # The step diff names is marked on every chart, heatmaps included, and said in words.
        assert len(charts) >= 15
        for c in charts:
            assert [d["step"] for d in (c["divergence"] or [])] == [BUMP], c
        assert page.get_attribute("#divergence p.diverge", "data-step") == str(BUMP)
        assert f"step {BUMP}" in page.inner_text("#divergence")
        # The run table highlights the lr (and only what differs).
        differs = page.eval_on_selector_all("table.run-table tr.differs", "rs => rs.map(r => r.dataset.key)")
        assert differs == ["lr (first, last)"]
        bg = page.eval_on_selector("table.run-table tr.differs td", "td => getComputedStyle(td).backgroundColor")
        same_bg = page.eval_on_selector("table.run-table tr[data-key='torch_version'] td", "td => getComputedStyle(td).backgroundColor")
        assert bg != same_bg
        # sys/* in their own section, none among the user's scalars; difference curves beside them.
        sections = {c["id"]: c["section"] for c in charts}
        assert {k for k, v in sections.items() if v == "sys" and k.startswith("scalar:")} == {
            "scalar:sys/iter_ms", "scalar:sys/peak_mem_mb", "scalar:sys/recorder_bg_ms",
            "scalar:sys/recorder_hooks_ms", "scalar:sys/recorder_ms", "scalar:sys/recorder_wait_ms"}
        assert not any(k.startswith("scalar:sys") for k, v in sections.items() if v == "scalars")
        assert sections["diff:lr"] == "scalars" and sections["norm_diff:grads@1"] == "compare"
        # No NaN/Inf and no skipped step: the timeline is one line, not a chart.
        assert page.eval_on_selector("#nonfinite", "s => s.classList.contains('collapsed') && !s.querySelector('canvas')")

        # Smoothing: the loss is drawn as the EMA of its points (TensorBoard's), the raw line faint.
        raw = page.evaluate("() => document.querySelector(\"canvas[data-plot='scalar:loss']\")._sd.series[0]")
        assert raw["ys"] == raw["y"]
        page.eval_on_selector("#smoothing", "e => { e.value = '0.9'; e.dispatchEvent(new Event('input')); }")
        sm = page.evaluate("() => document.querySelector(\"canvas[data-plot='scalar:loss']\")._sd.series[0]")
        assert sm["y"] == raw["y"] and sm["ys"] == pytest.approx(_ema(raw["y"], 0.9), rel=1e-12)
        assert sm["px"] != raw["px"]  # the path drawn moved
        assert page.get_attribute("canvas[data-plot='scalar:loss']", "data-smooth") == "0.9"

        # Hover one chart: every visible chart shows a read-out at that step.
        cv = page.locator("canvas[data-plot='scalar:loss']")
        box = cv.bounding_box()
        x_of = lambda s: 58 + (box["width"] - 70) * (s + 0.5) / (STEPS + 1)  # noqa: E731  SMALL margins
        cv.hover(position={"x": x_of(10), "y": 60})
        lr_read = page.get_attribute("canvas[data-overlay-for='scalar:lr']", "data-readout")
        assert "step 10 " in lr_read and "a: lr: 0.01" in lr_read and "b: lr: 0.05" in lr_read

        # Zoom: drag across the loss chart; every chart shows the same steps.
        box = cv.bounding_box()  # where it is now that hovering scrolled it into view
        page.mouse.move(box["x"] + x_of(4), box["y"] + 60)
        page.mouse.down()
        page.mouse.move(box["x"] + x_of(8), box["y"] + 60, steps=4)
        page.mouse.move(box["x"] + x_of(12), box["y"] + 60, steps=4)
        page.mouse.up()
        zoomed = page.evaluate(_CANVASES)
        lo, hi = zoomed[0]["domain"]
        assert 4 <= lo <= 5 and 12 <= hi <= 13, (lo, hi)
        assert all(c["domain"] == [lo, hi] for c in zoomed)
        ticks = json.loads(page.get_attribute("canvas[data-plot='scalar:lr']", "data-xticks"))
        assert ticks and all(lo - 1 <= t <= hi for t in ticks)
        cv.dblclick(position={"x": x_of(10), "y": 60})
        assert all(c["domain"] == [0, STEPS + 1] for c in page.evaluate(_CANVASES))

        # Time axes: relative seconds from each run's step commit times.
        page.select_option("#x-axis", "rel")
        rel_ticks = json.loads(page.get_attribute("canvas[data-plot='scalar:loss']", "data-xticks"))
        assert rel_ticks and all(str(t).endswith(("s", "m", "h")) for t in rel_ticks)
    finally:
        page.close()
    assert problems == []


def test_gpt2_page_groups_layers(gpt2_run: Path, tmp_path: Path, browser: Any) -> None:
    with stepdump.open(gpt2_run) as run:
        data = build_report_data(run, findings=[])
    groups = data["groups"]
    assert groups["blocks"] == ["transformer", "transformer.h.0", "transformer.h.1"]
    out = tmp_path / "gpt2.html"
    out.write_text(render_report(data), encoding="utf-8")
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        rows = json.loads(page.get_attribute("canvas[data-plot='grad_norms']", "data-rows"))
        headers = [r for r in rows if "block" in r]
        assert [(h["block"], h["tensors"]) for h in headers] == [("transformer", 4), ("transformer.h.0", 12),
                                                                  ("transformer.h.1", 12)]
        kinds = {r["name"]: r["kind"] for r in rows if "name" in r}
        assert kinds["transformer.h.1.attn.c_attn.weight"] == "attention" and kinds["transformer.wte.weight"] == "embedding"
        assert kinds["transformer.h.0.mlp.c_fc.bias"] == "mlp" and kinds["transformer.h.0.ln_2.weight"] == "norm"
        page.locator("canvas[data-plot='grad_norms']").locator("xpath=..").locator("button[data-fold='1']").click()
        folded = json.loads(page.get_attribute("canvas[data-plot='grad_norms']", "data-rows"))
        assert folded == headers  # one row per block, the max over its tensors
        drawn = int(page.get_attribute("canvas[data-plot='grad_norms']", "data-drawn"))
        assert drawn > 0
        optgroups = page.eval_on_selector_all("#layer-select optgroup", "gs => gs.map(g => [g.label, g.children.length])")
        assert optgroups == [["transformer", 4], ["transformer.h.0", 12], ["transformer.h.1", 12]]
        # Per-tensor value distribution (stats bands and quantiles of the stored tensors) for the picked tensor.
        page.select_option("#layer-select", "transformer.h.0.attn.c_attn.weight")
        for pid in ("layer:dist:params", "layer:quantiles:params", "layer:dist:grads", "layer:quantiles:grads"):
            assert page.get_attribute(f"canvas[data-plot='{pid}']", "data-tensor") == "transformer.h.0.attn.c_attn.weight"
            assert int(page.get_attribute(f"canvas[data-plot='{pid}']", "data-drawn")) > 0
    finally:
        page.close()
    assert problems == []
