"""Issue 14 (leave it on): lean mode, the gradient log, and a GPT-2-small-sized memory check.

    .venv/bin/python benchmarks/leave_on.py                      # every piece; writes its sections of RESULTS.md
    .venv/bin/python benchmarks/leave_on.py --only lean --quick  # one piece, few steps, prints only
    .venv/bin/python benchmarks/leave_on.py --only gradlog
    .venv/bin/python benchmarks/leave_on.py --only gpt2

Pieces (``--only lean,gradlog,gpt2``):

* **lean** (workloads A and B): the two lean spellings, ``every=None,
  stats_every=1`` ("lean, stats only") and ``every=100, stats_every=1`` ("lean
  tiered"), and two floors that run in the training loop without stepdump
  (``torch._foreach_norm(grads + params)``: one fused read pass; and the same
  plus xxh3 of every recorded tensor's bytes). Each is timed as interleaved
  pairs against no recording, in one process on one workload, after warm-up:
  the machine is shared and its no-recording time drifts by 30 % between
  minutes, so only a ratio taken the same second means anything. The figure is
  the median of the per-pair ratios, with their spread.
* **gradlog** (workload A): ``gradient_log=100`` over one whole keyframe period
  (100 steps, so its bytes and time per step are the steady state), against
  torch.save and no recording, repeated and interleaved; then
  ``stepdump.open(run).state_dict(K - 1)`` on a fresh Run against K x the
  optimizer step alone.
* **gpt2**: a 124 M-parameter GPT-2-style transformer, a few steps per mode,
  each mode in a fresh child process (peak RSS is per process).

With every piece run (the default), the issue-14 targets go into a short
section near the top of RESULTS.md and the details into a section at its end;
with ``--only`` nothing is written unless ``--results`` is given, so a partial
run never replaces the numbers of a full one.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch
import workloads
from baselines import NoRecording, Recording, TorchSave
from measure import dir_size, settle
from torch import nn

MB = 1e6
TOP_MARKER = "\n## Issue 14 targets"
DETAIL_MARKER = "\n## Leave it on (issue 14)"
PIECES = ("lean", "gradlog", "gpt2")

# The targets of issue 14, as stated.
LEAN_RATIO = 1.05  # lean ≤ 1.05 × no recording (A and B)
GL_BYTES_RATIO = 0.30  # gradient log bytes/step ≤ 0.30 × torch.save's
GL_TIME_RATIO = 0.33  # gradient log time/step ≤ 0.33 × torch.save's
GPT2_RSS_RATIO = 1.05  # lean peak RSS ≤ 1.05 × no recording's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PIECES), help="comma-separated pieces: lean, gradlog, gpt2")
    ap.add_argument("--quick", action="store_true", help="few pairs / steps / repeats: a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as run.py)")
    ap.add_argument("--workloads", default="A,B", help="workloads of the lean piece (default A,B)")
    ap.add_argument("--batch-b", type=int, default=2, help="batch size of workload B (default 2, as run.py)")
    ap.add_argument("--pairs", type=int, default=7, help="lean: interleaved (none, arm) pairs per arm (default 7)")
    ap.add_argument("--pair-steps", type=int, default=6, help="lean: timed steps per segment (default 6)")
    ap.add_argument("--gl-every", type=int, default=100, help="gradlog: K of gradient_log=K (default 100)")
    ap.add_argument("--gl-steps", type=int, default=None,
                    help="gradlog: recorded steps per run (default K: one keyframe period, the steady state)")
    ap.add_argument("--gl-repeats", type=int, default=3, help="gradlog: interleaved repeats (default 3)")
    ap.add_argument("--gl-ref-steps", type=int, default=10,
                    help="gradlog: steps of each no-recording / torch.save run (default 10)")
    ap.add_argument("--gl-standin", action="store_true",
                    help="gradlog: record with every=1 instead of gradient_log=K (before the capture side exists)")
    ap.add_argument("--gpt2-steps", type=int, default=3, help="gpt2: recorded steps per mode (default 3)")
    ap.add_argument("--gpt2-seq", type=int, default=128, help="gpt2: sequence length (default 128)")
    ap.add_argument("--gpt2-batch", type=int, default=1, help="gpt2: batch size (default 1)")
    ap.add_argument("--work", type=Path, default=HERE / "_work" / "leave_on",
                    help="scratch directory on disk for the lean and gradlog runs (emptied, removed)")
    ap.add_argument("--results", type=Path, default=None,
                    help="RESULTS.md to update (default: benchmarks/RESULTS.md when every piece runs, else none)")
    ap.add_argument("--json", type=Path, default=None, help="also dump the raw numbers as JSON here")
    a = ap.parse_args(argv)
    a.pieces = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = set(a.pieces) - set(PIECES)
    if unknown:
        ap.error(f"--only: unknown piece(s) {sorted(unknown)}; choose from {', '.join(PIECES)}")
    if a.quick:
        a.pairs = min(a.pairs, 3)
        a.pair_steps = min(a.pair_steps, 5)
        a.gl_repeats = 1
        a.gl_ref_steps = min(a.gl_ref_steps, 5)
        a.gl_steps = a.gl_steps or 20
        a.gpt2_steps = min(a.gpt2_steps, 2)
    a.gl_steps = a.gl_steps or a.gl_every
    if a.results is None and set(a.pieces) == set(PIECES):
        a.results = HERE / "RESULTS.md"
    return a


# -- lean: interleaved pairs -----------------------------------------------------------------
class ForeachNormFloor:
    """One fused read pass over grads + params in the hook: the least that computing
    any per-tensor statistic of them at every step can cost the training thread."""

    hook: Callable[[], None] | None

    def __init__(self, w: workloads.Workload, out: Path) -> None:
        params = list(w.model.parameters())
        self.tensors = [p.grad for p in params if p.grad is not None] + [p.detach() for p in params]
        self.hook = self._hook

    def _hook(self) -> None:
        with torch.no_grad():
            torch._foreach_norm(self.tensors)

    def close(self) -> None:
        pass


class NormXxh3Floor(ForeachNormFloor):
    """The read pass plus xxh3-64 of every tensor a full record holds (params, grads,
    optimizer state): what stats *and* fingerprints at every step read, done
    synchronously with no copy."""

    def __init__(self, w: workloads.Workload, out: Path) -> None:
        super().__init__(w, out)
        import xxhash

        from stepdump.core.hashing import raw_bytes

        self._views = [raw_bytes(t) for _, t in w.tensors()]  # views of the live storage, no copy
        self._xxh3 = xxhash.xxh3_64_intdigest

    def _hook(self) -> None:
        super()._hook()
        for v in self._views:
            self._xxh3(v)


class Lean:
    """A stepdump Recorder in one of the lean spellings (built outside the timed region);
    it captures from the optimizer's step pre-hook, so it passes no hook."""

    hook: Callable[[], None] | None = None

    def __init__(self, w: workloads.Workload, out: Path, **kwargs: Any) -> None:
        import stepdump

        self.rec = stepdump.Recorder(out / "run", w.model, w.optimizer, **kwargs)

    def close(self) -> None:
        self.rec.close()


Maker = Callable[[workloads.Workload, Path], Recording]
LEAN_STATS: dict[str, Any] = {"every": None, "stats_every": 1}
LEAN_TIERED: dict[str, Any] = {"every": 100, "stats_every": 1}
FULL_STEP_PAIRS = 3  # pairs timing tiered's full step (it weighs 1/100, so few are enough)


def lean_arms() -> list[tuple[str, str, Maker]]:
    """(key, label, maker) of the arms each paired with no recording.

    Every segment is a fresh Recorder. Tiered segments start at step 1 so that
    their steps are the stats-only steps that are 99 of every 100 of a tiered run;
    the full step is paid for in separate pairs (see :func:`bench_lean`).
    """
    arms: list[tuple[str, str, Maker]] = [
        ("lean-stats", "stepdump lean, stats only (every=None, stats_every=1)",
         lambda w, out: Lean(w, out, **LEAN_STATS)),
        ("lean-tiered", "stepdump lean tiered (every=100, stats_every=1), stats steps",
         lambda w, out: Lean(w, out, **LEAN_TIERED, start_step=1)),
        ("floor-norm", "floor: torch._foreach_norm(grads + params) in the loop", ForeachNormFloor),
        ("floor-xxh3", "floor: the same + xxh3 of every recorded tensor (params, grads, optimizer state)",
         NormXxh3Floor),
    ]
    return arms


@dataclass
class Pairs:
    """One arm's interleaved pairs: ms/step of no recording and of the arm, side by side."""

    key: str
    label: str
    none_ms: list[float] = field(default_factory=list)
    arm_ms: list[float] = field(default_factory=list)
    # Process CPU time (every thread) per step: far less sensitive than wall time to
    # other people's jobs on the same cores, and it counts the writer thread's work.
    none_cpu: list[float] = field(default_factory=list)
    arm_cpu: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ratios(self) -> list[float]:
        return [a / n for a, n in zip(self.arm_ms, self.none_ms, strict=True)]

    @property
    def cpu_median(self) -> float:
        r = [a / n for a, n in zip(self.arm_cpu, self.none_cpu, strict=True) if n > 0]
        return statistics.median(r) if r else float("nan")

    def add(self, none: tuple[float, float], arm: tuple[float, float]) -> None:
        self.none_ms.append(none[0])
        self.none_cpu.append(none[1])
        self.arm_ms.append(arm[0])
        self.arm_cpu.append(arm[1])

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    def spread(self) -> str:
        r = sorted(self.ratios)
        if not r:
            return "–"
        return f"{r[0]:.3f}–{r[-1]:.3f}" + (f" (IQR {_q(r, .25):.3f}–{_q(r, .75):.3f})" if len(r) >= 4 else "")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "none_ms": self.none_ms, "arm_ms": self.arm_ms,
                "none_cpu_ms": self.none_cpu, "arm_cpu_ms": self.arm_cpu, "ratios": self.ratios,
                "median": self.median, "cpu_median": self.cpu_median, "error": self.error}


def _q(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def time_segment(w: workloads.Workload, maker: Maker, out: Path, steps: int) -> tuple[float, float]:
    """Wall ms/step and process-CPU ms/step of ``steps`` steps with one way of recording,
    from the first timed step until after ``close()`` (deferred writer work counts, as
    in run.py).

    The recording is built, and its first step run, outside the timed region: a
    fresh Recorder's first step allocates and creates its series, which a
    long run pays once; the pairs measure the steps that repeat.
    """
    if out.exists():
        shutil.rmtree(out)
    gc.collect()
    rec = maker(w, out)
    try:
        w.step(rec.hook)  # untimed: first step of this recording
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            w.step(rec.hook)
        rec.close()
        return (time.perf_counter() - t0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3
    finally:
        del rec
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)


def bench_lean(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved pairs (no recording, arm) for every lean arm and floor on workload ``name``."""
    factory = workloads.WORKLOADS[name]
    w = factory(batch=args.batch_b) if name == "B" else factory()
    for _ in range(3):  # optimizer state exists, allocator and caches warm
        w.step(None)
    record_bytes = sum(t.numel() * t.element_size() for _, t in w.tensors())
    gp_bytes = sum(p.numel() * p.element_size() * 2 for p in w.model.parameters())
    print(f"\n== lean, workload {name}: {w.title} ({record_bytes / MB:.1f} MB per record, "
          f"grads + params {gp_bytes / MB:.1f} MB); {args.pairs} pairs × {args.pair_steps} steps per arm", flush=True)
    work = args.work / f"lean-{name}"
    arms = lean_arms()
    pairs = {key: Pairs(key, label) for key, label, _ in arms}
    n = args.pair_steps
    for r in range(args.pairs):
        for i, (key, _label, maker) in enumerate(arms):
            p = pairs[key]
            if p.error:
                continue
            try:
                # Alternate which of the two goes first, so neither always runs in the other's wake.
                if (r + i) % 2 == 0:
                    none = time_segment(w, NoRecording, work / "none", n)
                    arm = time_segment(w, maker, work / key, n)
                else:
                    arm = time_segment(w, maker, work / key, n)
                    none = time_segment(w, NoRecording, work / "none", n)
            except Exception as e:  # noqa: BLE001 - one failing arm must not sink the others
                p.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"  {key}: FAILED: {p.error}", flush=True)
                continue
            p.add(none, arm)
        print(f"  pair {r + 1}/{args.pairs}: " + ", ".join(
            f"{k} {p.arm_ms[-1]:.0f}/{p.none_ms[-1]:.0f}" for k, p in pairs.items() if p.arm_ms and not p.error),
            flush=True)

    # Tiered's full step (1 in 100): pairs whose first timed step is step 100, the rest
    # stats steps; their median excess over the median tiered pair, spread over 100 steps.
    full_pair = Pairs("lean-tiered-full", "tiered segment holding step 100 (full)")
    tiered = pairs["lean-tiered"]
    amortized: float | None = None
    if not tiered.error and tiered.ratios:
        try:
            for _ in range(FULL_STEP_PAIRS):
                none = time_segment(w, NoRecording, work / "none", n)
                arm = time_segment(w, lambda w_, out: Lean(w_, out, **LEAN_TIERED, start_step=99), work / "full", n)
                full_pair.add(none, arm)
            extra_ratio = (full_pair.median - tiered.median) * n  # one full step's excess, in no-recording steps
            amortized = tiered.median + max(extra_ratio, 0.0) / 100
        except Exception as e:  # noqa: BLE001
            full_pair.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    shutil.rmtree(work, ignore_errors=True)
    settle()
    for p in pairs.values():
        if not p.error:
            print(f"  {p.label:90s} median {p.median:.3f}× no recording, spread {p.spread()}; "
                  f"CPU time {p.cpu_median:.3f}×", flush=True)
    if amortized is not None:
        print(f"  lean tiered with its full step every 100 (amortized): {amortized:.3f}×", flush=True)
    return {"workload": name, "title": w.title, "record_bytes": record_bytes, "gp_bytes": gp_bytes,
            "pair_steps": n, "pairs": {k: p.to_json() for k, p in pairs.items()},
            "tiered_full_pair": full_pair.to_json(), "tiered_amortized": amortized}


# -- gradient log ------------------------------------------------------------------------------
def _opt_step_timer(opt: torch.optim.Optimizer) -> tuple[list[float], Callable[[], None]]:
    """Wall ms of each ``optimizer.step()`` (pre- to post-hook); returns the list and a remover."""
    times: list[float] = []
    t0 = [0.0]

    def pre(*_: Any) -> None:
        t0[0] = time.perf_counter()

    def post(*_: Any) -> None:
        times.append((time.perf_counter() - t0[0]) * 1e3)

    h1, h2 = opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)

    def remove() -> None:
        h1.remove()
        h2.remove()

    return times, remove


def bench_gradlog(args: argparse.Namespace) -> dict[str, Any]:
    """gradient_log=K on workload A against torch.save and no recording; then the read at step K - 1."""
    K, steps = args.gl_every, args.gl_steps
    spelling = {"every": 1, "stats_every": 1} if args.gl_standin else {"gradient_log": K}
    spelled = ", ".join(f"{k}={v}" for k, v in spelling.items())
    work = args.work / "gradlog"
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"K": K, "steps": steps, "spelling": spelled, "standin": args.gl_standin,
                           "none_ms": [], "opt_ms": [], "torch_save_ms": [], "torch_save_bytes": [],
                           "gl_ms": [], "gl_bytes": []}
    print(f"\n== gradient log, workload A: Recorder({spelled}), {steps} steps per run, {args.gl_repeats} repeats "
          f"interleaved with no recording and torch.save ({args.gl_ref_steps} steps each)", flush=True)
    # The farthest step from its keyframe: K - 1 (or the last step of a shorter --quick run).
    read_step = min(K, steps) - 1
    kept: Path | None = None
    snapshot: dict[str, torch.Tensor] | None = None
    for rep in range(args.gl_repeats):
        order = ["none", "torch.save", "gl"] if rep % 2 == 0 else ["gl", "torch.save", "none"]
        for what in order:
            w = workloads.mlp()
            for _ in range(2):
                w.step(None)
            d = work / f"{what}-{rep}"
            settle()
            if what == "none":
                times, remove = _opt_step_timer(w.optimizer)
                t0 = time.perf_counter()
                for _ in range(args.gl_ref_steps):
                    w.step(None)
                out["none_ms"].append((time.perf_counter() - t0) / args.gl_ref_steps * 1e3)
                remove()
                out["opt_ms"].extend(times)
                print(f"  no recording {out['none_ms'][-1]:7.1f} ms/step; optimizer.step() alone median "
                      f"{statistics.median(times):.1f} ms", flush=True)
            elif what == "torch.save":
                saver = TorchSave(w, d)
                t0 = time.perf_counter()
                for _ in range(args.gl_ref_steps):
                    w.step(saver.hook)
                saver.close()
                out["torch_save_ms"].append((time.perf_counter() - t0) / args.gl_ref_steps * 1e3)
                out["torch_save_bytes"].append(dir_size(d) / args.gl_ref_steps)
                shutil.rmtree(d, ignore_errors=True)
                print(f"  torch.save   {out['torch_save_ms'][-1]:7.1f} ms/step "
                      f"{out['torch_save_bytes'][-1] / MB:7.1f} MB/step", flush=True)
            else:
                import stepdump

                last = rep == args.gl_repeats - 1
                try:
                    rec = stepdump.Recorder(d / "run", w.model, w.optimizer, **spelling)
                except Exception as e:  # noqa: BLE001 - the capture side may not take the keyword yet
                    out["error"] = f"Recorder({spelled}) not available yet: {type(e).__name__}: {e}"
                    print(f"  {out['error']}", flush=True)
                    break
                t0 = time.perf_counter()
                for i in range(steps):
                    if last and i == read_step:  # the reference for the read check: params at the start of it
                        snapshot = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
                    w.step(None)
                rec.close()
                out["gl_ms"].append((time.perf_counter() - t0) / steps * 1e3)
                out["gl_bytes"].append(dir_size(d) / steps)
                print(f"  {spelled:12s} {out['gl_ms'][-1]:7.1f} ms/step {out['gl_bytes'][-1] / MB:7.1f} MB/step",
                      flush=True)
                if last:
                    kept = d / "run"
                else:
                    shutil.rmtree(d, ignore_errors=True)
            del w
        if out.get("error"):
            break
    if kept is not None:
        out["read"] = gradlog_read(kept, read_step, snapshot)
        r = out["read"]
        print("  read: " + (r.get("error") or f"open + state_dict({read_step}) {r['state_dict_ms']:.0f} ms, "
                                              f"open + tensor(..., {read_step}) {r['tensor_ms']:.0f} ms, "
                                              f"bitwise equal: {r.get('equal')}"), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    settle()
    return out


def gradlog_read(path: Path, step: int, snapshot: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Time reading params at ``step`` (K - 1: the farthest from its keyframe) on fresh Runs."""
    import stepdump

    res: dict[str, Any] = {"step": step}
    try:
        run = stepdump.open(path)
        try:
            # Did the capture store grads at a step that is not a keyframe? (every=100 alone does not.)
            g = run.names("grads")
            res["grads_every_step"] = bool(g) and _has(run, g[0], 1, "grads")
            res["full_steps"] = len(getattr(run, "full_steps", []) or [])
        finally:
            run.close()
        t0 = time.perf_counter()
        run = stepdump.open(path)
        sd = run.state_dict(step)
        res["state_dict_ms"] = (time.perf_counter() - t0) * 1e3
        name = run.names("params")[0]
        run.close()
        t0 = time.perf_counter()
        run = stepdump.open(path)
        run.tensor(name, step)
        res["tensor_ms"] = (time.perf_counter() - t0) * 1e3
        run.close()
        if snapshot is not None:
            res["equal"] = sd.keys() == snapshot.keys() and all(torch.equal(sd[k], snapshot[k]) for k in sd)
    except Exception as e:  # noqa: BLE001 - the read side is being written: say so, do not crash
        res["error"] = f"not available yet: {type(e).__name__}: {e}".splitlines()[0][:300]
    return res


def _has(run: Any, name: str, step: int, kind: str) -> bool:
    try:
        run.tensor(name, step, kind)
        return True
    except Exception:  # noqa: BLE001 - stats-only step: no bytes stored
        return False


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
        cmd = [sys.executable, str(Path(__file__).resolve()), "gpt2-child", "--mode", mode,
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


# -- verdicts and markdown ---------------------------------------------------------------------
@dataclass
class Target:
    what: str
    ok: bool | None  # None: could not be measured
    numbers: str
    floor: str = "–"


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "**pass**" if ok else "**FAIL**"


def targets(res: dict[str, Any]) -> list[Target]:
    """The issue-14 targets with pass/fail, the numbers, and the floor beside each."""
    T: list[Target] = []
    for name, lean in res.get("lean", {}).items():
        p, fl, fx = lean["pairs"]["lean-stats"], lean["pairs"]["floor-norm"], lean["pairs"]["floor-xxh3"]
        floor = (f"floor {fl['median']:.3f}× (one `_foreach_norm` over grads + params); "
                 f"{fx['median']:.3f}× with xxh3 of the whole record")
        for key, label in (("lean-stats", "stats only"), ("lean-tiered", "tiered, stats steps")):
            p = lean["pairs"][key]
            if p["error"] or not p["ratios"]:
                T.append(Target(f"{name}: lean ({label}) ≤ {LEAN_RATIO} × no recording", None,
                                p["error"] or "not measured", floor))
                continue
            r = sorted(p["ratios"])
            extra = ""
            if key == "lean-tiered" and lean.get("tiered_amortized") is not None:
                extra = f"; with its full step every 100 amortized {lean['tiered_amortized']:.3f}×"
            T.append(Target(
                f"{name}: lean ({label}) ≤ {LEAN_RATIO} × no recording", p["median"] <= LEAN_RATIO,
                f"median {p['median']:.3f}× of {len(r)} interleaved pairs (spread {r[0]:.3f}–{r[-1]:.3f}; "
                f"{statistics.median(p['arm_ms']):.0f} vs {statistics.median(p['none_ms']):.0f} ms/step; "
                f"process CPU time {p['cpu_median']:.3f}×){extra}",
                floor))
    gl = res.get("gradlog")
    if gl:
        T.extend(gradlog_targets(gl))
    g2 = res.get("gpt2")
    if g2:
        modes = g2["modes"]
        none = modes.get("none", {})
        for key in ("lean-stats", "lean-tiered"):
            m = modes.get(key, {})
            what = f"GPT-2 small: peak RSS of {GPT2_MODES[key][0]} ≤ {GPT2_RSS_RATIO} × no recording"
            if "hwm_kb" not in m or "hwm_kb" not in none:
                T.append(Target(what, None, m.get("error") or none.get("error") or "not measured"))
                continue
            ratio = m["hwm_kb"] / none["hwm_kb"]
            rec = m["hwm_recorded_kb"] / none["hwm_recorded_kb"]
            T.append(Target(what, ratio <= GPT2_RSS_RATIO and rec <= GPT2_RSS_RATIO,
                            f"whole process {m['hwm_kb'] / 1024:.0f} MiB vs {none['hwm_kb'] / 1024:.0f} MiB = "
                            f"{ratio:.3f}× ({(m['hwm_kb'] - none['hwm_kb']) / 1024:+.0f} MiB); during the recorded "
                            f"steps alone {m['hwm_recorded_kb'] / 1024:.0f} vs {none['hwm_recorded_kb'] / 1024:.0f} "
                            f"MiB = {rec:.3f}×",
                            f"one full copy of the record would add {_gpt2_record_mb(none):.0f} MB"))
    return T


def _gpt2_record_mb(none: dict[str, Any]) -> float:
    return none.get("params", 0) * 4 * 4 / MB  # params + grads + exp_avg + exp_avg_sq, fp32


def gradlog_targets(gl: dict[str, Any]) -> list[Target]:
    T: list[Target] = []
    K = gl["K"]
    label = "gradient log" + (" (STAND-IN: every=1)" if gl.get("standin") else "")
    if gl.get("error") or not gl["gl_ms"]:
        why = gl.get("error") or "not measured"
        for what in (f"bytes/step ≤ {GL_BYTES_RATIO} × torch.save", f"time/step ≤ {GL_TIME_RATIO} × torch.save",
                     f"read params at step {K - 1} ≤ {K} × optimizer step"):
            T.append(Target(f"A: {label} {what}", None, why))
        return T
    none, ts, gms = (statistics.median(gl[k]) for k in ("none_ms", "torch_save_ms", "gl_ms"))
    tsb, gb = statistics.median(gl["torch_save_bytes"]), statistics.median(gl["gl_bytes"])
    opt = statistics.median(gl["opt_ms"])
    steady = "" if gl["steps"] == K else f" (over {gl['steps']} steps, 1 keyframe in them: not the steady state)"
    grads_note = ""
    rd = gl.get("read", {})
    if rd.get("grads_every_step") is False:
        grads_note = "; WARNING: no grads stored at step 1, so this run is not a gradient log"
    b = gb / tsb
    T.append(Target(f"A: {label} bytes/step ≤ {GL_BYTES_RATIO} × torch.save", b <= GL_BYTES_RATIO,
                    f"{gb / MB:.1f} MB vs {tsb / MB:.1f} MB = {b:.3f}×{steady}{grads_note}",
                    f"grads alone {gl.get('grads_mb', 0):.1f} MB = {gl.get('grads_mb', 0) * MB / tsb:.3f}×"))
    t = gms / ts
    T.append(Target(f"A: {label} time/step ≤ {GL_TIME_RATIO} × torch.save", t <= GL_TIME_RATIO,
                    f"{gms:.0f} ms vs {ts:.0f} ms = {t:.3f}× (medians of {len(gl['gl_ms'])} interleaved runs)"
                    f"{steady}", f"no recording alone {none:.0f} ms = {none / ts:.3f}×"))
    ov = (gms - none) / (ts - none)
    T.append(Target(f"A: … read as overhead: {label} − no recording ≤ {GL_TIME_RATIO} × (torch.save − no recording)",
                    ov <= GL_TIME_RATIO, f"{gms - none:.0f} ms vs {ts - none:.0f} ms = {ov:.3f}×"))
    n = rd.get("step", K - 1) + 1  # optimizer steps the read re-applies at most (K at step K - 1)
    what = f"A: {label} read params at step {n - 1} (fresh Run) ≤ {n} × optimizer.step()"
    if "state_dict_ms" not in rd:
        T.append(Target(what, None, rd.get("error", "not measured"), f"{n} × {opt:.1f} ms = {n * opt:.0f} ms"))
    else:
        r = rd["state_dict_ms"] / (n * opt)
        eq = {True: "; bitwise equal to the live model", False: "; NOT equal to the live model",
              None: ""}[rd.get("equal")]
        T.append(Target(what, r <= 1.0 and rd.get("equal") is not False,
                        f"open + state_dict({n - 1}) {rd['state_dict_ms']:.0f} ms = {r:.2f} × ({n} × {opt:.1f} ms)"
                        f"{eq}; open + one tensor {rd['tensor_ms']:.0f} ms",
                        f"{n} optimizer steps = {n * opt:.0f} ms"))
    return T


def top_section(T: list[Target], date: str) -> str:
    L = ["", "## Issue 14 targets (leave it on)", "",
         (f"`benchmarks/leave_on.py`, {date}; details in \"Leave it on (issue 14)\" below. Lean ratios are "
         "medians of interleaved (no recording, lean) pairs in one process; the floor is the same kind of pair "
         "with a fused read pass of the tensors in the loop instead of stepdump."), "",
         "| target | result | numbers | floor |", "|---|---|---|---|"]
    L += [f"| {t.what} | {_mark(t.ok)} | {t.numbers} | {t.floor} |" for t in T]
    return "\n".join(L) + "\n"


def detail_section(res: dict[str, Any], args: argparse.Namespace) -> str:
    L = ["", "## Leave it on (issue 14)", "",
         f"`benchmarks/leave_on.py` (torch threads {args.threads}); see benchmarks/README.md."]
    for name, lean in res.get("lean", {}).items():
        L += ["", (f"**Lean, workload {name}** ({lean['title']}; {lean['record_bytes'] / MB:.1f} MB per record, "
              f"grads + params {lean['gp_bytes'] / MB:.1f} MB). Interleaved pairs, {lean['pair_steps']} timed steps "
              "per segment, each recording built and its first step run untimed, `close()` timed:"), "",
              ("| arm | × no recording (median of pairs) | spread (min–max) | ms/step arm / none (medians) | "
              "CPU time × (median of pairs) | pairs |"),
              "|---|---:|---|---|---:|---:|"]
        for p in lean["pairs"].values():
            if p["error"]:
                L.append(f"| {p['label']} | FAILED | {p['error']} | – | – | 0 |")
                continue
            r = sorted(p["ratios"])
            L.append(f"| {p['label']} | {p['median']:.3f}× | {r[0]:.3f}–{r[-1]:.3f} | "
                     f"{statistics.median(p['arm_ms']):.1f} / {statistics.median(p['none_ms']):.1f} | "
                     f"{p['cpu_median']:.3f}× | {len(r)} |")
        fp = lean["tiered_full_pair"]
        if fp["ratios"]:
            r = sorted(fp["ratios"])
            L.append(f"| lean tiered, segments holding its full step (step 100) | {fp['median']:.3f}× | "
                     f"{r[0]:.3f}–{r[-1]:.3f} | {statistics.median(fp['arm_ms']):.1f} / "
                     f"{statistics.median(fp['none_ms']):.1f} | {fp['cpu_median']:.3f}× | {len(r)} |")
        if lean.get("tiered_amortized") is not None:
            L.append(f"| lean tiered, 1 full step per 100 (amortized from the two rows above) ‡ | "
                     f"{lean['tiered_amortized']:.3f}× | – | – | – | – |")
    gl = res.get("gradlog")
    if gl:
        L += ["", (f"**Gradient log, workload A** (`{gl['spelling']}`, {gl['steps']} steps per run = "
              f"{'one keyframe period' if gl['steps'] == gl['K'] else 'not a whole keyframe period'}; "
              f"{len(gl['gl_ms'])} runs interleaved with no recording and torch.save):"), ""]
        if gl.get("error"):
            L.append(f"- {gl['error']}")
        L += ["| row | ms/step (each run) | MB/step |", "|---|---|---:|"]
        for label, ms, b in (("no recording", gl["none_ms"], None),
                             ("torch.save (clone + dict per step)", gl["torch_save_ms"], gl["torch_save_bytes"]),
                             (f"stepdump {gl['spelling']}", gl["gl_ms"], gl["gl_bytes"])):
            if ms:
                L.append(f"| {label} | {statistics.median(ms):.0f} ({'/'.join(f'{x:.0f}' for x in ms)}) | "
                         + (f"{statistics.median(b) / MB:.1f}" if b else "0") + " |")
        if gl["opt_ms"]:
            L.append(f"| optimizer.step() alone (inside the no-recording runs) | "
                     f"{statistics.median(gl['opt_ms']):.1f} (median of {len(gl['opt_ms'])}) | – |")
        rd = gl.get("read")
        if rd:
            L += ["", f"Read at step {rd['step']} on a fresh `stepdump.open`: " + (
                rd["error"] if "error" in rd else
                f"`state_dict({rd['step']})` {rd['state_dict_ms']:.0f} ms, `tensor(name, {rd['step']})` "
                f"{rd['tensor_ms']:.0f} ms (open included); bitwise equal to the live model: {rd.get('equal')}; "
                f"grads stored at a non-keyframe step: {rd.get('grads_every_step')}.")]
    g2 = res.get("gpt2")
    if g2:
        L += ["", (f"**GPT-2 small memory** (124 M params, seq {g2['seq']}, batch {g2['batch']}, AdamW, one unrecorded "
              f"step then {g2['steps']} recorded; each mode a fresh process; peak RSS = VmHWM of the whole process, "
              "and of the recorded steps alone (VmHWM reset after the unrecorded step, whose AdamW state "
              "allocation can hide what a recorder adds); records in a temp dir under /tmp on disk, deleted after):"), "",
              ("| mode | peak RSS MiB | × no recording | peak during recorded steps MiB | × no recording | "
              "RSS before Recorder MiB | ms/step | MB/step on disk |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        none = g2["modes"].get("none", {})
        for key, m in g2["modes"].items():
            if "error" in m:
                L.append(f"| {GPT2_MODES[key][0]} | FAILED: {m['error']} | – | – | – | – |")
                continue
            ratio = f"{m['hwm_kb'] / none['hwm_kb']:.3f}×" if "hwm_kb" in none else "–"
            rec = f"{m['hwm_recorded_kb'] / none['hwm_recorded_kb']:.3f}×" if "hwm_kb" in none else "–"
            L.append(f"| {GPT2_MODES[key][0]} | {m['hwm_kb'] / 1024:.0f} | {ratio} | "
                     f"{m['hwm_recorded_kb'] / 1024:.0f} | {rec} | {m['rss_before_kb'] / 1024:.0f} | "
                     f"{m['ms_per_step']:.0f} | {m['bytes_on_disk'] / g2['steps'] / MB:.1f} |")
    return "\n".join(L) + "\n"


def _cut(body: str, marker: str) -> str:
    """``body`` without the section that starts at ``marker`` (up to the next ``## `` heading)."""
    if marker not in body:
        return body
    start = body.index(marker)
    nxt = body.find("\n## ", start + len(marker))
    return body[:start] + (body[nxt:] if nxt != -1 else "\n")


def write_results(path: Path, top: str, detail: str) -> None:
    """Put the targets right before the first ``## `` section and the details at the end,
    replacing this script's sections from an earlier run and leaving the rest alone."""
    body = path.read_text() if path.exists() else "# stepdump benchmarks: results\n"
    body = _cut(_cut(body, TOP_MARKER), DETAIL_MARKER)
    first = body.find("\n## ")
    body = body.rstrip("\n") + "\n" + top if first == -1 else body[:first].rstrip("\n") + "\n" + top + body[first:]
    path.write_text(body.rstrip("\n") + "\n" + detail)


def main(argv: list[str] | None = None) -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "gpt2-child" and argv is None:
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        for opt in ("--steps", "--seq", "--batch", "--threads"):
            ap.add_argument(opt, type=int, required=True)
        ap.add_argument("--mode", choices=list(GPT2_MODES), required=True)
        ap.add_argument("--out", type=Path, required=True)
        c = ap.parse_args()
        print(json.dumps(gpt2_child(c.mode, c.steps, c.seq, c.batch, c.threads, c.out)))
        return 0
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res: dict[str, Any] = {"date": date, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        if "lean" in args.pieces:
            res["lean"] = {n.strip(): bench_lean(n.strip(), args) for n in args.workloads.split(",") if n.strip()}
        if "gradlog" in args.pieces:
            res["gradlog"] = bench_gradlog(args)
            w = workloads.mlp()
            res["gradlog"]["grads_mb"] = sum(p.numel() * p.element_size() for p in w.model.parameters()) / MB
        if "gpt2" in args.pieces:
            res["gpt2"] = bench_gpt2(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    res["duration_s"] = time.perf_counter() - t_start
    T = targets(res)
    print("\n== issue 14 targets")
    for t in T:
        print(f"  [{'n/a' if t.ok is None else 'PASS' if t.ok else 'FAIL'}] {t.what}: {t.numbers}  |  {t.floor}")
    print(f"\nwall time {res['duration_s'] / 60:.1f} min")
    if args.results is not None:
        write_results(args.results, top_section(T, date), detail_section(res, args))
        print(f"wrote {args.results}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
