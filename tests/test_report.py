"""stepdump report (issue 3, item 5): report data, downsampling, and the page in a real browser.

The browser test drives Debian's chromium through playwright's Python package
(``make install-test`` installs both; never ``playwright install``). It fails,
rather than skips, when either is missing: an untested report is a broken one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import record_run
from torch import nn

import stepdump
from stepdump.analysis.downsample import bucket_max, minmax_downsample
from stepdump.analysis.report import build_report_data
from stepdump.render.html import render_report, write_report

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SPIKE_STEP, SKIP_STEP, MLP_STEPS = 30, 45, 60


# -- runs -------------------------------------------------------------------------------
def _record_tiny(path: Path, steps: int) -> dict[str, float]:
    """Stats-only run of 3 tiny params with planted extremes; returns what was planted."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1) as rec:
        for s in range(steps):
            for p in model:
                p.grad = torch.full((4,), 0.01 * (1 + (s % 7)))
            if s == 277:
                model[1].grad = torch.full((4,), 500.0)  # norm 1000
            opt.step()
            rec.log(loss=1000.0 if s == 123 else (-50.0 if s == 311 else 1.0 / (1 + s)))
    return {"grad_spike": 1000.0, "loss_max": 1000.0, "loss_min": -50.0}


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 real steps of an MLP with Adam and a GradScaler: a loss spike at 30, a skipped inf step at 45."""
    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        return (x * 40 if s == SPIKE_STEP else x), y  # a bad batch: the loss jumps

    def loss(s: int, model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mse = nn.functional.mse_loss(model(b[0]), b[1])
        return mse * float("inf") if s == SKIP_STEP else mse  # inf grads: the scaler skips the step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    return record_run(tmp_path_factory.mktemp("report") / "mlp", steps=MLP_STEPS, model=model,
                      opt=torch.optim.Adam(model.parameters(), lr=3e-3),
                      scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8), batch=batch, loss_fn=loss)


def _digest(path: Path) -> dict[str, str]:
    # -shm is SQLite's shared-memory index, which readers may touch; everything else must not change
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and not p.name.endswith("-shm")}


# -- data ---------------------------------------------------------------------------------
def test_downsample_helpers_keep_extremes_and_leave_inputs_alone() -> None:
    rng = np.random.default_rng(0)
    x = np.arange(10_000)
    y = rng.normal(size=x.size)
    y[1234], y[8765], y[5000] = 50.0, -40.0, np.nan
    y_before = y.copy()
    xs, ys = minmax_downsample(x, y, 300)
    assert len(xs) <= 300 and np.all(np.diff(xs) > 0)
    assert (1234, 50.0) in zip(xs.tolist(), ys.tolist()) and (8765, -40.0) in zip(xs.tolist(), ys.tolist())
    assert 5000 in xs.tolist() and np.isnan(ys[xs.tolist().index(5000)])  # the NaN is drawn as a gap
    np.testing.assert_array_equal(y, y_before)
    m = rng.random((3, 1000))
    m[2, 999], m[1, :] = 99.0, np.nan
    first, last, red = bucket_max(m, 64)
    assert red.shape == (3, 64) and first[0] == 0 and last[-1] == 999 and np.all(first[1:] == last[:-1] + 1)
    assert red[2, -1] == 99.0 and np.all(np.isnan(red[1]))
    np.testing.assert_array_equal(red[0], [m[0, a:b + 1].max() for a, b in zip(first, last)])


def test_report_data_keeps_spikes_and_never_changes_the_run(tmp_path: Path) -> None:
    steps = 400
    planted = _record_tiny(tmp_path / "run", steps)
    with stepdump.open(tmp_path / "run") as run:
        stats_before, scalars_before = run.stats(), run.scalars()
        before = _digest(tmp_path / "run")
        data = build_report_data(run, findings=[], max_points=40)
        pd_equal = stats_before.equals(run.stats()) and scalars_before.equals(run.scalars())
    assert pd_equal
    assert _digest(tmp_path / "run") == before
    json.dumps(data, allow_nan=False)  # JSON-able, no NaN

    loss = next(s for s in data["scalars"] if s["name"] == "loss")
    assert loss["points"] == steps and len(loss["x"]) <= 40
    pts = dict(zip(loss["x"], loss["y"]))
    assert pts[123] == planted["loss_max"] and pts[311] == planted["loss_min"]

    hm = data["grad_norms"]
    assert hm["names"] == ["0", "1", "2"] and hm["steps"] == steps and len(hm["x0"]) <= 40
    assert hm["x0"][0] == 0 and hm["x1"][-1] == steps - 1
    assert all(a == b + 1 for a, b in zip(hm["x0"][1:], hm["x1"][:-1]))  # buckets tile the steps
    col = next(i for i, (a, b) in enumerate(zip(hm["x0"], hm["x1"])) if a <= 277 <= b)
    assert hm["values"][1][col] == pytest.approx(planted["grad_spike"])
    assert max(v for row in hm["values"] for v in row if v is not None) == pytest.approx(planted["grad_spike"])

    ur = data["update_ratio"]  # stats only: the lower bound, labelled as such
    assert ur["exact"] is None and ur["lower_bound"] is not None and "Lower bound" in ur["lower_bound"]["note"]
    assert [m["key"] for m in data["moments"]] == ["momentum_buffer"]
    # steps 0..399 as stats, and the final record 400 (after the last update) in full
    assert data["summary"]["steps_recorded"] == steps + 1 and data["summary"]["full_steps"] == 1


def test_exact_update_ratio_matches_tensors(mlp_run: Path) -> None:
    with stepdump.open(mlp_run) as run:
        data = build_report_data(run, findings=[])
        ex = data["update_ratio"]["exact"]
        assert data["update_ratio"]["lower_bound"] is None  # exact at every step: no bound needed
        assert ex["x0"] == list(range(MLP_STEPS))  # t -> t+1 for every update, the last one into the final record
        t, name = 10, "0.weight"
        a, b = run.tensor(name, t), run.tensor(name, t + 1)
        want = float((b.double() - a.double()).norm() / a.double().norm())
        assert ex["values"][ex["names"].index(name)][t] == pytest.approx(want, rel=1e-9)
        assert all(v == 0 for v in (row[SKIP_STEP] for row in ex["values"]))  # skipped: nothing moved
        assert data["summary"]["skipped_list"] == [SKIP_STEP]
        nf = data["nonfinite"]
        assert nf["skipped_x0"] == [SKIP_STEP] and nf["count"][nf["x0"].index(SKIP_STEP)] > 0


def test_page_is_self_contained_and_escapes_names(mlp_run: Path) -> None:
    with stepdump.open(mlp_run) as run:
        data = build_report_data(run, findings=[])
    data["summary"]["path"] = "x</script><script>alert(1)</script>"
    html = render_report(data)
    assert "<script>alert(1)" not in html
    assert "<link" not in html and not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"https?://", html)
    blob = re.search(r'<script type="application/json" id="stepdump-data">(.*?)</script>', html, re.S)
    assert blob and json.loads(blob.group(1))["runs"][0]["summary"]["path"] == data["summary"]["path"]
    assert json.loads(blob.group(1))["runs"][0]["summary"]["steps_recorded"] == data["summary"]["steps_recorded"]


# -- the page in a browser -----------------------------------------------------------------
def _chromium() -> str:
    exe = os.environ.get("STEPDUMP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(exe).exists():
        pytest.fail(f"chromium not found ({exe}): the report's browser test needs Debian's chromium. "
                    "Run `make install-test` (it runs `apt-get install -y chromium`), or set STEPDUMP_CHROMIUM.")
    return exe


def test_report_renders_in_headless_chromium(mlp_run: Path, tmp_path: Path) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make install-test` (pip install -e '.[test]')")
    exe = _chromium()
    with stepdump.open(mlp_run) as run:
        out = write_report(run, tmp_path / "report.html")
        data = build_report_data(run)  # what the page got, findings included
    url = out.resolve().as_uri()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            problems: list[str] = []
            requests: list[str] = []
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=15_000)
            plots = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('canvas[data-plot]')]
                .map(c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                            let ink = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) ink++;
                            return [c.dataset.plot, {ink, drawn: +c.dataset.drawn, w: c.width, h: c.height}]; }))""")
            steps_text = page.inner_text("#summary [data-key='Steps recorded'] dd")
            finding_rows = page.locator("table.findings tbody tr").count()
            heat = page.locator("canvas[data-plot='grad_norms']")
            heat.hover(position={"x": heat.bounding_box()["width"] * 0.6, "y": 30})
            tip = page.inner_text("#tip") if page.is_visible("#tip") else ""
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()

    assert problems == []
    assert requests == [url], f"the page fetched something besides itself: {requests}"
    expected = {"scalar:loss", "scalar:lr", "grad_norms", "update_ratio:exact", "moments:exp_avg",
                "moments:exp_avg_sq", "nonfinite"}
    assert expected <= set(plots), f"missing plots: {expected - set(plots)}"
    for name, p in plots.items():
        assert p["w"] > 100 and p["h"] > 50, (name, p)
        assert p["ink"] > 500 and p["drawn"] > 0, f"plot {name} drew nothing: {p}"
    assert plots["grad_norms"]["drawn"] >= 4 * 100  # 4 tensors, at least a column per ~10 css px
    assert steps_text.startswith(f"{MLP_STEPS + 1} ") and f"0–{MLP_STEPS}" in steps_text  # + the final record
    assert finding_rows == len(data["findings"])
    if data["checks"] == "ran":
        assert any(f["step"] == SPIKE_STEP for f in data["findings"]), data["findings"]
    assert "grad L2 norm" in tip
    assert (tmp_path / "report.png").stat().st_size > 10_000
