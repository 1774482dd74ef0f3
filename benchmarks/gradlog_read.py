"""Issue 25 item 3: a gradient-log read against the optimizer steps it re-applies (workload A).

For each K (default 16, 32, 100) one run of workload A is recorded with ``gradient_log=K`` over
K steps (keyframe 0, then K - 1 steps whose params are rebuilt). Then, interleaved in one
process (the order flips every repeat, each pair gives one ratio):

* **read K-1**: ``stepdump.open(run)`` + ``run.state_dict(K - 1)`` on a fresh Run (the farthest
  step from its keyframe: reads the keyframe, re-applies K - 1 updates, checks the result);
* **read in order**: a fresh Run, ``run.state_dict(s)`` for every s in 0 .. K - 1 (the cached
  rebuild goes on from the step before: K - 1 updates in all, each step checked);
* **optimizer**: K ``optimizer.step()`` calls of the same Adam over the same model, grads set
  (the optimizer's own time; what training would spend on them).

Ratios are read / optimizer, the median of the per-pair ratios with their spread. The rebuilt
params at K - 1 are compared bitwise with the training's, and the number of updates the
in-order read applied is reported (K - 1 when it goes on from the cache).

    .venv/bin/python benchmarks/gradlog_read.py                       # writes its RESULTS.md section
    .venv/bin/python benchmarks/gradlog_read.py --ks 16 --repeats 2 --out /tmp/x/RESULTS.md

Timings on a loaded machine are not trustworthy: the load average before and after is printed
and written beside the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import workloads  # benchmarks/ is sys.path[0] when run as a script

import stepdump

HERE = Path(__file__).resolve().parent
MARKER = "## Gradient-log reads (issue 25)"


def record(path: Path, k: int) -> dict[str, torch.Tensor]:
    """Workload A under ``gradient_log=k`` for k steps; the model's state_dict at the start of step k - 1."""
    w = workloads.mlp()
    for _ in range(2):  # the optimizer state exists before the first keyframe, as in leave_on_gradlog.py
        w.step(None)
    snap: dict[str, torch.Tensor] = {}
    with stepdump.Recorder(path, w.model, w.optimizer, gradient_log=k):
        for i in range(k):
            if i == k - 1:
                snap = {n: v.detach().clone() for n, v in w.model.state_dict().items()}
            w.step(None)
    return snap


class Clock:
    """Wall time, and CPU time of this thread and of the whole process (the read's worker
    included): on a machine loaded by other work the CPU times are the steadier measure."""

    def __enter__(self) -> Clock:
        self._t = (time.perf_counter(), time.thread_time(), time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        self.wall, self.thread_cpu, self.cpu = (b - a for a, b in zip(self._t, now, strict=True))


def time_optimizer(k: int) -> Clock:
    """k ``optimizer.step()`` calls of workload A's Adam (grads from one backward)."""
    w = workloads.mlp()
    w.step(None)  # grads and Adam state exist
    with Clock() as c:
        for _ in range(k):
            w.optimizer.step()
    return c


def read_last(path: Path, k: int) -> tuple[Clock, dict[str, torch.Tensor]]:
    with Clock() as c:
        run = stepdump.open(path)
        sd = run.state_dict(k - 1)
    run.close()
    return c, dict(sd)


def read_in_order(path: Path, k: int) -> tuple[Clock, int]:
    with Clock() as c:
        run = stepdump.open(path)
        for s in range(k):
            run.state_dict(s)
    engine = getattr(run, "gradient_log", None)  # a local Run of a gradient log has one
    applied = engine.updates_applied if engine is not None else -1
    run.close()
    return c, applied


def bench_k(work: Path, k: int, repeats: int) -> dict[str, Any]:
    path = work / f"k{k}"
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    snap = record(path, k)
    print(f"K={k}: recorded {k} steps of A in {time.perf_counter() - t:.1f} s", flush=True)
    opt: list[Clock] = []
    last: list[Clock] = []
    order: list[Clock] = []
    equal = True
    applied = -1
    for rep in range(repeats):
        arms = ["opt", "last", "order"] if rep % 2 == 0 else ["order", "last", "opt"]
        for arm in arms:
            if arm == "opt":
                opt.append(time_optimizer(k))
            elif arm == "last":
                took, sd = read_last(path, k)
                last.append(took)
                equal = equal and sd.keys() == snap.keys() and all(torch.equal(sd[n], snap[n]) for n in sd)
            else:
                took, applied = read_in_order(path, k)
                order.append(took)
        print(f"  repeat {rep}: optimizer x{k} {opt[-1].wall * 1e3:.0f} ms (CPU {opt[-1].thread_cpu * 1e3:.0f}), "
              f"open + state_dict({k - 1}) {last[-1].wall * 1e3:.0f} ms (CPU this thread "
              f"{last[-1].thread_cpu * 1e3:.0f}, all {last[-1].cpu * 1e3:.0f}), every step in order "
              f"{order[-1].wall * 1e3:.0f} ms (CPU {order[-1].thread_cpu * 1e3:.0f}, all {order[-1].cpu * 1e3:.0f})",
              flush=True)
    shutil.rmtree(path, ignore_errors=True)

    def ratios(arm: list[Clock], what: str) -> list[float]:
        return sorted(getattr(a, what) / getattr(b, what) for a, b in zip(arm, opt, strict=True))

    out: dict[str, Any] = {"K": k, "repeats": repeats, "bitwise_equal": equal, "in_order_updates": applied}
    measured: list[tuple[str, list[Clock]]] = [("opt", opt), ("read", last), ("in_order", order)]
    for name, clocks in measured:
        out[f"{name}_ms"] = [c.wall * 1e3 for c in clocks]
        out[f"{name}_thread_cpu_ms"] = [c.thread_cpu * 1e3 for c in clocks]
        out[f"{name}_cpu_ms"] = [c.cpu * 1e3 for c in clocks]
        if name == "opt":
            continue
        for what, key in (("wall", "ratio"), ("thread_cpu", "thread_cpu_ratio"), ("cpu", "cpu_ratio")):
            r = ratios(clocks, what)
            out[f"{name}_{key}"], out[f"{name}_{key}_spread"] = statistics.median(r), [r[0], r[-1]]
    print(f"  read {out['read_ratio']:.3f}x wall, {out['read_thread_cpu_ratio']:.3f}x CPU of the reading thread, "
          f"{out['read_cpu_ratio']:.3f}x CPU of both; in order {out['in_order_ratio']:.3f}x wall, "
          f"{out['in_order_thread_cpu_ratio']:.3f}x, {out['in_order_cpu_ratio']:.3f}x; bitwise equal {equal}; "
          f"in-order updates {applied} (K - 1 = {k - 1})", flush=True)
    return out


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="16,32,100", help="comma-separated K of gradient_log=K")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per K (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as run.py)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory on disk (default: a temporary one)")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="RESULTS.md to update ('' for none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(v) for v in args.ks.split(",") if v.strip()]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.work) as d:
        rows = [bench_k(Path(d), k, args.repeats) for k in ks]
    load_after = os.getloadavg()
    if not args.out:
        return
    from results_json import update

    update("gradlog_read", {"rows": rows, "threads": args.threads, "load_before": load_before,
                            "load_after": load_after}, Path(args.out).with_name("results.json"))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "",
        MARKER,
        "",
        f"`benchmarks/gradlog_read.py --ks {args.ks} --repeats {args.repeats}`, {date}, {os.cpu_count()} cores, "
        f"{platform.machine()}, torch threads {args.threads}; load average before / after: "
        f"{' '.join(f'{v:.2f}' for v in load_before)} / {' '.join(f'{v:.2f}' for v in load_after)}. "
        "Workload A recorded with `gradient_log=K` over K steps; interleaved in one process: a fresh "
        "`stepdump.open` + `state_dict(K-1)` (K-1 updates re-applied and checked), a fresh Run reading "
        "`state_dict(s)` for every s in 0..K-1 in order, and K `optimizer.step()` calls of the same Adam. "
        "Ratio: read / optimizer, median of the per-pair ratios (spread); wall time, and CPU time of the "
        "reading thread and of the whole process (the read's worker thread included), steadier than wall "
        "time when other work loads the machine.",
        "",
        "| K | K × optimizer.step(): wall (CPU) | open + state_dict(K-1): wall | ratio: wall / reading-thread CPU "
        "/ all CPU | every step in order: wall | ratio: wall / reading-thread CPU / all CPU | updates in order "
        "| bitwise |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]

    def med(r: dict[str, Any], key: str) -> str:
        return f"{statistics.median(r[key]):.0f} ms"

    def ratio(r: dict[str, Any], arm: str) -> str:
        lo, hi = r[f"{arm}_ratio_spread"]
        return (f"{r[f'{arm}_ratio']:.3f}× ({lo:.3f}–{hi:.3f}) / {r[f'{arm}_thread_cpu_ratio']:.3f}× / "
                f"{r[f'{arm}_cpu_ratio']:.3f}×")

    for r in rows:
        lines.append(
            f"| {r['K']} | {med(r, 'opt_ms')} ({med(r, 'opt_thread_cpu_ms')}) | {med(r, 'read_ms')} | "
            f"{ratio(r, 'read')} | {med(r, 'in_order_ms')} | {ratio(r, 'in_order')} | "
            f"{r['in_order_updates']} | {'yes' if r['bitwise_equal'] else 'NO'} |")
    lines.append("")
    write_section(Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    main()
