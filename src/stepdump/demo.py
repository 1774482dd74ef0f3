"""The demo job: a small training run recorded by stepdump, timed with and without.

The model is an MLP classifier on synthetic Gaussian clusters (no download),
trained with AdamW, a StepLR schedule and dropout, so every part of a record
(params, grads, optimizer moments, scheduler, RNG, scalars) has content.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import stepdump
from stepdump.errors import ConfigError, RunExistsError
from stepdump.store.format import CATALOG_FILE

Progress = Callable[[str, int, int], None]


@dataclass
class DemoResult:
    path: Path
    steps: int
    tensors: int
    bytes_on_disk: int
    ms_per_step_plain: float
    ms_per_step_recorded: float
    final_loss: float


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    return model, opt, sched


def batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per step: ten Gaussian clusters in 32 dimensions."""
    g = torch.Generator().manual_seed(10_000 + step)
    centers = torch.Generator().manual_seed(7)
    mu = torch.randn(10, 32, generator=centers) * 2.0
    y = torch.randint(0, 10, (size,), generator=g)
    x = mu[y] + 2.5 * torch.randn(size, 32, generator=g)
    return x, y


def train(steps: int, rec: stepdump.Recorder | None, progress: Progress | None, label: str) -> tuple[float, float]:
    model, opt, sched = (rec.model, rec.optimizer, rec.scheduler) if rec is not None else build()
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        opt.step()
        sched.step()
        if rec is not None:
            rec.log(loss=loss, acc=(logits.argmax(1) == y).float().mean())
        if progress is not None:
            progress(label, step + 1, steps)
    return (time.perf_counter() - t0) * 1000 / max(steps, 1), float(loss.detach())


def run_demo(out: str | Path, steps: int = 200, progress: Progress | None = None) -> DemoResult:
    """Train ``steps`` steps without and then with recording into ``out``."""
    if steps < 1:
        raise ConfigError("--steps must be at least 1")
    out = Path(out)
    if (out / CATALOG_FILE).exists():
        # The demo owns its output directory: replace an earlier demo run.
        shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        raise RunExistsError(f"{out} exists and is not a stepdump run; choose another --out")
    train(min(steps, 20), None, None, "warm-up")  # first steps pay one-off allocation costs
    ms_plain, _ = train(steps, None, progress, "training without recording")
    model, opt, sched = build()
    t0 = time.perf_counter()
    with stepdump.Recorder(out, model, opt, scheduler=sched, metadata={"job": "stepdump demo"}) as rec:
        _, final = train(steps, rec, progress, "training with stepdump")
    # Includes close(): the writer's remaining work counts against recording.
    ms_rec = (time.perf_counter() - t0) * 1000 / steps
    with stepdump.open(out) as run:
        tensors = sum(len(run.names(k)) for k in ("params", "grads", "optimizer"))
        recorded = len(run.steps)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return DemoResult(out, recorded, tensors, size, ms_plain, ms_rec, final)
