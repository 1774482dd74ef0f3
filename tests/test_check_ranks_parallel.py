"""``check`` of a multi-rank run checks the ranks in forked worker processes: the same findings.

From :data:`stepdump.analysis.rank_pool.PARALLEL_MIN_RANKS` ranks (16) on a machine with more
than one CPU, the per-rank rules run in worker processes (benchmarks/ranks_scale.py: 256 ranks).
Here the threshold is lowered to a 4-rank DDP recording (benchmarks/ranks_gen.py) in which
rank 2 logged a NaN loss: the findings, their order and their rank prefixes are those of the
ranks checked in this process, a rule's warning raised in a worker is raised here, a rule
that fails in a worker fails here with its own error, and the report (whose per-rank tensor
sections are read in the workers too) is the same data.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import stepdump
from stepdump.analysis import rank_pool
from stepdump.analysis.findings import Finding, Severity
from stepdump.store import ranks as ranks_file
from stepdump.store.schema import catalog_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402

RANKS = 4


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_ranks(tmp_path_factory.mktemp("par") / "run", RANKS, steps=3)
    con = sqlite3.connect(catalog_path(ranks_file.local_rank_dir(root, 2)))
    try:
        with con:  # rank 2 logged a NaN loss at step 1 (SQLite keeps a NaN as NULL)
            con.execute("UPDATE scalars SET value = NULL WHERE name = 'loss' AND step = 1")
    finally:
        con.close()
    return root


def _check(root: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool, **kw: Any) -> tuple[list[Finding], int]:
    monkeypatch.setattr(rank_pool, "PARALLEL_MIN_RANKS", 2 if parallel else 10**9)
    monkeypatch.setattr(rank_pool, "CHUNK_RANKS", 1)  # a chunk per rank: a worker for each CPU
    with stepdump.open(root) as run:
        workers = rank_pool.workers(run)
        return stepdump.check(run, **kw), workers


def test_workers_find_what_this_process_finds(ranks_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here, one = _check(ranks_run, monkeypatch, parallel=False)
    forked, workers = _check(ranks_run, monkeypatch, parallel=True)
    assert one == 1
    # more than one where the machine has CPUs, unless another thread runs here (then no fork)
    assert workers == (min(len(os.sched_getaffinity(0)), RANKS) if threading.active_count() == 1 else 1)
    assert forked == here
    nan = [f for f in here if f.rule == "nan_inf"]
    assert [(f.step, f.severity, f.message.split(":")[0]) for f in nan] == [(1, Severity.ERROR, "rank 2")]


def warn_and_find(run: Any) -> list[Finding]:
    rank = run.meta["distributed"]["rank"]
    warnings.warn(f"looked at rank {rank}", UserWarning, stacklevel=1)
    return [Finding("warn_and_find", Severity.INFO, 0, None, None, None, None, "seen")]


def test_a_rule_warning_in_a_worker_is_warned_here(ranks_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning) as caught:
        found, _ = _check(ranks_run, monkeypatch, parallel=True, rules=[warn_and_find])
    assert [str(w.message) for w in caught if "looked at" in str(w.message)] == \
        [f"looked at rank {r}" for r in range(RANKS)]
    assert [f.message for f in found] == ["ranks 0, 1, 2, 3: seen"]


def fail_on_rank_3(run: Any) -> list[Finding]:
    if run.meta["distributed"]["rank"] == 3:
        raise stepdump.StepdumpError("rank 3 refused")
    return []


def test_a_rule_error_in_a_worker_is_raised_here(ranks_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(stepdump.StepdumpError, match="rank 3 refused"):
        _check(ranks_run, monkeypatch, parallel=True, rules=[fail_on_rank_3])


def test_the_report_of_many_ranks_is_built_alike_in_workers(ranks_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.analysis.report import build_report_data

    built = []
    for parallel in (False, True):
        monkeypatch.setattr(rank_pool, "PARALLEL_MIN_RANKS", 2 if parallel else 10**9)
        monkeypatch.setattr(rank_pool, "CHUNK_RANKS", 1)
        with stepdump.open(ranks_run) as run:
            assert (rank_pool.workers(run) > 1) == (parallel and len(os.sched_getaffinity(0)) > 1
                                                    and threading.active_count() == 1)
            built.append(json.dumps(build_report_data(run), sort_keys=True, default=str))
    assert built[0] == built[1]
    data = json.loads(built[1])
    assert len(data["dist"]["params"]["quantiles"]) == RANKS  # each rank's tensors, read in a worker
    assert data["update_ratio"]["exact"]["names"][0].startswith("rank0/")


def test_no_fork_while_another_thread_runs(ranks_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_pool, "PARALLEL_MIN_RANKS", 2)
    monkeypatch.setattr(rank_pool, "CHUNK_RANKS", 1)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with stepdump.open(ranks_run) as run:
            assert rank_pool.workers(run) == 1  # a fork would copy this process with that thread mid-way
            found = stepdump.check(run)
    finally:
        stop.set()
        other.join()
    assert [f.message.split(":")[0] for f in found if f.rule == "nan_inf"] == ["rank 2"]
