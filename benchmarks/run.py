"""`make bench`: stepdump side by side with the ways people record training today.

    .venv/bin/python benchmarks/run.py            # the full run, writes benchmarks/RESULTS.md
    .venv/bin/python benchmarks/run.py --quick    # a smoke run with few steps

See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import baselines  # noqa: E402
import readside  # noqa: E402
import report  # noqa: E402
import results_json  # noqa: E402
import stepdump_ways as sw  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402
from measure import Result, settle, spare_core_check, time_recording  # noqa: E402

log = logging.getLogger("bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per way of recording (default 30)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each (default 2)")
    ap.add_argument("--probe", type=int, default=3,
                    help="unrecorded steps timed right before each row as a local reference (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 steps, small read-side runs, no repeats")
    ap.add_argument("--workloads", default="A,B", help="comma-separated: A (MLP), B (GPT-style)")
    ap.add_argument("--batch-b", type=int, default=2, help="batch size of workload B (default 2)")
    ap.add_argument("--json-steps", type=int, default=1,
                    help="steps timed for JSON of tolist() (taken as its per-step figure; default 1, it is slow)")
    ap.add_argument("--all-codecs", action="store_true", help="time every codec in CODEC_NAMES, not only "
                    + ", ".join(sw.DEFAULT_CODECS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: see README, 'Why one torch thread')")
    ap.add_argument("--no-read", action="store_true", help="skip the read-side and long-run benchmarks")
    ap.add_argument("--read-steps", type=int, default=1000, help="steps of the random-read run (default 1000)")
    ap.add_argument("--read-d", type=int, default=512, help="width of its Linear(d, d) (default 512)")
    ap.add_argument("--stats-steps", type=int, default=10000, help="steps of the stats-series run (default 10000)")
    ap.add_argument("--work", type=Path, default=HERE / "_work", help="scratch directory (emptied)")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="where to write the results")
    ap.add_argument("--json", type=Path, default=None, help="also dump raw numbers as JSON here")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 6)
        a.warmup = 1
        a.probe = 1
        a.json_steps = 1
        a.read_steps = min(a.read_steps, 200)
        a.read_d = min(a.read_d, 256)
        a.stats_steps = min(a.stats_steps, 1000)
    if a.steps < 1 or a.warmup < 1:
        ap.error("--steps and --warmup must be at least 1 (warm-up creates the optimizer state)")
    return a


Maker = Callable[[workloads.Workload, Path], Any]


def plan(args: argparse.Namespace, codecs: list[str]) -> list[tuple[str, str, str, Maker, int | None]]:
    """(key, label, group, make_recording, steps or None) in the order they run.

    Cheap baselines run several times, spread over the sequence (start, middle,
    end), so that drift in the machine's load shows up in them and their median
    is a fair reference. Repeats share a key; their times are pooled.
    """
    repeat = not args.quick
    sd = sw.StepdumpRecording
    p: list[tuple[str, str, str, Maker, int | None]] = []

    def add(key: str, label: str, group: str, maker: Maker, steps: int | None = None) -> None:
        p.append((key, label, group, maker, steps))

    add("none", "no recording", "baseline", baselines.NoRecording)
    add("copy", "floor: copy_ into preallocated buffers", "floor", baselines.CopyIntoBuffers)
    add("sd-full-raw", "stepdump full every step, raw", "stepdump", functools.partial(sd, **sw.full("raw")))
    add("plain-write", "floor: plain write() of stepdump-raw's bytes, in the loop", "floor", None)  # bytes known later
    add("torch.save", "torch.save (clone + dict per step)", "seed", baselines.TorchSave)
    add("pickle.dump", "pickle.dump (clone + dict per step)", "seed", baselines.PickleDump)
    add("safetensors", "safetensors save_file (clone, flat names)", "seed", baselines.SafetensorsSave)
    add("sd-tiered", "stepdump tiered (every=100, stats_every=1)", "stepdump", functools.partial(sd, **sw.TIERED))
    add("sd-stats", "stepdump stats only (every=None, stats_every=1)", "stepdump",
        functools.partial(sd, **sw.STATS_ONLY))
    if repeat:
        add("none", "no recording", "baseline", baselines.NoRecording)
    for codec in codecs:
        if codec != "raw":
            add(f"sd-full-{codec}", f"stepdump full every step, {codec}", "stepdump",
                functools.partial(sd, **sw.full(codec)))
    add("dcp.save", "torch.distributed.checkpoint.save", "seed", baselines.DcpSave)
    add("dcp.async_save", "torch.distributed.checkpoint.async_save", "seed", baselines.DcpAsyncSave)
    if repeat:
        add("copy", "floor: copy_ into preallocated buffers", "floor", baselines.CopyIntoBuffers)
        add("torch.save", "torch.save (clone + dict per step)", "seed", baselines.TorchSave)
        # The rows the full-every-step targets compare are I/O-bound, and this disk's
        # write speed drifts by 2x within minutes: run them again, interleaved.
        add("sd-full-raw", "stepdump full every step, raw", "stepdump", functools.partial(sd, **sw.full("raw")))
        add("plain-write", "floor: plain write() of stepdump-raw's bytes, in the loop", "floor", None)
        for codec in ("delta-lz4", "blosc-lz4"):
            if codec in codecs:
                add(f"sd-full-{codec}", f"stepdump full every step, {codec}", "stepdump",
                    functools.partial(sd, **sw.full(codec)))
    # Tiered and stats-only run once each here: benchmarks/leave_on.py (also in `make bench`)
    # measures them as interleaved pairs against no recording, which the minute-to-minute
    # drift of this machine does not blur; repeating them here bought less and cost ~40 s.
    add("json", "JSON of tolist() (clone + dict per step)", "seed", baselines.JsonTolist, args.json_steps)
    if repeat:
        add("none", "no recording", "baseline", baselines.NoRecording)
        # third runs of the I/O-bound rows, so their medians shrug off one slow minute
        add("sd-full-raw", "stepdump full every step, raw", "stepdump", functools.partial(sd, **sw.full("raw")))
        add("plain-write", "floor: plain write() of stepdump-raw's bytes, in the loop", "floor", None)
        if "delta-lz4" in codecs:
            add("sd-full-delta-lz4", "stepdump full every step, delta-lz4", "stepdump",
                functools.partial(sd, **sw.full("delta-lz4")))
        add("copy", "floor: copy_ into preallocated buffers", "floor", baselines.CopyIntoBuffers)
        add("none", "no recording", "baseline", baselines.NoRecording)
    return p


# Rows in the table, grouped for reading (the run order above interleaves them).
ROW_ORDER = ["none", "pickle.dump", "torch.save", "safetensors", "json", "dcp.save", "dcp.async_save",
             "copy", "plain-write"]


def bench_workload(name: str, args: argparse.Namespace, codecs: list[str]) -> report.WorkloadReport:
    factory = workloads.WORKLOADS[name]
    make = functools.partial(factory, batch=args.batch_b) if name == "B" else factory
    probe = make()
    probe.step(None)
    tensors = list(probe.tensors())
    record_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    title, n_params, n_tensors = probe.title, probe.n_params(), len(tensors)
    del probe, tensors
    print(f"\n== workload {name}: {title} ({n_params / 1e6:.1f} M params, {record_bytes / 1e6:.1f} MB per record)",
          flush=True)

    alone, loaded = spare_core_check(make, max(3, min(args.steps, 8)), args.warmup)
    print(f"  spare-core check: {alone:.0f} ms/step alone, {loaded:.0f} ms/step beside a busy thread "
          f"({loaded / alone:.2f}×)", flush=True)

    results: dict[str, Result] = {}
    work = args.work / name
    # Untimed: the first row to write gigabytes paid ~1.5-2x for it in every run
    # (stepdump raw, first: 325-370 ms/step; later the same row 178-258), whatever
    # row it was; disk blocks never written before seem to cost more on this VM.
    # Write (and delete) one row's worth first so that no row pays for the order.
    warm = work / "disk-warm-up"
    baselines.write_only(warm, record_bytes, args.steps)
    shutil.rmtree(warm, ignore_errors=True)
    settle()
    for key, label, group, maker, steps in plan(args, codecs):
        steps = steps or args.steps
        r = results.setdefault(key, Result(key, label, group, steps, extrapolated=steps != args.steps))
        if key == "plain-write":
            raw = results.get("sd-full-raw")
            per_step = int(raw.bytes_per_step) if raw and raw.bytes_on_disk else None
            maker = functools.partial(baselines.PlainWrite, bytes_per_step=per_step)
            r.note = "same bytes/step as stepdump raw" if per_step else "tensor bytes only (stepdump raw failed)"
        if key == "json":
            r.note = f"timed on {steps} step(s)"
        try:
            secs, size, probe_ms = time_recording(make, maker, work / key, steps, args.warmup, args.probe)
        except Exception as e:  # noqa: BLE001 - one failing way must not sink the benchmark
            r.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"  {label:60s} FAILED: {r.error}", flush=True)
            log.debug("%s", traceback.format_exc())
            continue
        r.seconds.append(secs)
        r.bytes_on_disk.append(size)
        r.probe_ms.append(probe_ms)
        print(f"  {label:60s} {secs / steps * 1e3:8.1f} ms/step {size / steps / 1e6:9.1f} MB/step"
              f"   (probe {probe_ms:6.1f} ms/step unrecorded)", flush=True)

    # The I/O floor: writing stepdump-raw's bytes per step, no training at all.
    write_only_ms = None
    raw = results.get("sd-full-raw")
    if raw and raw.bytes_on_disk:
        out = work / "write-only"
        try:
            secs = baselines.write_only(out, int(raw.bytes_per_step), args.steps)
            write_only_ms = secs / args.steps * 1e3
            print(f"  {'floor: write() of the same bytes, no training':60s} {write_only_ms:8.1f} ms/step", flush=True)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            settle()

    # Tiered at its steady state: 1 full step per 100, the rest stats-only steps.
    st, fr = results.get("sd-stats"), results.get("sd-full-raw")
    if st and st.seconds and fr and fr.seconds:
        ms = st.ms_per_step + (fr.ms_per_step - st.ms_per_step) / 100
        d = Result("sd-tiered-steady", "stepdump tiered, steady state ‡", "stepdump", 1,
                   note="‡ derived: stats-only ms + (full-raw ms − stats-only ms) / 100")
        d.seconds = [ms / 1e3]
        results[d.key] = d

    order = [k for k in ROW_ORDER if k in results]
    order += [f"sd-full-{c}" for c in codecs if f"sd-full-{c}" in results]
    order += [k for k in ("sd-tiered", "sd-tiered-steady", "sd-stats") if k in results]
    order += [k for k in results if k not in order]
    return report.WorkloadReport(name, title, n_params, n_tensors, record_bytes, results, write_only_ms, order,
                                 spare_core=(alone, loaded))


def bench_readside(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = args.work / "read"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env_threads = args.threads
    try:
        print(f"\n== read side: {args.read_steps}-step full run of Linear({args.read_d},{args.read_d})", flush=True)
        full_dir = work / "full"
        samples = sorted({s for s in (100, 250, 500, 1000, 2000, args.read_steps) if s <= args.read_steps})
        out["full_run"] = readside.run_child("full", args.read_steps, full_dir, args.read_d, samples, env_threads)
        print(f"  recorded in {out['full_run']['seconds']:.1f} s", flush=True)
        out["random_reads"] = readside.time_random_reads(full_dir, picks=50)
        rr = out["random_reads"]
        print(f"  run.tensor at random steps: median {rr['median_ms']:.2f} ms, p95 {rr['p95_ms']:.2f} ms", flush=True)
        shutil.rmtree(full_dir, ignore_errors=True)
        settle()

        # The same run with a delta codec: a read may decode a chain of up to 8 blobs.
        delta_dir = work / "delta"
        out["delta_run"] = readside.run_child("full", args.read_steps, delta_dir, args.read_d, [], env_threads,
                                              codec="delta-lz4")
        out["random_reads_delta"] = readside.time_random_reads(delta_dir, picks=50)
        rr = out["random_reads_delta"]
        print(f"  delta-lz4: recorded in {out['delta_run']['seconds']:.1f} s; run.tensor at random steps: median "
              f"{rr['median_ms']:.2f} ms, p95 {rr['p95_ms']:.2f} ms", flush=True)
        shutil.rmtree(delta_dir, ignore_errors=True)
        settle()

        # Memory: a longer full run of a smaller model, so the RSS curve can flatten out.
        mem_dir = work / "mem"
        mem_steps = args.read_steps if args.quick else 4 * args.read_steps
        samples = sorted({s for s in (100, 500, 1000, 2000, 3000, mem_steps) if s <= mem_steps})
        print(f"== memory: {mem_steps}-step full run of Linear(128,128)", flush=True)
        out["mem_full_run"] = readside.run_child("full", mem_steps, mem_dir, 128, samples, env_threads)
        shutil.rmtree(mem_dir, ignore_errors=True)
        settle()

        print(f"== read side: {args.stats_steps}-step stats-only run of Linear(16,16)", flush=True)
        stats_dir = work / "stats"
        samples = sorted({s for s in (100, 500, 1000, 2000, 5000, 10000, args.stats_steps) if s <= args.stats_steps})
        out["stats_run"] = readside.run_child("stats", args.stats_steps, stats_dir, 16, samples, env_threads)
        print(f"  recorded in {out['stats_run']['seconds']:.1f} s", flush=True)
        out["stats_series"] = readside.time_stats_series(stats_dir, "grads", "weight", repeats=7)
        print(f"  run.stats(kind='grads', name='weight'): median {out['stats_series']['median_ms']:.1f} ms "
              f"({out['stats_series']['rows']} rows)", flush=True)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  read side FAILED: {out['error']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def keep_other_sections(md: str, path: Path) -> str:
    """``md`` plus the sections of the RESULTS.md at ``path`` that other scripts wrote (their ``## ``
    headings are not in ``md``), in their order: running run.py alone must not drop them."""
    if not path.exists():
        return md
    mine = {line for line in md.splitlines() if line.startswith("## ")}
    kept = [part for part in path.read_text().split("\n## ")[1:] if "## " + part.splitlines()[0] not in mine]
    return md.rstrip("\n") + "".join("\n\n## " + part.rstrip("\n") for part in kept) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from stepdump.store.codecs import CODEC_NAMES

    codecs = list(CODEC_NAMES) if args.all_codecs else [c for c in sw.DEFAULT_CODECS if c in CODEC_NAMES]
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_before = report.loadavg()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = report.machine_info(args.threads)
    print(f"stepdump benchmarks, {date}: {info['cores']} cores ({info['cpu']}), torch {info['torch']}, "
          f"{args.threads} torch thread(s), load {load_before}", flush=True)

    reports = [bench_workload(n.strip(), args, codecs) for n in args.workloads.split(",") if n.strip()]
    verdicts = [v for rep in reports for v in report.evaluate_targets(rep, codecs)]
    readres = None if args.no_read else bench_readside(args)
    if readres:
        verdicts += report.readside_targets(readres)
    duration = time.perf_counter() - t_start
    shutil.rmtree(args.work, ignore_errors=True)

    for rep in reports:
        print(f"\n== workload {rep.name}: {rep.title}")
        print(report.text_table(report.table(rep)))
    print("\n== targets")
    for v in verdicts:
        print(f"  [{'PASS' if v.ok else 'FAIL'}] {v.workload}: {v.target}: {v.detail}")
    print(f"\nwall time {duration / 60:.1f} min")

    command = ".venv/bin/python benchmarks/run.py" + ("" if argv is None and len(sys.argv) < 2 else " " + shlex.join(
        argv if argv is not None else sys.argv[1:]))
    settings = {"steps": args.steps, "warm-up": args.warmup, "probe": args.probe, "json steps": args.json_steps,
                "codecs": "/".join(codecs), "batch B": args.batch_b, "read run": f"{args.read_steps} steps",
                "stats run": f"{args.stats_steps} steps"}
    md = report.results_markdown(date=date, info=info, command=command, duration_s=duration,
                                 load_before=load_before, load_after=report.loadavg(), settings=settings,
                                 reports=reports, verdicts=verdicts, readside=readres)
    args.results.write_text(keep_other_sections(md, args.results))
    print(f"wrote {args.results}")
    data = {"date": date, "info": info, "settings": settings, "duration_s": duration,
            "load_before": load_before, "load_after": report.loadavg(),
            "workloads": {r.name: {k: v.to_json() for k, v in r.results.items()} | {"write_only_ms": r.write_only_ms}
                          for r in reports},
            "verdicts": [v.__dict__ for v in verdicts], "readside": readres}
    results_json.update("run", data, args.results.with_name("results.json"))  # beside RESULTS.md
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
