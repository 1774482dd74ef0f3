"""What durability="fsync" costs over "flush": time per training step, small and ~8M-param models.

Every step is recorded in full (params, grads, Adam state: four tensors per
parameter), with the default raw codec, on the disk that holds the scratch
directory. Per-step time is wall time over the timed steps (after warm-up),
so it includes any wait for the writer (backpressure). "none" is the same loop
without a Recorder. Results go to stdout as a Markdown table (docs/reliability.md
quotes them).

    .venv/bin/python benchmarks/durability.py [--small-steps 300] [--big-steps 25] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import stepdump


def make(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "small":  # ~9K params: recording cost is all per-step overhead
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
        x, y = torch.randn(32, 64), torch.randn(32, 8)
    else:  # ~8.4M params: 32 MB of float32 per tensor kind, ~134 MB recorded per step
        model = nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048))
        x, y = torch.randn(16, 2048), torch.randn(16, 2048)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), x, y


def per_step_ms(kind: str, mode: str, steps: int, warmup: int, work: Path) -> float:
    model, opt, x, y = make(kind)
    run_dir = work / f"{kind}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    rec = None if mode == "none" else stepdump.Recorder(run_dir, model, opt, durability=mode)
    try:
        for t in range(warmup + steps):
            if t == warmup:
                started = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if rec is not None:
                rec.log(loss=loss)
        if rec is not None:
            rec.close()  # the last steps' writes are part of the cost
        elapsed = time.perf_counter() - started
    finally:
        if rec is not None:
            rec.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 1000 * elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-steps", type=int, default=300)
    ap.add_argument("--big-steps", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (on the disk to measure)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="stepdump-durability-", dir=os.getcwd()))
    work.mkdir(parents=True, exist_ok=True)
    fs = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    print(f"# durability: {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"scratch on {fs[0]} ({fs[1]}), {args.threads} intra-op thread(s), median of {args.repeats}")
    rows = []
    for kind, steps in (("small", args.small_steps), ("big", args.big_steps)):
        model, *_ = make(kind)
        n = sum(p.numel() for p in model.parameters())
        res = {}
        for mode in ("none", "flush", "fsync"):
            times = [per_step_ms(kind, mode, steps, 3, work) for _ in range(args.repeats)]
            res[mode] = statistics.median(times)
            print(f"  {kind} {mode}: {', '.join(f'{t:.2f}' for t in times)} ms/step", flush=True)
        rows.append((kind, n, steps, res))
    print()
    print("| model | params | MB recorded/step | no Recorder | flush | fsync | fsync / flush |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, n, steps, res in rows:
        mb = n * 4 * 4 / 1e6
        print(f"| {kind} | {n:,} | {mb:.2f} | {res['none']:.2f} ms | {res['flush']:.2f} ms | {res['fsync']:.2f} ms "
              f"| {res['fsync'] / res['flush']:.2f}x |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
