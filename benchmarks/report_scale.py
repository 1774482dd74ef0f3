"""Report build time, page size and first-view time at scale (issue 26 item 5).

Records a synthetic stats-only run (``--tensors`` small parameters x ``--steps`` optimizer
steps, named like a transformer's blocks, with a spike and a NaN planted), then times
``build_report_data`` + ``render_report`` and, when Debian's chromium and playwright are there,
how long the page takes to draw its first view. Prints one line per number and writes them
into its section of benchmarks/RESULTS.md (``--out``; ``--out ''`` writes nothing).

    python benchmarks/report_scale.py                             # make bench: 300 x 200, under a minute
    python benchmarks/report_scale.py --tensors 300 --steps 5000  # the size docs/report.md reports (~10 min)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from datetime import datetime, timezone

from torch import nn

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.render.html import render_report

HERE = Path(__file__).resolve().parent
MARKER = "\n## Report at scale"


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


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    body = path.read_text() if path.exists() else "# stepdump benchmarks: results\n"
    if MARKER in body:
        start = body.index(MARKER)
        nxt = body.find("\n## ", start + len(MARKER))
        body = body[:start] + (body[nxt:] if nxt != -1 else "")
    path.write_text(body.rstrip("\n") + "\n" + text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="RESULTS.md to update ('' for none)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        t = time.perf_counter()
        record(run_dir, args.tensors, args.steps)
        recorded = time.perf_counter() - t
        print(f"record: {recorded:.1f} s ({args.tensors} tensors x {args.steps} steps, stats only)")
        with stepdump.open(run_dir) as run:
            t, c = time.perf_counter(), time.process_time()
            data = build_report_data(run, findings=[])
            built, built_cpu = time.perf_counter() - t, time.process_time() - c
            t = time.perf_counter()
            html = render_report(data)
            rendered = time.perf_counter() - t
        out = Path(d) / "report.html"
        out.write_text(html, encoding="utf-8")
        mib = len(html.encode()) / 2**20
        print(f"build_report_data: {built:.2f} s (CPU {built_cpu:.2f} s); render_report: {rendered:.2f} s; "
              f"page: {mib:.1f} MiB")
        view = first_view_s(out)
        print("first view in chromium: " + ("n/a" if view is None else f"{view:.2f} s"))
    if args.out:
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        update("report_scale", {"tensors": args.tensors, "steps": args.steps, "record_s": recorded,
                                "build_s": built, "build_cpu_s": built_cpu, "render_s": rendered,
                                "page_mib": mib, "first_view_s": view}, Path(args.out).with_name("results.json"))
        load_after = os.getloadavg()
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        write_section(Path(args.out), "\n".join([
            "",
            "## Report at scale (issue 26)",
            "",
            f"`benchmarks/report_scale.py --tensors {args.tensors} --steps {args.steps}`, {date}, "
            f"{os.cpu_count()} cores, {platform.machine()}; load average before / after: "
            f"{' '.join(f'{v:.2f}' for v in load_before)} / {' '.join(f'{v:.2f}' for v in load_after)}. "
            "A stats-only run (params and grads of small tensors named in blocks, a spike and a NaN "
            "planted); docs/report.md has the 300 x 5,000 numbers.",
            "",
            "| what | result |",
            "|---|---:|",
            f"| record ({args.tensors} tensors x {args.steps} steps, stats only) | {recorded:.1f} s |",
            f"| `build_report_data` wall (CPU) | {built:.2f} s ({built_cpu:.2f} s) |",
            f"| `render_report` | {rendered:.2f} s |",
            f"| page size | {mib:.2f} MiB |",
            "| first view in headless Chromium (load to `data-ready`) | "
            + ("n/a (no chromium/playwright)" if view is None else f"{view:.2f} s") + " |",
            "",
        ]))


if __name__ == "__main__":
    main()
