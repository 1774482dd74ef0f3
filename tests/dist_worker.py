"""One rank of the 2-process gloo job that tests/test_distributed.py starts (not a test module).

``main(OUT)`` in each rank's process (the test forks them, tests/gloo_fork.py), or
``python dist_worker.py OUT`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
Each scenario records into OUT/<scenario> and writes what the rank saw live (clones
of its tensors before every update, flags) to OUT/side/<scenario>_rank<r>.pt, the side
channel the test compares the recording with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stepdump

DESYNC_STEP = 3
DESYNC_PARAM = {"desync": "module.0.weight", "hsdp": "0.weight"}


def batch(step: int, rank: int, out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, out, generator=g)


def mlp(out: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, out))


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, full: bool = False) -> dict:
    """Clones of params, grads, optimizer state as this rank holds them (local shards under FSDP2)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        if full and hasattr(t, "full_tensor"):
            return t.full_tensor().detach().clone()  # a collective: every rank calls it in the same order
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    snap: dict = {"params": {}, "grads": {}, "optimizer": {}}
    with torch.no_grad():
        for n, p in model.named_parameters():
            snap["params"][n] = local(p)
            if p.grad is not None:
                snap["grads"][n] = local(p.grad)
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    snap["optimizer"][f"{n}.{k}"] = local(v)
    return snap


def train(model: nn.Module, opt: torch.optim.Optimizer, rec, steps: range, rank: int, out: int = 4,
          desync: str | None = None, full: bool = False) -> dict:
    side: dict = {"local": {}, "full": {}}
    for step in steps:
        x, y = batch(step, rank, out)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP: grads are allreduced when this returns
        if desync and step == DESYNC_STEP and rank == 1:
            with torch.no_grad():  # the planted bug: one rank edits a replica after the allreduce
                p = dict(model.named_parameters())[desync]
                (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)
        side["local"][step] = snapshot(model, opt)
        if full:
            side["full"][step] = snapshot(model, opt, full=True)
        opt.step()
        if rec is not None:
            rec.log(loss=loss)
    return side


def ddp(out: Path, rank: int) -> None:
    for name, desync in (("ddp", None), ("desync", DESYNC_PARAM["desync"])):
        model = DDP(mlp())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with stepdump.Recorder(out / name, model, opt) as rec:
            side = train(model, opt, rec, range(5), rank, desync=desync)
        side["final"] = snapshot(model, opt)["params"]
        torch.save(side, out / "side" / f"{name}_rank{rank}.pt")

    # Restore step 2 of the clean run on every rank into a fresh DDP model and redo steps 2..4.
    model = DDP(mlp(seed=123))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.open(out / "ddp") as run:
        run.restore(2, model, opt)
    train(model, opt, None, range(2, 5), rank)
    torch.save({"final": snapshot(model, opt)["params"]}, out / "side" / f"ddp_restored_rank{rank}.pt")

    # Only rank 0 records; rank 1's Recorder is an inactive stand-in.
    model = DDP(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(out / "only0", model, opt, ranks=[0]) as rec:
        train(model, opt, rec, range(2), rank)
        flags = {"recording": rec.recording, "step": rec.step, "type": type(rec).__name__}
    torch.save(flags, out / "side" / f"only0_rank{rank}.pt")

    # DDP published through fsspec (file:// works across processes; memory:// would not).
    model = DDP(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    url = (out / "remote").resolve().as_uri()
    with stepdump.Recorder(url, model, opt, remote=stepdump.options.Remote(upload_every=1)) as rec:
        side = train(model, opt, rec, range(3), rank)
    torch.save(side, out / "side" / f"remote_rank{rank}.pt")


def fsdp(out: Path, rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    def build(seed: int) -> nn.Module:
        model = mlp(out=3, seed=seed)  # 3 output rows over 2 ranks: uneven shards (2 + 1)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model

    model = build(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(out / "fsdp", model, opt) as rec:
        side = train(model, opt, rec, range(4), rank, out=3, full=True)
    side["final"] = snapshot(model, opt)["params"]
    torch.save(side, out / "side" / f"fsdp_rank{rank}.pt")

    # Every rank restores its own shard of step 2 into a fresh FSDP2 model and redoes steps 2..3.
    model = build(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.open(out / "fsdp") as run:
        run.restore(2, model, opt)
    train(model, opt, None, range(2, 4), rank, out=3)
    torch.save({"final": snapshot(model, opt)["params"]}, out / "side" / f"fsdp_restored_rank{rank}.pt")

    # HSDP: replicated over both ranks, sharded over 1, so every shard has a replica that must
    # match; rank 1 edits its replica after the gradient allreduce at DESYNC_STEP.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = mlp(out=3)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(out / "hsdp", model, opt) as rec:
        train(model, opt, rec, range(5), rank, out=3, desync=DESYNC_PARAM["hsdp"])


def main(out: Path | None = None) -> None:
    out = Path(sys.argv[1]) if out is None else out
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (out / "side").mkdir(parents=True, exist_ok=True)
    ddp(out, rank)
    dist.barrier()
    try:
        fsdp(out, rank)
    except Exception as e:  # reported to the test, which fails with it
        torch.save({"error": f"{type(e).__name__}: {e}"}, out / "side" / f"fsdp_error_rank{rank}.pt")
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
