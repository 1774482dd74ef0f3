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
    def bytes_per_step(self) -> float:
        return statistics.median(self.bytes_on_disk) / self.steps if self.bytes_on_disk else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "group": self.group, "steps": self.steps,
                "ms_per_step": self.ms_per_step, "ms_samples": self.ms_samples,
                "bytes_per_step": self.bytes_per_step, "extrapolated": self.extrapolated,
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
) -> tuple[float, int]:
    """Seconds from the first recorded step until after ``close()``, and bytes left on disk.

    The workload is built fresh and warmed up (optimizer state exists, allocator
    warm) without recording; the recording is built outside the timed region.
    ``out`` is removed afterwards.
    """
    if out.exists():
        shutil.rmtree(out)
    w = make_workload()
    for _ in range(warmup):
        w.step(None)
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
    return elapsed, size
