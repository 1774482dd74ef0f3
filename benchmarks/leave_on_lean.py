"""Issue 14, lean piece: the lean spellings and their floors, timed as interleaved pairs.

The two lean spellings, ``every=None, stats_every=1`` ("lean, stats only") and
``every=100, stats_every=1`` ("lean tiered"), and two floors that run in the
training loop without stepdump (``torch._foreach_norm(grads + params)``: one
fused read pass; and the same plus xxh3 of every recorded tensor's bytes). Each
is timed as interleaved pairs against no recording, in one process on one
workload, after warm-up: the machine is shared and its no-recording time drifts
by 30 % between minutes, so only a ratio taken the same second means anything.
The figure is the median of the per-pair ratios, with their spread.
Used by ``leave_on.py`` (``--only lean``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import workloads
from baselines import NoRecording, Recording
from measure import settle

MB = 1e6


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
    arm_close_ms: list[float] = field(default_factory=list)  # the arm's close(), timed apart (final record)
    error: str | None = None

    @property
    def ratios(self) -> list[float]:
        return [a / n for a, n in zip(self.arm_ms, self.none_ms, strict=True)]

    @property
    def cpu_median(self) -> float:
        r = [a / n for a, n in zip(self.arm_cpu, self.none_cpu, strict=True) if n > 0]
        return statistics.median(r) if r else float("nan")

    def add(self, none: tuple[float, ...], arm: tuple[float, ...]) -> None:
        self.none_ms.append(none[0])
        self.none_cpu.append(none[1])
        self.arm_ms.append(arm[0])
        self.arm_cpu.append(arm[1])
        if len(arm) > 2:
            self.arm_close_ms.append(arm[2])

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
                "median": self.median, "cpu_median": self.cpu_median, "arm_close_ms": self.arm_close_ms,
                "error": self.error}


def _q(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def time_segment(w: workloads.Workload, maker: Maker, out: Path, steps: int) -> tuple[float, float, float]:
    """Wall ms/step and process-CPU ms/step of ``steps`` steps with one way of recording, and
    the wall ms of its ``close()``, timed apart: ``close()`` writes the final record (the trained
    state, in full, whatever the schedule: capture/final.py), a cost paid once per run, which
    spread over a segment of a few steps would read as a per-step cost it is not. What the
    writer still had to do for the timed steps is in the close time too.

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
        t1, c1 = time.perf_counter(), time.process_time()
        rec.close()
        return (t1 - t0) / steps * 1e3, (c1 - c0) / steps * 1e3, (time.perf_counter() - t1) * 1e3
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
