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


def time_optimizer(k: int) -> float:
    """Seconds of k ``optimizer.step()`` calls of workload A's Adam (grads from one backward)."""
    w = workloads.mlp()
    w.step(None)  # grads and Adam state exist
    t = time.perf_counter()
    for _ in range(k):
        w.optimizer.step()
    return time.perf_counter() - t


def read_last(path: Path, k: int) -> tuple[float, dict[str, torch.Tensor]]:
    t = time.perf_counter()
    run = stepdump.open(path)
    sd = run.state_dict(k - 1)
    took = time.perf_counter() - t
    run.close()
    return took, dict(sd)


def read_in_order(path: Path, k: int) -> tuple[float, int]:
    t = time.perf_counter()
    run = stepdump.open(path)
    for s in range(k):
        run.state_dict(s)
    took = time.perf_counter() - t
    applied = run.gradient_log.updates_applied if run.gradient_log is not None else -1
    run.close()
    return took, applied


def bench_k(work: Path, k: int, repeats: int) -> dict[str, Any]:
    path = work / f"k{k}"
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    snap = record(path, k)
    print(f"K={k}: recorded {k} steps of A in {time.perf_counter() - t:.1f} s", flush=True)
    opt: list[float] = []
    last: list[float] = []
    order: list[float] = []
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
        print(f"  repeat {rep}: optimizer x{k} {opt[-1] * 1e3:.0f} ms, open + state_dict({k - 1}) "
              f"{last[-1] * 1e3:.0f} ms, every step in order {order[-1] * 1e3:.0f} ms", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    r_last = sorted(a / b for a, b in zip(last, opt, strict=True))
    r_order = sorted(a / b for a, b in zip(order, opt, strict=True))
    out = {"K": k, "repeats": repeats, "opt_ms": [v * 1e3 for v in opt], "read_ms": [v * 1e3 for v in last],
           "in_order_ms": [v * 1e3 for v in order], "read_ratio": statistics.median(r_last),
           "read_ratio_spread": [r_last[0], r_last[-1]], "in_order_ratio": statistics.median(r_order),
           "in_order_ratio_spread": [r_order[0], r_order[-1]], "bitwise_equal": equal,
           "in_order_updates": applied}
    print(f"  read {out['read_ratio']:.3f}x ({r_last[0]:.3f}-{r_last[-1]:.3f}), in order "
          f"{out['in_order_ratio']:.3f}x ({r_order[0]:.3f}-{r_order[-1]:.3f}); bitwise equal {equal}; "
          f"in-order updates {applied} (K - 1 = {k - 1})", flush=True)
    return out


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
        "Ratio: read / optimizer, median of the per-pair ratios (spread).",
        "",
        "| K | K × optimizer.step() (median) | open + state_dict(K-1) | ratio | every step in order | ratio | "
        "updates in order | bitwise |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['K']} | {statistics.median(r['opt_ms']):.0f} ms | {statistics.median(r['read_ms']):.0f} ms | "
            f"{r['read_ratio']:.3f}× ({r['read_ratio_spread'][0]:.3f}–{r['read_ratio_spread'][1]:.3f}) | "
            f"{statistics.median(r['in_order_ms']):.0f} ms | {r['in_order_ratio']:.3f}× "
            f"({r['in_order_ratio_spread'][0]:.3f}–{r['in_order_ratio_spread'][1]:.3f}) | "
            f"{r['in_order_updates']} | {'yes' if r['bitwise_equal'] else 'NO'} |")
    lines.append("")
    write_section(Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    main()
