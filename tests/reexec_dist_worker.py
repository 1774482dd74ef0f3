"""One rank of the 2-process gloo job tests/test_reexec_ranks.py starts (not a test module).

``main(OUT)`` in each rank's process (the test forks them, tests/gloo_fork.py), or
``python reexec_dist_worker.py OUT`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
Records a DDP MLP (each rank its own batches, every batch given to ``log_batch``) into OUT/run;
on rank 1 one bit of one reduced grad flips at FLIP_STEP (after the allreduce, before the
update: the update uses it and rank 1's record holds it, as a fault in rank 1's memory would).
Then every rank re-executes its own step of the recording, inside the same process group (DDP
reduces the grads as in training), and writes what it got to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stepdump

STEPS, FLIP_STEP, FLIPPED = 4, 2, "module.0.weight"


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def factory() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), train_step


def train_step(model: nn.Module, opt: torch.optim.Optimizer, b: tuple) -> float:
    x, y = b
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP: grads are allreduced when this returns
    opt.step()
    return loss.item()


def result(r: Any) -> dict[str, Any]:
    return {"verdict": r.verdict, "cause": r.cause, "first": list(r.first) if r.first else None,
            "rank": r.rank, "ranks_agree": r.ranks_agree,
            "ranks_differ": {str(k): list(v) for k, v in r.ranks_differ.items()}, "summary": r.summary()}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, step_fn = factory()
    if rank == 1:
        def flip(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            p = o.param_groups[0]["params"][0]
            done = int(o.state[p]["step"]) if p in o.state else 0  # updates so far: this is step `done`
            if done == FLIP_STEP:
                g = dict(model.named_parameters())[FLIPPED].grad
                g.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        opt.register_step_pre_hook(flip)  # before the Recorder's: the record holds the flipped bit
    with stepdump.Recorder(out / "run", model, opt) as rec:
        for t in range(STEPS):
            b = batch(t, rank)
            rec.log_batch(b)
            rec.log(loss=step_fn(model, opt, b))
    dist.barrier()
    got: dict[str, Any] = {}
    with stepdump.open(out / "run") as run:
        for step in (1, FLIP_STEP):
            model, opt, step_fn = factory()
            got[str(step)] = result(stepdump.reexecute(run, step, model, opt, step_fn, repeat=2))
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
