"""Report build time, memory, page size and first-view time at scale (issue 26 item 5).

Writes a synthetic stats-only run (``--tensors`` small parameters x ``--steps`` optimizer
steps, named like a transformer's blocks, with a spike and a NaN planted: ``synth_run.py``, the
first steps recorded for real and the rest generated with numpy into stat chunks, as a lean
recording stores them), then, in a fresh process (so its peak RSS is the report's, not the
generator's), times ``build_report_data`` (wall and CPU) + ``render_report``, and, when Debian's
chromium and playwright are there, how long the page takes to draw its first view (load to
``data-ready``; the per-tensor sections of a large page are still undecoded then, the script
checks and reports how many) and to decode and draw the gradient heatmap when scrolled to.
Prints one line per number and writes them into its section of benchmarks/RESULTS.md and
results.json (``--out``; ``--out ''`` writes nothing). The run lives in a temporary directory,
deleted at the end (500 x 100,000 is ~10 GB of catalog).

    python benchmarks/report_scale.py                    # make bench: issue 26's 500 x 100,000 (~10 GB, ~15 min here)
    python benchmarks/report_scale.py --steps 20000 --out ''   # a fifth of the rows, the same page shape

Where the temporary directory has too little free space for the size asked, it says so and
measures the largest number of steps that fits.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

from datetime import datetime, timezone

import stepdump
from stepdump.analysis.report import build_report_data
from stepdump.render.html import render_report
from synth_run import synth_run  # benchmarks/ is sys.path[0] when run as a script

HERE = Path(__file__).resolve().parent
MARKER = "\n## Report at scale"
# Issue 26's size: a 100,000-step, 500-tensor run (~10 GiB of catalog, deleted after).
STEPS = 100_000
# Catalog bytes per stats row of synth_run's run (measured: 4.4 GiB for 100 M rows in stat chunks, with
# random fingerprints; 10.1 GiB as tensors rows): the space check keeps the row layout's margin.
BYTES_PER_ROW = 110


def record(path: Path, tensors: int, steps: int) -> None:
    """The run: a spike a third of the way in, a NaN half way (see synth_run.py)."""
    synth_run(path, tensors, steps, spike=steps // 3, nan_step=steps // 2)


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM (Linux), which a new program starts afresh; ru_maxrss
    elsewhere (on Linux it carries the parent's peak across the exec of a spawned process)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(run_dir: str, out: str) -> tuple[float, float, float, float, float]:
    """In a fresh process: build and render the report of ``run_dir`` into ``out``. Returns (build
    wall s, build CPU s, render s, peak RSS MiB after the imports, peak RSS MiB at the end)."""
    before = peak_rss_mib()
    with stepdump.open(run_dir) as run:
        t, c = time.perf_counter(), time.process_time()
        data = build_report_data(run, findings=[])
        built, built_cpu = time.perf_counter() - t, time.process_time() - c
        t = time.perf_counter()
        html = render_report(data)
        rendered = time.perf_counter() - t
    Path(out).write_text(html, encoding="utf-8")
    return built, built_cpu, rendered, before, peak_rss_mib()


def first_view_s(html: Path) -> tuple[float, int, float] | None:
    """(seconds from navigation to data-ready, sections still undecoded then, seconds to decode and
    draw the gradient heatmap once scrolled to), or None without chromium/playwright."""
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
        pending = page.locator("section[data-lazy='pending']").count()
        t = time.perf_counter()
        page.locator("#grad-norms").scroll_into_view_if_needed()
        page.wait_for_selector("#grad-heatmap canvas", timeout=120_000)
        decode = time.perf_counter() - t
        b.close()
    return took, pending, decode


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="RESULTS.md to update ('' for none)")
    ap.add_argument("--run", help="a run synth_run.py wrote before with these --tensors and --steps: time its "
                                  "report instead of writing one (the run is kept)")
    ap.add_argument("--written-s", type=float, help="with --run: the wall seconds writing it took, as measured then")
    args = ap.parse_args()
    if args.run:
        measure(args, Path(args.run), None if args.written_s is None else (args.written_s, None), os.getloadavg())
        return
    need = args.tensors * args.steps * BYTES_PER_ROW * 1.3  # the catalog, and room for its rebuilt index
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < need:  # say so, and measure the largest size that fits rather than fill the disk
        fits = max(1000, int(free / (args.tensors * BYTES_PER_ROW * 1.3)) // 1000 * 1000)
        print(f"report_scale: {args.tensors} x {args.steps} needs ~{need / 2**30:.0f} GiB in {tempfile.gettempdir()}, "
              f"{free / 2**30:.0f} GiB free: measuring {args.tensors} x {fits} instead")
        args.steps = fits
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        t, c = time.perf_counter(), time.process_time()
        record(run_dir, args.tensors, args.steps)
        recorded, recorded_cpu = time.perf_counter() - t, time.process_time() - c
        measure(args, run_dir, (recorded, recorded_cpu), load_before)


def _written(recorded: float | None, cpu: float | None) -> str:
    if recorded is None:
        return "written before, not timed"
    return f"{recorded:.1f} s" + (f" (CPU {cpu:.1f} s)" if cpu is not None else " (written before, by --run's writer)")


def measure(args: argparse.Namespace, run_dir: Path, recorded_s: tuple[float, float | None] | None,
            load_before: tuple[float, float, float]) -> None:
    """Build, render and view the report of ``run_dir``; print and store the numbers.
    ``recorded_s``: (wall, CPU or None) seconds writing the run took; None: not known."""
    recorded, recorded_cpu = recorded_s if recorded_s is not None else (None, None)
    catalog_mib = sum(f.stat().st_size for f in run_dir.iterdir() if f.is_file()) / 2**20
    print(f"record: {_written(recorded, recorded_cpu)}; {args.tensors} tensors x {args.steps} steps, stats only, "
          f"{catalog_mib:.0f} MiB")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.html"
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            built, built_cpu, rendered, rss_before, rss_peak = pool.apply(build, (str(run_dir), str(out)))
        mib = out.stat().st_size / 2**20
        print(f"build_report_data: {built:.2f} s (CPU {built_cpu:.2f} s), peak RSS {rss_peak:.0f} MiB "
              f"({rss_before:.0f} MiB after imports); render_report: {rendered:.2f} s; page: {mib:.1f} MiB")
        seen = first_view_s(out)
        view = None if seen is None else seen[0]
        print("first view in chromium: " + ("n/a" if seen is None else
                                             f"{seen[0]:.2f} s ({seen[1]} sections not decoded yet); gradient "
                                             f"heatmap decoded and drawn {seen[2]:.2f} s after scrolling to it"))
    if args.out:
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        update("report_scale", {"tensors": args.tensors, "steps": args.steps, "record_s": recorded,
                                "record_cpu_s": recorded_cpu, "catalog_mib": catalog_mib,
                                "build_s": built, "build_cpu_s": built_cpu, "build_peak_rss_mib": rss_peak,
                                "rss_after_imports_mib": rss_before, "render_s": rendered,
                                "page_mib": mib, "first_view_s": view,
                                "lazy_pending": None if seen is None else seen[1],
                                "heatmap_decode_s": None if seen is None else seen[2]},
               Path(args.out).with_name("results.json"))
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
            "planted), written by benchmarks/synth_run.py (first steps recorded, the rest generated with numpy "
            "into stat chunks, as a lean recording stores them: FORMAT.md \"Stat chunks\").",
            "",
            "| what | result |",
            "|---|---:|",
            f"| write the run ({args.tensors} tensors x {args.steps} steps, stats only, synth_run.py) | "
            + _written(recorded, recorded_cpu) + f", {catalog_mib:.0f} MiB |",
            f"| `build_report_data` wall (CPU) | {built:.2f} s ({built_cpu:.2f} s) |",
            f"| peak RSS of the process that built and rendered it (after imports) | {rss_peak:.0f} MiB ({rss_before:.0f} MiB) |",
            f"| `render_report` | {rendered:.2f} s |",
            f"| page size | {mib:.2f} MiB |",
            "| first view in headless Chromium (load to `data-ready`) | "
            + ("n/a (no chromium/playwright)" if seen is None else f"{seen[0]:.2f} s ({seen[1]} sections not decoded)")
            + " |",
            "| gradient heatmap decoded and drawn after scrolling to it | "
            + ("n/a" if seen is None else f"{seen[2]:.2f} s") + " |",
            "",
            f"Issue 40 targets: built in <= 60 s **{'pass' if built <= 60 else 'FAIL'}** ({built:.1f} s), page open "
            + ("< 2 s n/a" if seen is None else f"< 2 s **{'pass' if seen[0] < 2 else 'FAIL'}** ({seen[0]:.2f} s)")
            + ". Before: 117.6 s on the same run in the row layout (a `tensors` row per tensor per step, "
            "2026-11-29), 285.4 s on 2026-11-25.",
            "",
        ]))


if __name__ == "__main__":
    main()
