"""Timing harness: run one way of recording on a fresh workload, time it, size its output."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baselines import Recording
from workloads import Workload


@dataclass
class Result:
    """One row of a table: a way of recording, measured once or several times."""

    key: str
    label: str
    group: str  # "baseline", "seed", "floor", "stepdump"
    steps: int
    seconds: list[float] = field(default_factory=list)  # per repeat: first step .. after close()
    bytes_on_disk: list[int] = field(default_factory=list)  # per repeat
    probe_ms: list[float] = field(default_factory=list)  # per repeat: unrecorded ms/step just before
    extrapolated: bool = False
    note: str = ""
    error: str | None = None

    @property
    def ms_per_step(self) -> float:
        return statistics.median(self.seconds) / self.steps * 1e3 if self.seconds else float("nan")

    @property
    def ms_samples(self) -> list[float]:
        return [s / self.steps * 1e3 for s in self.seconds]

    @property
    def probe_ratio(self) -> float | None:
        """ms/step over the unrecorded steps timed just before it (same process, same minute)."""
        if not self.probe_ms or not self.seconds:
            return None
        return statistics.median(s / self.steps * 1e3 / p for s, p in zip(self.seconds, self.probe_ms, strict=True))

    @property
    def bytes_per_step(self) -> float:
        return statistics.median(self.bytes_on_disk) / self.steps if self.bytes_on_disk else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "group": self.group, "steps": self.steps,
                "ms_per_step": self.ms_per_step, "ms_samples": self.ms_samples,
                "bytes_per_step": self.bytes_per_step, "probe_ms": self.probe_ms,
                "probe_ratio": self.probe_ratio, "extrapolated": self.extrapolated,
                "note": self.note, "error": self.error}


def dir_size(path: Path) -> int:
    """Apparent size of every file under ``path`` (catalog, WAL, segments...)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def settle() -> None:
    """Between variants, untimed: free memory and push the last variant's dirty pages out,
    so one variant's writeback is not billed to the next."""
    gc.collect()
    os.sync()


def time_recording(
    make_workload: Callable[[], Workload],
    make_recording: Callable[[Workload, Path], Recording],
    out: Path,
    steps: int,
    warmup: int,
    probe: int = 3,
) -> tuple[float, int, float]:
    """Seconds from the first recorded step until after ``close()``, bytes left on disk,
    and ms/step of ``probe`` unrecorded steps run just before.

    The workload is built fresh and warmed up (optimizer state exists, allocator
    warm) without recording; ``probe`` more unrecorded steps are timed as a
    local no-recording reference (the machine's load drifts between rows); the
    recording is built outside the timed region. ``out`` is removed afterwards.
    """
    if out.exists():
        shutil.rmtree(out)
    w = make_workload()
    for _ in range(warmup):
        w.step(None)
    t0 = time.perf_counter()
    for _ in range(probe):
        w.step(None)
    probe_ms = (time.perf_counter() - t0) / max(probe, 1) * 1e3
    rec = None
    try:
        rec = make_recording(w, out)
        settle()
        t0 = time.perf_counter()
        for _ in range(steps):
            w.step(rec.hook)
        rec.close()
        elapsed = time.perf_counter() - t0
        size = dir_size(out) if out.exists() else 0
    finally:
        del rec, w
        if out.exists():
            shutil.rmtree(out)
    return elapsed, size, probe_ms


def spare_core_check(make_workload: Callable[[], Workload], steps: int, warmup: int) -> tuple[float, float]:
    """ms/step of the training loop alone, and with one background thread busy on torch kernels.

    The background thread does what a recorder's writer does at best (GIL-free
    reductions over a 4 MB tensor, no I/O). If the machine had a spare core the
    two numbers would be about equal; their ratio is the most any background
    writer can hope for here, however little Python it runs.
    """
    import threading

    import torch

    w = make_workload()
    for _ in range(warmup):
        w.step(None)
    x = torch.randn(1 << 20)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            torch.aminmax(x)
            x.sum()

    def timed() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            w.step(None)
        return (time.perf_counter() - t) / steps * 1e3

    alone = timed()
    th = threading.Thread(target=busy, daemon=True)
    th.start()
    try:
        loaded = timed()
    finally:
        stop.set()
        th.join()
    alone = min(alone, timed())
    return alone, loaded
