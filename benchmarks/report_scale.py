"""Report build time, page size and first-view time at scale (issue 26 item 5).

Records a synthetic stats-only run (``--tensors`` small parameters x ``--steps`` optimizer
steps, named like a transformer's blocks, with a spike and a NaN planted), then times
``build_report_data`` + ``render_report`` and, when Debian's chromium and playwright are there,
how long the page takes to draw its first view. Prints one line per number.

    python benchmarks/report_scale.py --tensors 300 --steps 5000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.render.html import render_report


def record(path: Path, tensors: int, steps: int) -> None:
    torch.manual_seed(0)
    per_block = 6
    model = nn.ParameterDict()
    names = []
    for i in range(tensors):
        b, k = divmod(i, per_block)
        names.append(f"h_{b}_" + ("attn_w", "attn_b", "mlp_w", "mlp_b", "ln_w", "ln_b")[k])
    for n in names:
        model[n] = nn.Parameter(torch.randn(16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1, capture=("params", "grads")) as rec:
        for s in range(steps):
            for j, p in enumerate(model.values()):
                p.grad = torch.full((16,), 0.01 * (1 + (s + j) % 7))
            if s == steps // 3:
                next(iter(model.values())).grad[0] = 1e4
            opt.step()
            rec.log(loss=1.0 / (1 + s) if s != steps // 2 else float("nan"))


def first_view_s(html: Path) -> float | None:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path(exe).exists():
        return None
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = b.new_page(viewport={"width": 1280, "height": 900})
        t = time.perf_counter()
        page.goto(html.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        took = time.perf_counter() - t
        b.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--steps", type=int, default=5000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        t = time.perf_counter()
        record(run_dir, args.tensors, args.steps)
        print(f"record: {time.perf_counter() - t:.1f} s ({args.tensors} tensors x {args.steps} steps, stats only)")
        with stepdump.open(run_dir) as run:
            t = time.perf_counter()
            data = build_report_data(run, findings=[])
            built = time.perf_counter() - t
            t = time.perf_counter()
            html = render_report(data)
            rendered = time.perf_counter() - t
        out = Path(d) / "report.html"
        out.write_text(html, encoding="utf-8")
        print(f"build_report_data: {built:.2f} s; render_report: {rendered:.2f} s; page: {len(html.encode()) / 2**20:.1f} MiB")
        view = first_view_s(out)
        print("first view in chromium: " + ("n/a" if view is None else f"{view:.2f} s"))


if __name__ == "__main__":
    main()
