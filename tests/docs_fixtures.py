"""The small worlds the doc blocks run in (tests/test_docs.py; markers in tests/docs_blocks.py).

A fixture is two things: runs recorded once per test session (copied into each page's working
folder) and the names a block may use without defining them (``model``, ``optimizer``, ``loader``,
...), built fresh for every page so a block that trains the model does not change another page.

* ``plain-loop`` (every page starts from it): a two-layer MLP (``fc1``, ``fc2``) trained by AdamW
  with a StepLR for 50 steps, batches logged: ``runs/exp1``; ``runs/exp2`` is the same loop at
  another learning rate (it diverges at step 0); ``runs/base`` and ``runs/a`` are links to exp1,
  ``runs/fix`` and ``runs/b`` to exp2. The names: ``model``, ``optimizer``/``opt``,
  ``sched``/``scheduler``, ``scaler`` (None), ``loader`` (50 batches), ``loss_fn``,
  ``train_step(model, optimizer, batch)`` (one iteration, the scheduler step included, as the
  loop did), ``make_step()`` (a fresh ``(model, optimizer, train_step)``), ``path`` (a new run's
  folder), ``step`` (10).
* ``gpt2``: ``runs/gpt``, a tiny GPT-2 (tests/tiny_gpt2.py) trained for 12 steps.
* ``two-rank``: ``runs/exp1`` replaced by a 2-rank FSDP2 job (gloo, two processes: sharded params)
  whose model has ``layers.0.wq``, ``layers.0.wo``.
* ``many-ranks``: ``runs/job``, an 8-rank DDP job of a small MLP written by benchmarks/ranks_gen.py
  (4 steps).
* ``remote``: no runs of its own; ``s3://`` in the page's blocks is read as ``memory://``, fsspec's
  in-process filesystem.

The two-rank job's ranks are forked from the test process (tests/gloo_fork.py); run as
``python tests/docs_fixtures.py two-rank OUT`` (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set) it is one rank of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stepdump

STEPS = 50
FIXTURES = ("plain-loop", "gpt2", "two-rank", "remote", "many-ranks")
# Other names the docs give two runs of the plain loop (symbolic links in each page's folder).
ALIASES = {"base": "exp1", "fix": "exp2", "a": "exp1", "b": "exp2"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def make_step(lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """A fresh ``(model, optimizer, train_step, scheduler)`` as the plain loop builds them."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        sched.step()
        return loss

    return model, opt, train_step, sched


def record_plain(path: Path, lr: float) -> None:
    model, opt, train_step, sched = make_step(lr)
    with stepdump.Recorder(path, model, opt, scheduler=sched) as rec:
        for batch in batches():
            rec.log_batch(batch)
            rec.log(loss=train_step(model, opt, batch))


def record_gpt2(path: Path) -> None:
    from tiny_gpt2 import tiny_gpt2, token_dataset

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_dataset(12)
    with stepdump.Recorder(path, model, opt) as rec:
        for item in data:
            opt.zero_grad()
            out = model(input_ids=item["input_ids"][None], labels=item["labels"][None])
            out.loss.backward()
            opt.step()
            rec.log(loss=out.loss)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wo = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.tanh(self.wq(x)))


class Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def record_two_rank(root: Path) -> None:
    """Start the 2-process gloo job that records ``root/runs/exp1``; raise if a rank fails."""
    from gloo_fork import run_ranks  # the ranks forked from this process: no torch import each

    out = str(root / "runs" / "exp1")
    run_ranks(lambda rank: _two_rank_worker(out), 2, root.with_name(root.name + "-two-rank-logs"), timeout=120)


def _two_rank_worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Layered()
    fully_shard(model.layers[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    with stepdump.Recorder(out, model, opt, scheduler=sched) as rec:
        g = torch.Generator().manual_seed(rank)
        for _ in range(12):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            rec.log(loss=loss)
    dist.destroy_process_group()


def record_many_ranks(path: Path, ranks: int = 8) -> None:
    """An 8-rank DDP job written by benchmarks/ranks_gen.py (the Recorder on every rank, in one
    process); docs/scale.md shows the same query's output on 256 ranks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ranks_gen import write_ranks

    write_ranks(path, ranks, steps=4)


def build(name: str, root: Path) -> None:
    """Record fixture ``name``'s runs under ``root`` (once per session)."""
    if name == "plain-loop":
        record_plain(root / "runs" / "exp1", 1e-2)
        record_plain(root / "runs" / "exp2", 5e-3)
    elif name == "gpt2":
        record_gpt2(root / "runs" / "gpt")
    elif name == "two-rank":
        record_two_rank(root)
    elif name == "many-ranks":
        record_many_ranks(root / "runs" / "job")
    elif name != "remote":
        raise KeyError(f"no doc fixture {name!r}; choose from {', '.join(FIXTURES)}")


def namespace(names: list[str]) -> dict[str, Any]:
    """The names a block of these fixtures may use without defining them (fresh objects)."""
    model, opt, train_step, sched = make_step()
    ns: dict[str, Any] = {
        "stepdump": stepdump, "torch": torch, "nn": nn,
        "model": model, "optimizer": opt, "opt": opt, "sched": sched, "scheduler": sched, "scaler": None,
        "loader": batches(), "loss_fn": nn.functional.mse_loss, "train_step": train_step, "path": "runs/new",
        "step": 10, "make_step": lambda: make_step()[:3],
    }
    if "gpt2" in names:
        from tiny_gpt2 import tiny_gpt2

        ns["model"] = tiny_gpt2()
    if "two-rank" in names:
        torch.manual_seed(0)
        ns["model"] = Layered()
        ns["optimizer"] = ns["opt"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-2)
    return ns


if __name__ == "__main__" and sys.argv[1] == "two-rank":
    _two_rank_worker(sys.argv[2])
