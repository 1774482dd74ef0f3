"""Load soak: record many steps of a small model; memory must stay flat, queries fast.

Used by tests/test_reliability_load.py (2,000 steps) and `make soak` (10,000).
"""

from __future__ import annotations

import ctypes
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stepdump


def rss_mb() -> float:
    """Resident memory after a GC and ``malloc_trim``: what is live, not what glibc keeps
    cached from the last (large) query result."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class LoadResult:
    steps: int
    every: Any
    seconds: float
    live_reader: bool = True
    rss: list[tuple[int, float]] = field(default_factory=list)  # (step, MB)
    queries: list[dict[str, float]] = field(default_factory=list)  # seconds per query, by name, at checkpoints

    @property
    def rss_growth_mb(self) -> float:
        """RSS at the end minus RSS after warm-up (the first sample)."""
        return self.rss[-1][1] - self.rss[0][1]

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps

    def worst(self, query: str) -> float:
        return max(q[query] for q in self.queries)

    def summary(self) -> str:
        qs = ", ".join(f"{k} ≤ {self.worst(k) * 1000:.0f} ms" for k in self.queries[0] if k != "step")
        return (f"{self.steps} steps (every={self.every}{'' if self.live_reader else ', no live reader'}) in "
                f"{self.seconds:.1f} s ({self.ms_per_step:.2f} ms/step); "
                f"RSS {self.rss[0][1]:.0f} -> {self.rss[-1][1]:.0f} MB (growth {self.rss_growth_mb:+.1f} MB); {qs}")


def run_load(path: Path, steps: int, every: Any = None, checkpoints: int = 5, warmup: int | None = None,
             live_reader: bool = True) -> LoadResult:
    """Train a tiny MLP for ``steps`` steps under a Recorder, sampling RSS and timing the
    catalog queries of a reader that stays open on the growing run.

    The reader's query results (DataFrames of every step) grow with the run, and so
    does the memory they take while alive; ``live_reader=False`` queries only after
    the last RSS sample, to measure the Recorder alone."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    warmup = warmup if warmup is not None else max(steps // 10, 1)
    marks = {warmup} | {round(steps * (i + 1) / checkpoints) - 1 for i in range(checkpoints)}
    res = LoadResult(steps=steps, every=every, seconds=0.0, live_reader=live_reader)
    reader = None
    started = time.perf_counter()
    with stepdump.Recorder(path, model, opt, every=every) as rec:
        for t in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            rec.log(loss=loss, t=float(t))
            if t in marks and live_reader:
                reader = reader or stepdump.open(path)
                q = _time_queries(reader, t)  # at warm-up too, so the baseline includes the reader
                if t != warmup or t == steps - 1:
                    res.queries.append(q)
            if t in marks:
                res.rss.append((t, rss_mb()))
            if t == steps - 1 and not live_reader:
                reader = stepdump.open(path)
                res.queries.append(_time_queries(reader, t))
        res.seconds = time.perf_counter() - started
    if reader is not None:
        reader.close()
    return res


def _time_queries(run: stepdump.types.Run, t: int) -> dict[str, float]:
    out: dict[str, float] = {"step": t}

    def timed(name: str, fn: Any) -> Any:
        s = time.perf_counter()
        v = fn()
        out[name] = time.perf_counter() - s
        return v

    df = timed("stats(name=one tensor)", lambda: run.stats(name="0.weight"))
    assert len(df) > 0
    timed("stats(kind, steps=last 100)", lambda: run.stats(kind="grads", steps=range(max(t - 100, 0), t)))
    timed("scalars()", run.scalars)
    steps = timed("stats_steps", lambda: run.stats_steps)
    if run.steps:
        timed("tensor(last full step)", lambda: run.tensor("0.weight", run.steps[-1]))
    assert steps
    return out


def check_complete(path: Path, steps: int, every: Any = None) -> None:
    """Assert that a ``run_load`` run holds every step it recorded: a stats row of each tensor
    (params and grads of 4 tensors) and a scalars row at each step, close()'s final record at
    ``steps``, and full records where ``every`` asks for them. Raises AssertionError."""
    with stepdump.open(path) as run:
        # stats at every step, then close()'s final record ``steps`` (no grads)
        assert run.stats_steps == list(range(steps + 1)), "a step's stats are missing"
        full = list(range(0, steps, every)) if every else []
        assert run.steps == full + [steps] and run.meta["final_step"] == steps, run.steps[-5:]
        assert set(run.stats(steps=steps)["kind"]) >= {"params"} and run.tensors(steps, "grads") == {}
        one = run.stats(name="0.weight", steps=range(steps))  # its params and grads rows
        assert sorted(set(one["kind"])) == ["grads", "params"] and len(one) == 2 * steps
        assert set(one["step"]) == set(range(steps))
        assert len(run.scalars()) == steps + 1  # a row per step, the final record's too
        last = run.stats(kind="grads", steps=range(steps - 100, steps))
        assert len(last) == 100 * 4 and set(last["step"]) == set(range(steps - 100, steps))


ACTIVATION_KINDS = ("params", "grads", "activations", "activation_grads", "inputs")


def activation_load(path: Path, steps: int) -> dict[int, float]:
    """Record ``steps`` lean steps (every=None) of an MLP with activations, their grads and the
    inputs captured; return the peak memory (MB) halfway and at the last step (the allocator and
    SQLite's caches warm up over the first ~250 steps, ~30-40 MB, then stay flat: a leak shows in the
    second half), and assert the run holds each step's stats (3 activation rows at the last) and the
    final record."""
    from stepdump.capture.profiling import peak_memory_mb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters())
    marks, rss = (steps // 2, steps - 1), {}
    with stepdump.Recorder(path, model, opt, capture=ACTIVATION_KINDS, every=None):
        for step in range(steps):
            x = torch.randn(32, 64)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if step in marks:
                gc.collect()
                rss[step] = peak_memory_mb(torch.device("cpu"))
    with stepdump.open(path) as run:
        # Lean (every=None): stats at each step, and the one full record close() writes.
        assert run.stats_steps == list(range(steps + 1)) and run.steps == [steps] == [run.meta["final_step"]]
        assert len(run.stats(kind="activations", steps=steps - 1)) == 3
    return rss
