"""A tiny deterministic training run recorded by stepdump, for analysis and CLI tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import stepdump

Hook = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def make_model(seed: int = 0, act: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), act or nn.GELU(), nn.Linear(16, 4))


def record(path: Path, steps: int = 12, *, seed: int = 0, before_step: Hook | None = None,
           act: nn.Module | None = None, **rec_kwargs: object) -> Path:
    """Train a small MLP with Adam + StepLR on fixed data, recording every step."""
    model = make_model(seed, act)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    with stepdump.Recorder(path, model, opt, scheduler=sched, **rec_kwargs) as rec:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=g)
            y = torch.randn(16, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if before_step is not None:
                before_step(step, model, opt)
            opt.step()
            sched.step()
            rec.log(loss=loss)
    return path
