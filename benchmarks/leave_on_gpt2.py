"""Issue 14, gpt2 piece: peak RSS of a GPT-2-small-sized model, one fresh child process per mode.

A 124 M-parameter GPT-2-style transformer, one unrecorded step, then a few
recorded steps per mode; each mode runs in a fresh child process (peak RSS is
per process), started as ``leave_on.py gpt2-child ...`` (see :func:`child_main`).
Used by ``leave_on.py`` (``--only gpt2``).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from leave_on_lean import LEAN_STATS, LEAN_TIERED
from measure import dir_size, settle
from torch import nn

MB = 1e6
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "leave_on.py"  # the children run as ``leave_on.py gpt2-child ...``


# -- GPT-2-small-sized memory workload ---------------------------------------------------------
class _Block(nn.Module):
    """GPT-2 block: pre-LN, fused QKV, causal SDPA, 4x MLP with GELU."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Small(nn.Module):
    """GPT-2 small's shapes: 12 layers, d_model 768, 12 heads, vocab 50257, 1024 positions,
    LM head tied to the token embedding: 124.4 M parameters."""

    def __init__(self, vocab: int = 50257, d: int = 768, heads: int = 12, layers: int = 12, ctx: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


GPT2_MODES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "none": ("no recording", None),
    "lean-stats": ("lean, stats only (every=None, stats_every=1)", LEAN_STATS),
    "lean-tiered": ("lean tiered (every=100, stats_every=1; step 0 is full)", LEAN_TIERED),
    "full": ("full every step (every=1)", {"every": 1, "stats_every": 1}),
    "gradlog": ("gradient log (gradient_log=100; step 0 is a keyframe)", {"gradient_log": 100}),
}


def _status_kb(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return -1


def gpt2_child(mode: str, steps: int, seq: int, batch: int, threads: int, out: Path) -> dict[str, Any]:
    """Run in a fresh process: build GPT-2 small, one unrecorded step, then ``steps`` recorded ones."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT2Small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 50257), y.reshape(-1))
        loss.backward()
        opt.step()

    step()  # AdamW's state exists before any recording, as in every mode
    res: dict[str, Any] = {"mode": mode, "params": sum(p.numel() for p in model.parameters()),
                           "rss_before_kb": _status_kb("VmRSS"), "hwm_before_kb": _status_kb("VmHWM")}
    # The unrecorded step's peak (AdamW's first step allocates its state and foreach
    # temporaries) can hide what a recorder adds later: reset VmHWM so that the
    # recorded steps' own peak is measured too (Linux: "5" > clear_refs).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        res["hwm_reset"] = True
    except OSError:
        res["hwm_reset"] = False
    kwargs = GPT2_MODES[mode][1]
    rec = None
    if kwargs is not None:
        import stepdump

        rec = stepdump.Recorder(out / "run", model, opt, **kwargs)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if rec is not None:
        rec.close()
    res["ms_per_step"] = (time.perf_counter() - t0) / steps * 1e3
    res["hwm_recorded_kb"] = _status_kb("VmHWM")  # since the reset: Recorder, recorded steps, close()
    res["hwm_kb"] = max(res["hwm_before_kb"], res["hwm_recorded_kb"])  # the whole process
    res["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; also reset by clear_refs
    res["bytes_on_disk"] = dir_size(out) if out.exists() else 0
    return res


def bench_gpt2(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode in a fresh child process (peak RSS is per process); records go to a temp dir on disk."""
    print(f"\n== GPT-2 small (124 M params), seq {args.gpt2_seq}, batch {args.gpt2_batch}, AdamW, "
          f"{args.gpt2_steps} recorded steps per mode, each mode in a fresh process", flush=True)
    results: dict[str, Any] = {"steps": args.gpt2_steps, "seq": args.gpt2_seq, "batch": args.gpt2_batch,
                               "modes": {}}
    for mode in GPT2_MODES:
        # Under /tmp on disk, not /dev/shm: a record there would be counted in RAM.
        tmp = Path(tempfile.mkdtemp(prefix=f"stepdump-gpt2-{mode}-", dir="/tmp"))
        cmd = [sys.executable, str(SCRIPT), "gpt2-child", "--mode", mode,
               "--steps", str(args.gpt2_steps), "--seq", str(args.gpt2_seq), "--batch", str(args.gpt2_batch),
               "--threads", str(args.threads), "--out", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
                results["modes"][mode] = {"mode": mode, "error": f"exit {proc.returncode}: {err}"}
            else:
                results["modes"][mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            settle()
        r = results["modes"][mode]
        print(f"  {GPT2_MODES[mode][0]:60s} " + (r["error"] if "error" in r else
              f"peak {r['hwm_kb'] / 1024:7.0f} MiB (recorded steps {r['hwm_recorded_kb'] / 1024:.0f}, "
              f"unrecorded step {r['hwm_before_kb'] / 1024:.0f}), "
              f"{r['ms_per_step']:6.0f} ms/step, {r['bytes_on_disk'] / args.gpt2_steps / MB:7.1f} MB/step"),
              flush=True)
    return results


def child_main(argv: list[str] | None = None) -> int:
    """``leave_on.py gpt2-child --mode M --steps N --seq S --batch B --threads T --out DIR``:
    one mode in this (fresh) process; prints its numbers as one line of JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    for opt in ("--steps", "--seq", "--batch", "--threads"):
        ap.add_argument(opt, type=int, required=True)
    ap.add_argument("--mode", choices=list(GPT2_MODES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    c = ap.parse_args(argv)
    print(json.dumps(gpt2_child(c.mode, c.steps, c.seq, c.batch, c.threads, c.out)))
    return 0
