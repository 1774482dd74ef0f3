"""What a run will write: said at start, and checked against the free disk.

At start the Recorder logs the bytes of one full step and of one stats step,
estimated from the layout (params, grads, optimizer state, module buffers), and
the bytes of the next 1000 steps at the chosen schedule; it warns when the next
10,000 steps would not fit on the disk of the run directory. A per-hour figure
needs the step time, which nobody knows at start, so :class:`Pace` gives it once
the writer has committed steps for a minute: the measured rate, and a warning
when an hour of it would not fit either.

The estimates are raw bytes: the ``raw`` codec (the default) writes exactly
that, a compressing codec less. Optimizer state that does not exist yet (Adam's
moments appear at the first step) is counted as it will be after that step
(:func:`state_factor`); for an optimizer not in that table, as it is now.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from stepdump.capture.options import RingSchedule, Schedule
from stepdump.capture.selection import StepSet
from stepdump.core.classes import is_torch_optimizer
from stepdump.core.layout import Layout

log = logging.getLogger(__name__)

ROW_BYTES = 160  # catalog bytes per tensor per recorded step (a row of stats and a fingerprint, its index)
HORIZON = 10_000  # steps whose projected size is checked against the free disk at start
PACE_AFTER_S = 60.0  # seconds of committed steps before the rate per hour is measured

# Tensors of optimizer state per parameter, each the parameter's size, after the first step.
_STATE_FACTOR = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 1,
                 "RMSprop": 1, "Rprop": 2, "ASGD": 2, "SparseAdam": 2}


def state_factor(optimizer: torch.optim.Optimizer) -> int:
    """Param-sized state tensors the optimizer will keep per parameter (0: unknown or none).

    ``SGD`` keeps a momentum buffer only with ``momentum`` set; others come from a table
    of torch's optimizers, so a step-0 estimate counts the state the first step creates.
    """
    # torch.optim's own classes only: another library's Adam (or Adafactor) keeps other state.
    name = type(optimizer).__name__ if is_torch_optimizer(type(optimizer)) else ""
    if name == "SGD":
        return int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    return _STATE_FACTOR.get(name, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def full_step_bytes(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, kinds: Iterable[str],
                    selected: Callable[[str], bool]) -> tuple[int, int]:
    """``(tensor bytes, tensors)`` of one full record of the selected ``params`` and their grads,
    optimizer state and module ``buffers``, as recorded after the first step."""
    kinds = tuple(kinds)
    total = count = 0
    factor = state_factor(optimizer)
    for name, p in params.items():
        if not selected(name):
            continue
        size = _nbytes(p)
        if "params" in kinds:
            total, count = total + size, count + 1
        if "grads" in kinds:
            total, count = total + size, count + 1
        if "optimizer" in kinds:
            state = [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            big = [v for v in state if v.numel() == p.numel()]
            have = sum(_nbytes(v) for v in state)
            missing = max(factor - len(big), 0) * size  # state the first step will create
            total, count = total + have + missing, count + max(len(state), factor)
    if "params" in kinds:
        for name, b in buffers.items():
            if selected(name):
                total, count = total + _nbytes(b), count + 1
    return total, count


@dataclass(frozen=True)
class Projection:
    """Bytes a run writes (tensor data plus catalog rows); None where the schedule decides at run time."""

    full_step: int
    stats_step: int
    per_1000: int | None  # the next 1000 steps at the schedule
    horizon: int | None  # the next HORIZON steps


def _count(pred: Callable[[int], bool], dynamic: bool, start: int, n: int) -> int | None:
    return None if dynamic else sum(1 for t in range(start, start + n) if pred(t))


def project(full_bytes: int, tensors: int, full: Callable[[int], bool], stats: Callable[[int], bool],
            start: int, dynamic: bool = False) -> Projection:
    """The bytes of one full step, one stats step, and of the next 1000 and HORIZON steps.

    ``full`` / ``stats``: does step t record in full / stats only. ``dynamic``: one of
    them is a callable that may change its mind (it is not called ahead of time).
    """
    rows = tensors * ROW_BYTES
    full_step, stats_step = full_bytes + rows, rows

    def over(n: int) -> int | None:
        n_full = _count(full, dynamic, start, n)
        n_any = _count(lambda t: full(t) or stats(t), dynamic, start, n)
        if n_full is None or n_any is None:
            return None
        return n_full * full_step + (n_any - n_full) * stats_step

    return Projection(full_step, stats_step, over(1000), over(HORIZON))


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding ``path`` (None if that cannot be known)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached


def report(proj: Projection, free: int | None, path: Path, ring: int = 0) -> None:
    """Log the projection (info) and warn when the next HORIZON steps do not fit in ``free``."""
    if ring:
        log.info("stepdump: recording into %s: %s per stats step; the ring keeps %d full steps in memory "
                 "(%s), written only when its trigger fires", path, human(proj.stats_step), ring,
                 human(ring * proj.full_step))
    else:
        per = "decided at run time" if proj.per_1000 is None else human(proj.per_1000)
        log.info("stepdump: recording into %s: %s per full step, %s per stats step, %s per 1000 steps; "
                 "the rate per hour is logged once the first steps are timed", path, human(proj.full_step),
                 human(proj.stats_step), per)
    if free is not None and proj.horizon is not None and proj.horizon > free:
        log.warning("stepdump: the next %d steps would write %s, but only %s is free on the disk of %s; "
                    "record fewer steps in full (every=), fewer tensors (include=/exclude=) or a smaller codec",
                    HORIZON, human(proj.horizon), human(free), path)


class Pace:
    """The writer's measured rate: once ``after`` seconds of steps are committed, log bytes per
    hour and warn if an hour of it exceeds the free disk (once per run)."""

    def __init__(self, path: Path, after: float = PACE_AFTER_S, clock: Callable[[], float] = time.monotonic,
                 free: Callable[[Path], int | None] = free_bytes) -> None:
        self.path, self.after, self._clock, self._free = path, after, clock, free
        self._start: tuple[float, int] | None = None
        self.done = False

    def observe(self, bytes_written: int) -> None:
        """After each committed step: ``bytes_written`` so far in this session."""
        if self.done:
            return
        now = self._clock()
        if self._start is None:  # the first step's bytes include warm-up; measure from here
            self._start = (now, bytes_written)
            return
        elapsed = now - self._start[0]
        if elapsed < self.after:
            return
        self.done = True
        per_hour = (bytes_written - self._start[1]) * 3600.0 / elapsed
        free = self._free(self.path)
        log.info("stepdump: writing %s per hour at this pace (%s free on the disk of %s)", human(per_hour),
                 "unknown" if free is None else human(free), self.path)
        if free is not None and per_hour > free:
            log.warning("stepdump: at this pace the disk of %s fills within the hour (%s per hour, %s free)",
                        self.path, human(per_hour), human(free))


def log_start(path: Path, layout: Layout, optimizer: torch.optim.Optimizer, kinds: Iterable[str],
              selected: Callable[[str], bool], schedule: Schedule, start: int) -> Projection:
    """What the Recorder calls at start: estimate, log, warn; return the projection."""
    full_bytes, tensors = full_step_bytes(layout.params, layout.buffers, optimizer, kinds, selected)
    every, stats_every = schedule.steps()
    full, stats = StepSet(every, "every"), StepSet(stats_every, "stats_every")
    proj = project(full_bytes, tensors, full, stats, start, full.dynamic or stats.dynamic)
    report(proj, free_bytes(path), path, schedule.size if isinstance(schedule, RingSchedule) else 0)
    return proj
