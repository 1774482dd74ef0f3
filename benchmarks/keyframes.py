"""Keyframe mode on workload A (issue 6 targets), appended to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/keyframes.py [--steps 64] [--every 32]

Measures, in one process: bytes on disk of keyframe mode (K=32) against full
recording every step; the time to rebuild the last step by replay against
(steps replayed x plain step time); and that replayed tensors equal a full
recording of the same run bitwise.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import stepdump  # noqa: E402


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)]
    model = nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, b: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = b
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def record(path: Path, steps: int, **kw: object) -> float:
    model, opt = build()
    t0 = time.perf_counter()
    with stepdump.Recorder(path, model, opt, profile=False, **kw) as rec:
        for s in range(steps):
            b = batch(s)
            rec.log_batch(b)
            train_step(model, opt, b)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--every", type=int, default=32)
    ap.add_argument("--full-steps", type=int, default=8, help="steps of the full-every-step reference run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="stepdump-kf-"))
    try:
        full_s = record(work / "full", args.full_steps)
        full_per_step = size(work / "full") / args.full_steps
        kf_s = record(work / "kf", args.steps, keyframe_every=args.every)
        kf_per_step = size(work / "kf") / args.steps
        ratio = kf_per_step / full_per_step

        # plain step time, same code as the replay runs
        model, opt = build()
        times = []
        for s in range(12):
            t0 = time.perf_counter()
            train_step(model, opt, batch(s))
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[2:])

        kf = stepdump.open(work / "kf")
        target = args.steps - 1
        model, opt = build(seed=1)
        t0 = time.perf_counter()
        res = stepdump.replay(kf, target, model, opt, train_step)
        replay_s = time.perf_counter() - t0
        replayed = target - res.keyframe + 1  # the target iteration runs up to its optimizer step
        replay_ratio = replay_s / (replayed * step_s)

        # bitwise: replay a step the full reference run also stored
        full = stepdump.open(work / "full")
        check_step = min(args.full_steps, args.every) - 1
        model, opt = build(seed=2)
        rebuilt = stepdump.replay(kf, check_step, model, opt, train_step)
        equal = all(
            torch.equal(rebuilt.tensor(n, k), full.tensor(n, check_step, k))
            for k in ("params", "grads", "optimizer") for n in full.names(k)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [
        "",
        "## Keyframe mode (workload A, issue 6 targets)",
        "",
        f"`benchmarks/keyframes.py`: K={args.every}, {args.steps} recorded steps; full reference run "
        f"{args.full_steps} steps; torch threads {args.threads}.",
        "",
        "| measure | value | target | result |",
        "|---|---:|---:|---|",
        f"| bytes on disk per step, keyframe / full every step | {kf_per_step / 1e6:.2f} MB / {full_per_step / 1e6:.1f} MB"
        f" = {ratio:.3f}× | ≤ 0.05× | {'pass' if ratio <= 0.05 else 'FAIL'} |",
        f"| rebuild step {target} by replay: time / (steps replayed × plain step) | {replay_s * 1000:.0f} ms / "
        f"({replayed} × {step_s * 1000:.1f} ms) = {replay_ratio:.2f}× | ≤ 1.2× | {'pass' if replay_ratio <= 1.2 else 'FAIL'} |",
        f"| replayed tensors of step {check_step} bitwise equal to the full recording | "
        f"{'yes' if equal else 'NO'} | equal | {'pass' if equal else 'FAIL'} |",
        f"| recording wall time, keyframe / full (per step) | {kf_s / args.steps * 1000:.0f} ms / "
        f"{full_s / args.full_steps * 1000:.0f} ms | – | – |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    if out.exists():
        from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

        replace_section(out, "## Keyframe mode", text)
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        update("keyframes", {"steps": args.steps, "every": args.every, "bytes_ratio": ratio,
                             "replay_ratio": replay_ratio, "replayed_equal": equal,
                             "keyframe_ms_per_step": kf_s / args.steps * 1000,
                             "full_ms_per_step": full_s / args.full_steps * 1000}, out.with_name("results.json"))


if __name__ == "__main__":
    main()
