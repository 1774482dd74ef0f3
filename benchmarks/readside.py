"""Long runs and the read side: memory over a long recording, random tensor reads, a stats series.

The long recordings run in a child process (``python benchmarks/readside.py
record ...``) so that their peak RSS is their own, not the benchmark's; the
parent then opens the runs they leave and times reads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def record_child(mode: str, steps: int, out: Path, d: int, samples: list[int], threads: int,
                 codec: str = "raw") -> dict[str, Any]:
    """Record ``steps`` steps of a Linear(d, d) + Adam; sample VmRSS / VmHWM on the way."""
    sys.path.insert(0, str(HERE))
    import torch
    from workloads import tiny_linear

    import stepdump

    torch.set_num_threads(threads)
    w = tiny_linear(d_in=d, d_out=d)
    for _ in range(2):
        w.step(None)
    kwargs = {"every": 1, "stats_every": 1} if mode == "full" else {"every": None, "stats_every": 1}
    kwargs["codec"] = codec
    mem = [{"step": "before Recorder", "rss_kb": _status_kb("VmRSS"), "hwm_kb": _status_kb("VmHWM")}]
    t0 = time.perf_counter()
    rec = stepdump.Recorder(out, w.model, w.optimizer, **kwargs)
    want = set(samples)
    for i in range(1, steps + 1):
        w.step(None)
        rec.log(loss=0.0)
        if i in want:
            mem.append({"step": i, "rss_kb": _status_kb("VmRSS"), "hwm_kb": _status_kb("VmHWM")})
    rec.close()
    seconds = time.perf_counter() - t0
    mem.append({"step": "after close", "rss_kb": _status_kb("VmRSS"), "hwm_kb": _status_kb("VmHWM")})
    return {"mode": mode, "steps": steps, "d": d, "codec": codec, "seconds": seconds, "memory": mem,
            "tensors_per_step": sum(1 for _ in w.tensors()),
            "bytes_per_full_step": sum(t.numel() * t.element_size() for _, t in w.tensors())}


def run_child(mode: str, steps: int, out: Path, d: int, samples: list[int], threads: int,
              codec: str = "raw") -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "record", "--mode", mode, "--steps", str(steps),
           "--out", str(out), "--d", str(d), "--samples", ",".join(map(str, samples)), "--threads", str(threads),
           "--codec", codec]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_random_reads(path: Path, picks: int, seed: int = 0) -> dict[str, Any]:
    """Median / p95 ms of ``run.tensor`` over random (step, kind, name) picks."""
    import stepdump

    t0 = time.perf_counter()
    run = stepdump.open(path)
    open_ms = (time.perf_counter() - t0) * 1e3
    try:
        steps = run.steps
        names = [(k, n) for k in ("params", "grads", "optimizer") for n in run.names(k)]
        rng = random.Random(seed)
        times, nbytes = [], 0
        for _ in range(picks):
            step = rng.choice(steps)
            kind, name = rng.choice(names)
            t = time.perf_counter()
            x = run.tensor(name, step=step, kind=kind)
            times.append((time.perf_counter() - t) * 1e3)
            nbytes += x.numel() * x.element_size()
    finally:
        run.close()
    times.sort()
    return {"open_ms": open_ms, "picks": picks, "steps_in_run": len(steps), "median_ms": statistics.median(times),
            "p95_ms": times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))],
            "max_ms": times[-1], "mean_tensor_kb": nbytes / picks / 1024}


def time_stats_series(path: Path, kind: str, name: str, repeats: int) -> dict[str, Any]:
    """Median ms of ``run.stats(kind=..., name=...)`` (a fresh Run each time, so nothing is cached)."""
    import stepdump

    times, rows = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        run = stepdump.open(path)
        df = run.stats(kind=kind, name=name)
        times.append((time.perf_counter() - t) * 1e3)
        rows = len(df)
        run.close()
    return {"kind": kind, "name": name, "rows": rows, "repeats": repeats,
            "median_ms": statistics.median(times), "min_ms": min(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--mode", choices=("full", "stats"), required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--d", type=int, default=512)
    r.add_argument("--samples", default="100,500,1000")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--codec", default="raw")
    a = ap.parse_args()
    res = record_child(a.mode, a.steps, a.out, a.d, [int(s) for s in a.samples.split(",") if s], a.threads,
                       a.codec)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
