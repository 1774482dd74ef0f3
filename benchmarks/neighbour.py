"""A busy machine on demand: neighbour processes spinning at 100% of a core each (issue 40).

A recorder whose threads find an idle core costs the training thread little but the GIL; on a
machine whose every core is busy (a data loader, another job, torch using every thread) every
millisecond of CPU its threads take is a millisecond the training thread waits for a core. The
leave-on benchmarks time both: idle, and with :func:`busy` running ``os.cpu_count() - 1``
neighbours (the training thread is the last core's load). Each neighbour is a separate process
(no GIL shared with the benchmark) that does nothing but spin; its CPU time is read back, so the
report can say how busy the machine was.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

# A pure-Python spin: no syscalls, no memory traffic worth the name, one core at 100%.
_SPIN = "while True:\n    pass\n"


@dataclass
class Load:
    """What :func:`busy` ran: how many neighbours, for how long, and the CPU they got."""

    neighbours: int
    wall_s: float = 0.0
    cpu_s: list[float] = field(default_factory=list)  # each neighbour's CPU seconds (from /proc), where readable
    pids: list[int] = field(default_factory=list)

    @property
    def share(self) -> float:
        """Mean fraction of a core each neighbour got (1.0: it never waited for one)."""
        if not self.cpu_s or self.wall_s <= 0:
            return float("nan")
        return sum(self.cpu_s) / len(self.cpu_s) / self.wall_s


def default_neighbours() -> int:
    """One spinning neighbour per core but the training thread's."""
    return max(1, (os.cpu_count() or 2) - 1)


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` from /proc (None where there is no /proc)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def busy(neighbours: int) -> Iterator[Load]:
    """Run ``neighbours`` spinning processes for the duration of the block (0: none, an idle run)."""
    load = Load(neighbours)
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(neighbours)]
    load.pids = [p.pid for p in procs]
    try:
        time.sleep(0.3 if procs else 0.0)  # started and spinning before the first timed step
        t0 = time.perf_counter()
        c0 = [_cpu_s(p.pid) for p in procs]
        yield load
        load.wall_s = time.perf_counter() - t0
        c1 = [_cpu_s(p.pid) for p in procs]
        load.cpu_s = [b - a for a, b in zip(c0, c1, strict=True) if a is not None and b is not None]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
