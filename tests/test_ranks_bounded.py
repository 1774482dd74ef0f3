"""Analyses of a multi-rank run hold a bounded number of rank stores open, however many ranks.

A DistributedRun keeps at most ``run.max_open`` rank stores open (least recently used dropped),
and the analyses walk ``run.stores()`` one rank at a time instead of listing them. Counted
here, not timed: the catalogs (``catalog.sqlite`` file descriptors) open at once, sampled every
time a rank's catalog is opened and at the end, on a 6-rank run with ``max_open = 2``. Every
analysis also gives the same answer as with every rank kept open (``max_open`` = 1000).
(benchmarks/ranks_scale.py times the same analyses on 8, 64 and 256 ranks.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stepdump
import stepdump.read.run as run_module
from stepdump.analysis.cross_rank import cross_rank
from stepdump.read import columnar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402

RANKS = 6
MAX_OPEN = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bounded")
    a = write_ranks(root / "a", RANKS, steps=2)
    b = write_ranks(root / "b", RANKS, steps=2, seed=1)  # other batches: diverges after step 0
    return a, b


def open_catalogs() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").endswith("catalog.sqlite")
        except OSError:
            pass
    return n


# name -> (analysis of runs a and b, most rank stores it may hold beyond max_open)
ANALYSES: dict[str, tuple[Callable[[Any, Any, Path], Any], int]] = {
    "check": (lambda a, b, d: [f.message for f in stepdump.check(a)], 1),
    "cross_rank": (lambda a, b, d: [f.message for f in cross_rank(a)], 1),
    "diff": (lambda a, b, d: (stepdump.diff(a, b).first_step, stepdump.diff(a, b).tensors), 1),
    "stats": (lambda a, b, d: a.stats().to_dict("list"), 1),
    "stats pyarrow": (lambda a, b, d: a.stats(dtype_backend="pyarrow").astype(object).to_dict("list"), 2),
    "export parquet": (lambda a, b, d: columnar.write_parquet(a, d / "s.parquet", window=2), 2),
    "verify": (lambda a, b, d: stepdump.verify(a).ok if hasattr(stepdump, "verify") else None, 1),
}


@pytest.mark.parametrize("what", list(ANALYSES))
def test_rank_stores_open_at_once_stay_bounded(runs: tuple[Path, Path], tmp_path: Path, what: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    analysis, extra = ANALYSES[what]
    with stepdump.open(runs[0]) as a, stepdump.open(runs[1]) as b:
        a.max_open = b.max_open = 1000
        want = analysis(a, b, tmp_path)
    seen: list[int] = []
    real = run_module.CatalogReader

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(open_catalogs())

    monkeypatch.setattr(run_module, "CatalogReader", Counting)
    before = open_catalogs()
    with stepdump.open(runs[0]) as a, stepdump.open(runs[1]) as b:
        a.max_open = b.max_open = MAX_OPEN
        got = analysis(a, b, tmp_path)
        seen.append(open_catalogs())
    assert got == want
    runs_open = 2 if what == "diff" else 1
    assert len(seen) > RANKS  # every rank's catalog was opened
    assert max(seen) - before <= runs_open * MAX_OPEN + extra < RANKS, seen
