"""The demo job: a small training run recorded by stepdump, every step with its batch.

The model is an MLP classifier with a BatchNorm layer on synthetic Gaussian
clusters (no download), trained with AdamW, a StepLR schedule and dropout, so
every part of a record (params, buffers, grads, optimizer moments, scheduler,
RNG, scalars, the batch) has content. Because each step is stored in full with
its batch, every command can be tried on the demo run, ``reexecute`` and
``bundle`` included: :func:`make_step` is the ``--entry`` factory that rebuilds
the demo's iteration (``stepdump reexecute demo-run --step 10 --entry
stepdump.demo:make_step``).

The demo prints no timing: the cost of recording is measured side by side, both
arms under the same conditions, by ``make bench`` (docs/performance.md).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import stepdump
from stepdump.errors import ConfigError, RunExistsError
from stepdump.store.format import CATALOG_FILE

Progress = Callable[[str, int, int], None]
Batch = tuple[torch.Tensor, torch.Tensor]
TrainStep = Callable[[nn.Module, torch.optim.Optimizer, Batch], torch.Tensor]

#: The step the demo re-executes and the examples of ``--help`` use (a smaller run: its last update).
EXAMPLE_STEP = 10


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` recorded.

    Attributes:
        path: The run directory.
        steps: Records in the run: one per optimizer step plus the final record (the state after the
            last update), so ``steps`` optimizer steps give ``steps + 1`` records.
        tensors: Tensors per record: params, grads and optimizer state (buffers and the batch besides).
        bytes_on_disk: Size of the run directory.
        final_loss: The loss of the last iteration.
        reexecuted: The step re-executed from its record.
        reexec_summary: The verdict of that re-execution (:meth:`stepdump.reexecute`'s summary).
        reproduces: Whether the re-execution reproduced the record bit for bit.
    """

    path: Path
    steps: int
    tensors: int
    bytes_on_disk: int
    final_loss: float
    reexecuted: int
    reexec_summary: str
    reproduces: bool


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The demo's model, optimizer and scheduler, freshly built and seeded."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1),  # no bias before BN
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    return model, opt, sched


def batch(step: int, size: int = 64) -> Batch:
    """Deterministic per step: ten Gaussian clusters in 32 dimensions."""
    g = torch.Generator().manual_seed(10_000 + step)
    centers = torch.Generator().manual_seed(7)
    mu = torch.randn(10, 32, generator=centers) * 2.0
    y = torch.randint(0, 10, (size,), generator=g)
    x = mu[y] + 2.5 * torch.randn(size, 32, generator=g)
    return x, y


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
            data: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration of the demo loop (the recorded loop and :func:`make_step` share it); returns
    the loss and the logits."""
    x, y = data
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    optimizer.step()
    sched.step()
    return loss, logits


def make_step() -> tuple[nn.Module, torch.optim.Optimizer, TrainStep, torch.optim.lr_scheduler.LRScheduler]:
    """The ``--entry`` factory of ``stepdump reexecute`` / ``bundle`` for the demo run.

    Returns:
        ``(model, optimizer, train_step, scheduler)`` built as the demo built them;
        ``train_step(model, optimizer, batch)`` runs one iteration of the demo loop.
    """
    model, opt, sched = build()

    def train_step(m: nn.Module, optimizer: torch.optim.Optimizer, data: Batch) -> torch.Tensor:
        return _update(m, optimizer, sched, data)[0]

    return model, opt, train_step, sched


def train(steps: int, rec: stepdump.Recorder, progress: Progress | None = None) -> float:
    """Train ``steps`` iterations of the model, optimizer and scheduler ``rec`` records; returns the last loss."""
    model, opt, sched = rec.model, rec.optimizer, rec.scheduler
    loss = torch.tensor(0.0)
    for step in range(steps):
        data = batch(step)
        rec.log_batch(data)  # stored with the step: reexecute and bundle need it
        loss, logits = _update(model, opt, sched, data)
        rec.log(loss=loss, acc=(logits.argmax(1) == data[1]).float().mean())
        if progress is not None:
            progress("training with stepdump", step + 1, steps)
    return float(loss.detach())


def run_demo(out: str | Path, steps: int = 200, progress: Progress | None = None) -> DemoResult:
    """Train ``steps`` steps with recording into ``out``, then re-execute one step from the record."""
    if steps < 1:
        raise ConfigError("--steps must be at least 1")
    out = Path(out)
    if (out / CATALOG_FILE).exists():
        # The demo owns its output directory: replace an earlier demo run.
        shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        raise RunExistsError(f"{out} exists and is not a stepdump run; choose another --out")
    model, opt, sched = build()
    with stepdump.Recorder(out, model, opt, scheduler=sched, metadata={"job": "stepdump demo"}) as rec:
        final = train(steps, rec, progress)
    step = min(EXAMPLE_STEP, steps - 1)
    with stepdump.open(out) as run:
        tensors = sum(len(run.names(k)) for k in ("params", "grads", "optimizer"))
        recorded = len(run.steps)
        m, o, train_step, s = make_step()
        res = stepdump.reexecute(run, step, m, o, train_step, s, repeat=2)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return DemoResult(out, recorded, tensors, size, final, step, res.summary(), res.reproduces)
