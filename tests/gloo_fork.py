"""Run one gloo job's ranks as processes forked from the test process (not a test module).

The multi-rank tests need real processes (one per rank, a real gloo process group over
loopback), but not fresh interpreters: a ``python worker.py`` rank spends ~6 s of CPU importing
torch, stepdump and torch._dynamo (which ``DistributedDataParallel`` and ``fully_shard`` import)
and ~1 s tearing them down, while its recording takes well under a second. Forked from the
pytest process, which has imported all of that already, a rank starts at once. Each rank runs
``target(rank)`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as a launcher sets them, its
stdout and stderr go to a log file whose tail the failure message shows, and it leaves with
``os._exit`` (never through pytest's own exit path).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from helpers import gloo_env


def run_ranks(target: Callable[[int], None], world: int, logs: Path, timeout: float = 240.0) -> None:
    """Run ``target(rank)`` for ``rank`` in ``range(world)``, each in its own forked process of one
    gloo job, and wait for all; raise AssertionError naming each rank that failed (exit code and
    the tail of its log under ``logs``), or that was still running after ``timeout`` seconds."""
    import torch._dynamo  # noqa: F401  (imported once here, not once per rank: DDP and FSDP2 import it)

    env = gloo_env(world)
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            _rank_main(target, rank, env, logs / f"rank{rank}.log")
        pids.append(pid)
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(codes) < world and time.monotonic() < deadline:
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
    finally:
        for rank, pid in enumerate(pids):
            if rank not in codes:  # still running past the limit (a hung collective): kill and reap it
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                codes[rank] = None
    failed = {r: c for r, c in codes.items() if c != 0}
    assert not failed, f"ranks failed (rank: exit code, None = killed after {timeout:.0f} s) {failed}:\n" + "\n".join(
        f"--- rank {r}\n{(logs / f'rank{r}.log').read_text(errors='replace')[-4000:]}" for r in sorted(failed))


def _rank_main(target: Callable[[int], None], rank: int, env: dict[str, str], log: Path) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # not pytest's capture objects
        os.environ.update(env)
        os.environ["RANK"] = str(rank)
        import torch

        # One intra-op thread, as OMP_NUM_THREADS=1 gives a launched rank: a thread pool the
        # parent started does not come across a fork (GNU OpenMP's can hang a child that uses it).
        torch.set_num_threads(1)
        target(rank)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
        finally:
            os._exit(code)
