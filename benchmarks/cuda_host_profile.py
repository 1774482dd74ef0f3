"""Where a lean GPU step's host time goes: the training thread's Python, per step (docs/cuda.md).

On a GPU the lean step's device work is one fused kernel (~2 ms on GPT-2 small, on the side
stream); what the recorder costs the training thread is its Python: the step's entry list, the
device pack's launch and heads, the hooks. This script records GPT-2 small
(``tests_gpu/cuda_workloads.Gpt2Small``; bf16 autocast, fused AdamW) lean (``every=None,
stats_every=1``) and prints, per step:

* ``sys/recorder_ms`` as the run stored it (the training thread's own timing of the hooks);
* wall-clock timers around the recorder's parts on the training thread (per step, unprofiled:
  ``perf_counter`` around each, nested parts inside their callers);
* a cProfile over ``--steps`` lean steps (every thread: Python 3.12 profiles them all; profiling
  inflates Python calls and counts waits for the GIL: read the shares, not the absolute ms).

Not part of ``make bench`` (this machine has no GPU)::

    .venv/bin/python benchmarks/cuda_host_profile.py            # on a machine with CUDA

Without CUDA it runs the same model at toy width on the CPU (``--cpu``, the CPU lean path: a
different path, for the shared parts only: entries, hooks, scalars).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests_gpu")]

import stepdump  # noqa: E402
from cuda_workloads import Gpt2Small  # noqa: E402
from stepdump.capture import assemble, device_pack, recorder, staging  # noqa: E402

# (owner, attribute, label): the parts timed on the training thread
PARTS = (
    (recorder.Recorder, "capture", "pre-hook: Recorder.capture"),
    (recorder.Recorder, "_record_step", "  _record_step"),
    (assemble.Assembler, "fill", "    Assembler.fill"),
    (assemble.Assembler, "entries", "      entries (params, grads, optimizer state)"),
    (staging.Stager, "stage", "      Stager.stage"),
    (device_pack.DeviceLean, "prepare", "        DeviceLean.prepare (layout read, compared)"),
    (staging.Stager, "_stage_device_lean", "        _stage_device_lean"),
    (device_pack.Prepared, "launch", "          Prepared.launch (kernels, host copy)"),
    (recorder.Recorder, "end_step", "post-hook: Recorder.end_step"),
)


def timed_parts() -> tuple[dict[str, list[float]], list[tuple[object, str, object]]]:
    """Wrap PARTS with perf_counter timers (training thread only: each records where it runs)."""
    import threading

    main = threading.get_ident()
    spent: dict[str, list[float]] = {label: [0.0, 0.0, 0] for _, _, label in PARTS}
    undo = []
    for owner, attr, label in PARTS:
        real = getattr(owner, attr)
        undo.append((owner, attr, real))

        def wrapper(*a, __real=real, __label=label, **k):  # type: ignore[no-untyped-def]
            if threading.get_ident() != main:
                return __real(*a, **k)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return __real(*a, **k)
            finally:
                spent[__label][0] += time.perf_counter() - t0
                spent[__label][1] += time.thread_time() - c0  # its own CPU: not the waits for the GIL
                spent[__label][2] += 1

        setattr(owner, attr, wrapper)
    return spent, undo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    if cuda:
        model, batch, seq, vocab = Gpt2Small().to(dev), 8, 1024, 50257
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        model, batch, seq, vocab = Gpt2Small(vocab=64, d=32, heads=2, block=16), 2, 16, 64
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (batch, seq), device=dev)

    cpu_ms: dict[str, float] = {}  # the training thread's own CPU per step of the last run(n, label)

    def run(n: int, label: str = "") -> float:
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            opt.zero_grad()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(idx[:, :-1])
            nn.functional.cross_entropy(logits.float().reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        cpu_ms[label] = (time.thread_time() - c0) / n * 1000
        return (time.perf_counter() - t0) / n * 1000

    run(3)
    plain = run(args.steps, "plain")
    root = Path(tempfile.mkdtemp(prefix="stepdump-hostprof-"))
    with stepdump.Recorder(root / "run", model, opt, every=None, stats_every=1, on_error="raise"):
        run(3)
        lean = run(args.steps, "lean")
        spent, undo = timed_parts()
        timed = run(args.steps)
        for owner, attr, real in undo:
            setattr(owner, attr, real)
        prof = cProfile.Profile()
        prof.enable()
        run(args.steps)
        prof.disable()
    with stepdump.open(root / "run") as rec:
        own = rec.scalars("sys/recorder_ms")["sys/recorder_ms"]
        parts = rec.profile().iloc[3:3 + args.steps].median(numeric_only=True)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}")
    print(f"plain {plain:.2f} ms/step, lean {lean:.2f} ms/step ({lean / plain:.3f}x); "
          f"sys/recorder_ms median {float(own.iloc[3:3 + args.steps].median()):.3f} ms (unprofiled steps)")
    print(f"the training thread's own CPU per step: plain {cpu_ms['plain']:.2f} ms, lean {cpu_ms['lean']:.2f} ms "
          "(wall minus CPU: its waits, for the GPU or the GIL)")
    print("the self-timing's parts, medians of the unprofiled lean steps (ms): "
          + ", ".join(f"{k} {float(v):.3f}" for k, v in parts.items()))
    print(f"timers over {args.steps} lean steps ({timed:.2f} ms/step with them), ms per step, wall and the "
          "training thread's own CPU (the difference: waiting, for the GIL or the GPU):")
    for label, (total, cpu, calls) in spent.items():
        print(f"  {label:52s} {total / args.steps * 1e3:7.3f} {cpu / args.steps * 1e3:7.3f}  "
              f"({calls / args.steps:g} calls a step)")
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats("stepdump|torch/cuda|triton", args.top)
    print(f"cProfile of {args.steps} lean steps (divide by {args.steps} for per step):")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
