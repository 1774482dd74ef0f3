"""benchmarks/leave_on.py's issue-40 rows for the large workloads: lean (stats only) within the floor
+ 0.01 in wall time *and* CPU time, idle and busy. The numbers are made up; timings belong to
``make bench``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import leave_on  # noqa: E402


def _pair(wall: float, cpu: float, error: str | None = None) -> dict:
    return {"median": wall, "cpu_median": cpu, "ratios": [wall] * 15, "error": error}


def _lean(arm: tuple[float, float], floor: tuple[float, float], error: str | None = None) -> dict:
    return {"pairs": {"lean-stats": _pair(*arm, error=error), "floor-norm": _pair(*floor)}}


@pytest.mark.parametrize(("arm", "ok"), [
    ((1.09, 1.10), True),    # both within the floor + 0.01
    ((1.09, 1.12), False),   # wall within, CPU not: the recorder's threads' CPU counts too
    ((1.11, 1.09), False),   # CPU within, wall not
])
def test_lean_is_judged_against_the_floor_in_wall_and_cpu_time(arm, ok) -> None:
    res = {"lean": {"A": _lean(arm, (1.08, 1.10))}, "lean_busy": {"A": _lean(arm, (1.08, 1.10))},
           "lean_busy_load": {"neighbours": 1, "share": 0.99}}
    rows = leave_on.floor_targets(res)
    assert [r.what.split(":")[0] for r in rows] == ["A, idle", "A, busy"]
    assert [r.ok for r in rows] == [ok, ok]
    assert "15 interleaved pairs" in rows[0].numbers and "neighbour" in rows[1].what


def test_an_arm_that_failed_is_not_judged() -> None:
    rows = leave_on.floor_targets({"lean": {"B": _lean((1.0, 1.0), (1.0, 1.0), error="WriterError: disk full")}})
    assert len(rows) == 1 and rows[0].ok is None and "disk full" in rows[0].numbers
