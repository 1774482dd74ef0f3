"""How big and how slow is ``stepdump report`` on a long, wide run?

Builds a stats-only run of STEPS steps x TENSORS parameters (Adam, so three
optimizer series per parameter) without training: a real Recorder records the
first steps (so meta, layout and series are exactly what the library writes),
then the remaining steps' stats rows are appended straight into the catalog,
because recording ~1,000 tiny tensors' stats per step costs ~0.1-0.2 s a step
on CPU (torch per-op overhead), i.e. most of an hour for 10,000 steps.

Usage: python benchmarks/report_scale.py [RUN_DIR] [--steps 10000] [--tensors 200] [--html report.html]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import stepdump
from stepdump.store.catalog import CatalogWriter

REAL_STEPS = 3


def build_run(path: Path, steps: int, tensors: int, seed: int = 0) -> Path:
    """Write a stats-only run of ``steps`` x ``tensors`` parameters to ``path``."""
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(tensors)])
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1) as rec:
        for s in range(REAL_STEPS):
            for p in model:
                p.grad = torch.randn(4)
            opt.step()
            rec.log(loss=2.0)
    rng = np.random.default_rng(seed)
    cat = CatalogWriter(path)
    try:
        sid = {(k, n): i for i, k, n in cat.con.execute("SELECT id, kind, name FROM series")}
        names = [f"{i}" for i in range(tensors)]
        scale = 1.0 + np.arange(tensors) / tensors
        spike_step, nan_step, skip_step = steps // 3, steps // 2, (2 * steps) // 3
        fp = 0
        for s in range(REAL_STEPS, steps):
            gnorm = rng.lognormal(0.0, 0.3, tensors) * scale * (1.0 + 3.0 / (1 + s / 500))
            if s == spike_step:
                gnorm[7] *= 1e3
            pnorm = 2.0 + 0.001 * s + rng.normal(0, 0.01, tensors)
            rows = []
            for i, n in enumerate(names):
                fp += 1
                nan = 1 if (s == nan_step and i == 3) else 0
                stats = (4, 0, 0, 0, -1.0, 1.0, 0.0, 0.5)
                rows.append((sid["params", n], s, "float32", "4", None, *stats, float(pnorm[i]), 0.0, fp))
                g = (4, nan, 0, 0, -1.0, 1.0, 0.0, 0.5)
                rows.append((sid["grads", n], s, "float32", "4", None, *g, float(gnorm[i]), 0.0, fp))
                rows.append((sid["optimizer", f"{n}.step"], s, "float32", "", None, 1, 0, 0, 0,
                             float(s), float(s), float(s), 0.0, float(s), 0.0, fp))
                m = float(gnorm[i]) * 0.1
                rows.append((sid["optimizer", f"{n}.exp_avg"], s, "float32", "4", None, *stats, m, 0.0, fp))
                rows.append((sid["optimizer", f"{n}.exp_avg_sq"], s, "float32", "4", None, *stats, m * m, 0.0, fp))
            cat.add_tensors(rows)
            cat.add_step(s, 1, s == skip_step, None)
            loss = 2.0 / (1 + s / 1000) + 0.05 * rng.normal() + (10.0 if s == spike_step else 0.0)
            cat.add_scalars([(s, "loss", loss), (s, "lr", 1e-3 * min(1.0, s / 1000))])
            if s % 500 == 0:
                cat.commit()
    finally:
        cat.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", default="report-scale-run")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--html", default="report-scale.html")
    a = ap.parse_args()
    path = Path(a.run)
    if not path.exists():
        t = time.perf_counter()
        build_run(path, a.steps, a.tensors)
        print(f"built {a.steps} x {a.tensors} run in {time.perf_counter() - t:.1f} s")
    from stepdump.analysis.report import build_report_data
    from stepdump.render.html import render_report

    run = stepdump.open(path)
    t = time.perf_counter()
    data = build_report_data(run, findings=None)
    t_data = time.perf_counter() - t
    t = time.perf_counter()
    html = render_report(data)
    t_html = time.perf_counter() - t
    Path(a.html).write_text(html, encoding="utf-8")
    print(f"build_report_data {t_data:.2f} s, render_report {t_html:.2f} s, html {len(html.encode()) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
