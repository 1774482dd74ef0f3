"""Re-execution of a multi-rank run: each rank re-executes its own step, compared with every rank.

A DDP run's recorded grads are the reduced ones (the optimizer pre-hook fires after the
allreduce), the same on every rank. A re-execution reproduces them only where they were computed:
inside a process group of the recording's size, every rank re-executing its own step with its
own batch (``torchrun --nproc-per-node W your_reexec.py``, or the CLI under torchrun), DDP
reducing as in training. Each rank then compares what it computed with its own record (the
verdict) and with every recorded rank's fingerprints of the reduced grads of that step: the ranks
whose record agrees with the re-execution, and for the others the first grad that differs. A
fault on one rank after the allreduce (a flipped bit in its memory) is then named on that rank.

Outside a process group (or in one of another size) the grads would be one rank's local ones,
which no record holds: refused, with what to do. Sharded runs (FSDP2) hold each rank's shard,
not replicas: refused for now.
"""

from __future__ import annotations

from typing import Any

from stepdump.core.hashing import XXH3
from stepdump.errors import ConfigError
from stepdump.read.rows import fp_kind_map
from stepdump.reexec.engine import GRADS, differing
from stepdump.store.format import Key


def is_multi_rank(run: Any) -> bool:
    """Whether ``run`` holds one store per rank (a :class:`stepdump.types.DistributedRun`)."""
    stores = getattr(run, "stores", None)
    return callable(stores) and any(rank is not None for rank, _ in stores())


def select(run: Any) -> tuple[Any, int]:
    """The store this process re-executes (its own rank's) and its rank, or a ConfigError."""
    import torch.distributed as dist

    world = int(run.world_size)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
        here = f"a process group of {dist.get_world_size()}" if dist.is_available() and dist.is_initialized() \
            else "no process group"
        raise ConfigError(
            f"{run.path} was recorded by {world} ranks, whose recorded grads are reduced across them; a re-execution "
            f"computes them only inside a process group of {world} ranks, each re-executing its own step "
            f"(torchrun --nproc-per-node {world} ..., init_process_group, then stepdump.reexecute on every rank); "
            f"this process has {here}. To re-execute one rank's store alone, open it as a plain run: "
            "stepdump.open('<run>/rank00001') (its grads will be that rank's local ones, not the record's)")
    rank = dist.get_rank()
    if rank not in run.ranks:
        raise ConfigError(f"rank {rank} was not recorded in {run.path} (recorded ranks: {run.ranks}): it has no batch "
                          "or state to re-execute its step from; record every rank (ranks='all')")
    store = run.rank(rank)
    if (store.meta.get("distributed") or {}).get("sharding"):
        raise ConfigError(f"{run.path} is sharded (FSDP2 / DTensor: each rank records its own shard): re-execution "
                          "across ranks compares replicated grads (DDP) only, for now")
    return store, rank


def compare(run: Any, step: int, fps: dict[Key, int], fp_kinds: dict[tuple[str, str], str] | None = None,
            ) -> tuple[list[int], dict[int, Key], list[str]]:
    """Every recorded rank's grads of ``step`` against the re-execution's (``fps``, fingerprinted
    under ``fp_kinds``: this rank's series that are not xxh3): the ranks that agree, the first
    differing grad of each other rank, and notes (a rank without grads there, grads whose
    fingerprint kinds differ: not compared)."""
    mine = {(kind, n): v for (kind, n), v in fps.items() if kind == GRADS}
    kinds = fp_kinds or {}
    agree: list[int] = []
    differ: dict[int, Key] = {}
    notes: list[str] = []
    for rank, store in run.stores():
        theirs = {(GRADS, n): fp for (_, n), fp in store.fingerprints(step, kinds=("grads",)).items()}
        if not theirs:
            notes.append(f"rank {rank} holds no grads at step {step}: not compared across ranks")
            continue
        other = fp_kind_map(store.catalog)
        apart = sorted(n for _, n in theirs if other.get(("grads", n), XXH3) != kinds.get(("grads", n), XXH3))
        if apart:  # two fingerprint kinds: neither equal nor different, so not compared (docs/cuda.md)
            notes.append(f"rank {rank}: {len(apart)} grad(s) not compared across ranks (first {apart[0]!r}): "
                         f"fingerprint kinds differ ({other.get(('grads', apart[0]), XXH3)} on rank {rank}, "
                         f"{kinds.get(('grads', apart[0]), XXH3)} here)")
            theirs = {(kind, n): v for (kind, n), v in theirs.items() if n not in apart}
            mine_here = {(kind, n): v for (kind, n), v in mine.items() if n not in apart}
            bad = differing(mine_here, theirs, both=False)
            if bad:
                differ[rank] = bad[0]
            continue
        bad = differing(mine, theirs, both=False)
        if bad:
            differ[rank] = bad[0]
        else:
            agree.append(rank)
    return agree, differ, notes


def summary_line(step: int, rank: int, agree: list[int], differ: dict[int, Key]) -> str:
    """``across ranks (...): ranks 0, 2 agree; rank 1 differs, first at grads 'w'``."""
    parts = []
    if agree:
        parts.append(f"rank{'s' if len(agree) > 1 else ''} {', '.join(map(str, agree))} agree")
    parts += [f"rank {r} differs, first at {kind} {name!r}" for r, (kind, name) in sorted(differ.items())]
    return f"  across ranks (step {step}'s reduced grads, re-executed on rank {rank}): " + "; ".join(parts)
