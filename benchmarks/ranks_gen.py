"""Write an N-rank DDP recording of a small model in one process: what each rank of a real job writes.

Every rank's store is written by stepdump's own Recorder under an initialized
``torch.distributed`` process group (rank ``r`` of ``n``), so the stores, ``ranks.json`` and
``meta.distributed`` come from the same code a real job runs. The process group is torch's
in-process ``fake`` backend (collectives do nothing), one rank after another; DDP's gradient
allreduce is replaced by what it computes for identical replicas: every rank takes the gradient
of the *global* batch (the mean of the ranks' local losses), so every rank's grads, params and
optimizer state are the same bytes, as under real DDP, and the logged ``loss`` is the rank's own
local loss, as a DDP loop logs it.

tests/test_ranks_gen.py checks what this writes against a real 2-process gloo recording of the
same loop (``python benchmarks/ranks_gen.py --real OUT`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set is one rank of that job). benchmarks/ranks_scale.py times analyses on 8, 64 and
256 such ranks.

    python benchmarks/ranks_gen.py OUT --ranks 64 --steps 8
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stepdump

log = logging.getLogger(__name__)
LOCAL_BATCH = 2
RECORD_KW: dict[str, Any] = {}  # the Recorder's defaults: full record every step


def mlp(seed: int = 0) -> nn.Module:
    """The small model every rank trains (DDP replicas: one seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def local_batch(step: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * seed + 1000 * step + rank)
    return torch.randn(LOCAL_BATCH, 8, generator=g), torch.randn(LOCAL_BATCH, 4, generator=g)


def _identity_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: the bucket already holds the averaged gradient (see :func:`write_ranks`).

    No annotations: DDP refuses a hook whose ``bucket`` annotation is not ``dist.GradBucket``, and
    under ``from __future__ import annotations`` every annotation is a string."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _train(model: nn.Module, opt: torch.optim.Optimizer, rec: Any, rank: int, world: int, steps: int,
           seed: int, simulated: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """``simulated``: the global batch of each step (cached across ranks), or None under real DDP."""
    for step in range(steps):
        x, y = local_batch(step, rank, seed)
        opt.zero_grad()
        if simulated is not None:
            # The gradient real DDP leaves on every rank: that of the mean of the (equal-sized)
            # local losses, i.e. of the loss over the global batch; the same bytes on every rank.
            if step not in simulated:
                xs, ys = zip(*(local_batch(step, r, seed) for r in range(world)), strict=True)
                simulated[step] = torch.cat(xs), torch.cat(ys)
            gx, gy = simulated[step]
            nn.functional.mse_loss(model(gx), gy).backward()
            with torch.no_grad():  # through the inner module: an evaluation of the recorded model would
                # move the iteration's start RNG after it (capture/iteration.py), which real DDP does not do
                loss = nn.functional.mse_loss(model.module(x), y)
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP averages the grads over the ranks
        opt.step()
        rec.log(loss=loss)


def write_ranks(root: str | os.PathLike[str], n: int, *, steps: int = 8, seed: int = 0,
                record: dict[str, Any] | None = None, recorded: int | None = None) -> Path:
    """Record an ``n``-rank DDP run of :func:`mlp` into ``root`` (``root/rank00000`` ... + ``ranks.json``).

    ``record``: extra ``Recorder`` keywords (default: a full record every step). Each rank's
    forward pass covers the global batch (``n`` x 2 rows), small beside the Recorder's own
    per-rank work up to a few thousand ranks.

    ``recorded``: record only ranks ``0 .. recorded-1`` (about a second each on an idle 2-core
    machine); every later rank ``r`` is a copy of rank ``r % recorded``'s store with the three
    meta values that differ between DDP ranks (``distributed``, ``run_id``, ``created``)
    rewritten through the catalog writer and its ``stats.parquet`` written again (as ``close()``
    writes it), so its tensors, stats and fingerprints are what rank ``r`` records (DDP replicas
    are the same bytes) but its logged ``loss`` repeats the copied rank's.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    root = Path(root)
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if dist.is_initialized():
        raise RuntimeError("write_ranks starts its own process groups; call it outside torch.distributed")
    real = n if recorded is None else max(1, min(recorded, n))
    for rank in range(real):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
        try:
            model = DDP(mlp(seed))
            model.register_comm_hook(None, _identity_allreduce)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            with stepdump.Recorder(root, model, opt, **(record or RECORD_KW)) as rec:
                _train(model, opt, rec, rank, n, steps, seed, batches)
        finally:
            dist.destroy_process_group()
    for rank in range(real, n):
        _clone_rank(root, rank % real, rank)
    return root


def _clone_rank(root: Path, src: int, rank: int) -> None:
    """Rank ``rank``'s store as a copy of rank ``src``'s, its per-rank meta rewritten (see write_ranks)."""
    import shutil
    import time
    import uuid

    from stepdump.core import stats_file
    from stepdump.store import ranks as ranks_file
    from stepdump.store.catalog import CatalogWriter

    dst = root / ranks_file.rank_dir(rank)
    shutil.copytree(root / ranks_file.rank_dir(src), dst)
    stats_file.remove(dst)  # rank src's: written again below for this rank, as its Recorder would
    with stepdump.open(dst) as run:
        dist_meta = dict(run.meta["distributed"], rank=rank)
    cat = CatalogWriter(dst)
    try:
        cat.set_meta("distributed", dist_meta)
        cat.set_meta("run_id", uuid.uuid4().hex)
        cat.set_meta("created", time.time())
        cat.commit()
    finally:
        cat.close()
    stats_file.compact(dst)


def real_rank(root: str, steps: int = 8, seed: int = 0) -> None:
    """One rank of a real gloo DDP job of the same loop (RANK, WORLD_SIZE, MASTER_* in the environment)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DDP(mlp(seed))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with stepdump.Recorder(root, model, opt, **RECORD_KW) as rec:
            _train(model, opt, rec, rank, world, steps, seed, None)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recorded", type=int, help="record this many ranks, copy the rest (see write_ranks)")
    ap.add_argument("--real", action="store_true", help="be one rank of a real gloo job (env: RANK, ...)")
    args = ap.parse_args()
    if args.real:
        real_rank(args.out, args.steps, args.seed)
    else:
        write_ranks(args.out, args.ranks, steps=args.steps, seed=args.seed, recorded=args.recorded)
        log.info("wrote %d ranks into %s", args.ranks, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main()
