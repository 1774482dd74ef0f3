"""Per-rank work of a multi-rank run in forked worker processes: :func:`map_ranks`.

``check``'s rules and the report's tensor sections do the same work on every rank's store: Python
over one store's rows (pandas, a few tensors), bound by the CPU and the GIL, so threads would take
turns. From :data:`PARALLEL_MIN_RANKS` ranks on, a local run on a machine with more than one CPU
has its ranks done by forked worker processes, each opening the rank stores afresh (SQLite
connections must not cross a fork), :data:`CHUNK_RANKS` ranks at a time; the results come back in
rank order, and what the work warned is warned again here, in rank order.

Where a fork cannot be trusted (another thread runs in this process: a fork copies only the
caller, and a lock another thread held stays held in the child; no ``fork`` on the platform) or
any worker fails, the ranks are done here, one store at a time, so a failure raises its own error
here. Workers run torch on one thread, as DataLoader workers do (OpenMP's thread pool does not
survive a fork): a value summed over more than about a million elements (update_ratio's measured
ratio) is then the one single-threaded torch gives, which may differ in its last bits from the
one a multi-threaded torch gives in this process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Ranks from which the work goes to worker processes (fewer: starting them costs more than it saves).
PARALLEL_MIN_RANKS = 16
#: Ranks a worker takes at a time.
CHUNK_RANKS = 8
#: Most worker processes.
MAX_WORKERS = 8


def workers(run: Any) -> int:
    """How many worker processes :func:`map_ranks` uses for ``run`` (1: none, this process works)."""
    ranks = getattr(run, "ranks", None)
    if not isinstance(ranks, list) or len(ranks) < PARALLEL_MIN_RANKS or getattr(run, "remote", True):
        return 1
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS, -(-len(ranks) // CHUNK_RANKS)))


def map_ranks(run: Any, fn: Callable[..., Any], *args: Any) -> list[tuple[int, Any]]:
    """``(rank, fn(rank's store, *args))`` for every rank of ``run`` (``run.stores()``), in rank order.

    ``fn`` and ``args`` reach the workers by the fork (they need not pickle); what ``fn`` returns
    comes back pickled. ``fn`` must only read the store.
    """
    n = workers(run)
    if n > 1:
        try:
            return _forked(run, fn, args, n)
        except Exception as e:  # noqa: BLE001 - done again here, where the real error is raised
            log.info("worker processes failed (%s); doing the ranks in this process", e)
    # One rank's store at a time (run.stores() opens them lazily; a list would hold every rank open).
    return [(rank, fn(store, *args)) for rank, store in run.stores() if rank is not None]


# What a forked worker does: set before the fork, inherited.
_JOB: dict[str, Any] = {}


def _forked(run: Any, fn: Callable[..., Any], args: tuple[Any, ...], n: int) -> list[tuple[int, Any]]:
    import multiprocessing

    ranks = list(run.ranks)
    chunks = [ranks[i:i + CHUNK_RANKS] for i in range(0, len(ranks), CHUNK_RANKS)]
    _JOB.update(path=run.path, fn=fn, args=args)
    try:
        with multiprocessing.get_context("fork").Pool(n, initializer=_start_worker) as pool:
            done = list(pool.imap(_do_chunk, chunks))  # every chunk before any is used: all or none
    finally:
        _JOB.clear()
    out = []
    for part in done:
        for rank, result, caught in part:
            for w in caught:  # what the work warned in the worker, warned here in rank order
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            out.append((rank, result))
    return out


def _start_worker() -> None:
    """In a forked worker: torch on one thread, the run opened afresh."""
    import gc

    gc.freeze()  # what the fork copied stays out of the collector's walks (and its pages shared)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    from stepdump.read.ranked import DistributedRun

    _JOB["run"] = DistributedRun(_JOB["path"])


def _do_chunk(ranks: list[int]) -> list[tuple[int, Any, list[_Warned]]]:
    run, fn, args = _JOB["run"], _JOB["fn"], _JOB["args"]
    out = []
    for rank in ranks:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn(run.rank(rank), *args)
        out.append((rank, result, [_Warned(w) for w in caught]))
    return out


class _Warned:
    """A warning caught in a worker, as it travels back."""

    def __init__(self, w: warnings.WarningMessage) -> None:
        self.message = w.message if isinstance(w.message, Warning) else str(w.message)
        self.category = w.category
        self.filename = w.filename
        self.lineno = w.lineno
