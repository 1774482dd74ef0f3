"""benchmarks/leave_on_tiny.py and benchmarks/neighbour.py (issue 40): wall *and* CPU time, idle and
busy, in RESULTS.md and results.json. Timings belong to ``make bench``, never to these tests: the
numbers here are made up, except that a real neighbour process is started and must be gone after."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import leave_on_tiny as bench  # noqa: E402
import neighbour  # noqa: E402


def _arm(none_ms: float, arm_ms: float, none_cpu: float, arm_cpu: float, recorded: bool, n: int = 3) -> dict:
    a = {"none_ms": [none_ms] * n, "none_cpu_ms": [none_cpu] * n, "none_train_cpu_ms": [none_cpu] * n,
         "arm_ms": [arm_ms] * n, "arm_cpu_ms": [arm_cpu] * n, "arm_train_cpu_ms": [none_cpu + 0.5] * n}
    nan = float("nan")
    for k in ("reported_ms", "bg_ms", "wait_ms", "hooks_ms", "close_ms"):
        a[f"arm_{k}"] = [({"reported_ms": 1.9, "bg_ms": 1.0, "wait_ms": 0.3, "hooks_ms": 1.2, "close_ms": 30.0}[k]
                          if recorded else nan)] * n
    return a


def _results() -> dict:
    loads = {}
    for load, slow in (("idle", 1.0), ("busy", 2.0)):
        loads[load] = {"neighbours": 1 if load == "busy" else 0, "share": 0.9 if load == "busy" else math.nan,
                       "arms": {"lean": _arm(10 * slow, 12 * slow, 8.0, 10.0, True),
                                "floor: _foreach_norm(params + grads)": _arm(10 * slow, 10.5 * slow, 8.0, 8.4, False)}}
    return {"rl": {"title": "PPO", "steps": 300, "loads": loads}}


def _args() -> argparse.Namespace:
    return argparse.Namespace(pairs=3, steps=30, min_segment=0.7)


def test_results_json_has_wall_and_cpu_idle_under_arms_and_busy_apart() -> None:
    out = bench.summary(_results(), _args(), "today")
    rl = out["workloads"]["rl"]
    lean, busy = rl["arms"]["lean"], rl[bench.BUSY_KEY]["lean"]
    assert lean["ratio"] == 1.2 and lean["cpu_ratio"] == 1.25 and lean["added_ms"] == 2.0
    assert lean["added_cpu_ms"] == 2.0 and lean["added_train_cpu_ms"] == 0.5
    assert busy["ratio"] == 1.2 and busy["added_ms"] == 4.0  # the busy pairs' own numbers
    assert lean["target"] == bench.RL_TARGETS["lean"] and lean["pass"] is False
    # 1.9 reported against 2.0 added (within 25%); 4.0 added busy: 1.9 is not
    assert lean["self_timing_pass"] is True and busy["self_timing_pass"] is False
    floor = rl["arms"]["floor"]
    assert floor["reported_ms"] is None and floor["self_timing_pass"] is None and floor["cpu_ratio"] == 1.05
    assert rl["busy_neighbours"] == 1 and rl["busy_share"] == 0.9


def test_section_shows_both_loads_with_cpu_and_the_reported_parts() -> None:
    text = bench.section(_results(), _args(), "today")
    rows = [ln for ln in text.splitlines() if ln.startswith("| rl |")]
    assert len(rows) == 4
    idle_lean = next(r for r in rows if "| idle | lean |" in r)
    assert "1.200×" in idle_lean and "1.250×" in idle_lean and "2.00 (2.00)" in idle_lean
    assert "1.90 = 1.20 + 0.70 (0.30; 1.00)" in idle_lean and "**pass**" in idle_lean
    assert "neighbour process(es) spinning" in text and text.startswith("\n" + bench.MARKER.lstrip("\n"))


def test_neighbours_spin_while_the_block_runs_and_are_gone_after() -> None:
    with neighbour.busy(1) as load:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            pass
    assert load.neighbours == 1 and load.wall_s >= 0.3
    assert len(load.cpu_s) == 1 and load.cpu_s[0] > 0.0 and load.share > 0.0
    for pid in load.pids:  # killed and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with neighbour.busy(0) as idle:
        pass
    assert idle.cpu_s == [] and math.isnan(idle.share)
    assert neighbour.default_neighbours() == max(1, (os.cpu_count() or 2) - 1)


def test_the_stats_floor_describes_every_copy_it_takes_and_stops_its_thread() -> None:
    # The "copy + stats" floor must do the work it stands for: every step's copy described (its
    # buffers given back for reuse only once described), and nothing left running after it.
    import threading

    import torch
    from workloads_tiny import TINY

    from stepdump.capture import packed

    described: list[int] = []
    real = packed.describe_columns

    def counting(snaps):  # the floor's own call, counted
        described.append(len(snaps))
        return real(snaps)

    w = TINY["rl"]()
    packed.describe_columns, saved = counting, packed.describe_columns
    try:
        hook, stop = bench._stats_floor(w)
        for _ in range(7):
            w.step(hook)
        stop()
    finally:
        packed.describe_columns = saved
    assert sum(described) == 7
    assert not [t for t in threading.enumerate() if t.name == "floor-stats"]
    assert torch.isfinite(torch.stack([p.detach().sum() for p in w.model.parameters()])).all()


def test_the_gradient_log_floor_describes_everything_and_writes_every_steps_grads(tmp_path) -> None:
    # Its copies hold the params and the optimizer state (read at every gradient-log step) and the
    # grads, all described; the grads' bytes of every step are in the file after stop().
    from workloads_tiny import TINY

    from stepdump.capture import packed

    described: list[int] = []
    real = packed.describe_columns

    def counting(snaps):
        described.append(sum(len(b.names) for s in snaps for b in s._batches))
        return real(snaps)

    w = TINY["rl"]()
    packed.describe_columns, saved = counting, packed.describe_columns
    try:
        hook, stop = bench._stats_floor(w, tmp_path / "grads.bin")
        for _ in range(5):
            w.step(hook)
        stop()
    finally:
        packed.describe_columns = saved
    params = list(w.model.parameters())
    grads_bytes = sum(p.numel() * p.element_size() for p in params)
    assert (tmp_path / "grads.bin").stat().st_size == 5 * grads_bytes
    opt_tensors = sum(1 for p in params for v in w.optimizer.state[p].values() if v.is_floating_point())
    # step 0's hook runs before the first update (no optimizer state yet); the other four have it all
    assert sum(described) == 5 * 2 * len(params) + 4 * opt_tensors


def test_median_ci_covers_the_median_as_often_as_it_says() -> None:
    """The interval's stated coverage, by simulation under a known median (0) of skewed noise: the
    share of 4,000 samples of 15 whose interval holds 0 is at least the stated coverage less three
    standard errors."""
    import random

    rnd = random.Random(0)
    lo, hi, cov = bench.median_ci([float(i) for i in range(15)])
    assert (lo, hi) == (3.0, 11.0) and abs(cov - (1 - 2 * sum(math.comb(15, j) for j in range(4)) / 2**15)) < 1e-12
    assert bench.median_ci([1.0, 2.0, 3.0]) is None  # no interval of 95% from three pairs
    hits, n = 0, 4000
    for _ in range(n):
        xs = [rnd.expovariate(1.0) - math.log(2) for _ in range(15)]  # the exponential's median is ln 2
        lo, hi, _ = bench.median_ci(xs)
        hits += lo <= 0.0 <= hi
    assert hits / n >= cov - 3 * math.sqrt(cov * (1 - cov) / n)


def test_the_fixed_cost_line_judges_the_hooks_of_the_small_model() -> None:
    """The made-up arms' hooks take 1.2 ms a step: over the 0.5 ms target, said for each recorded arm
    and load; the floors are not judged."""
    text = bench.section(_results(), _args(), "today")
    line = next(ln for ln in text.splitlines() if ln.startswith("**Fixed cost per step"))
    assert line.count("hooks 1.20 ms a step **FAIL**") == line.count("hooks") == 2
    assert "idle" in line and "busy" in line
    assert bench.fixed_cost_lines({"tiny-forward": _results()["rl"]}) == []  # only the small model is judged
