"""Regenerate tests/golden/v1_run (only when FORMAT_VERSION changes on purpose).

    .venv/bin/python tests/golden/make_golden.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import stepdump

HERE = Path(__file__).parent


def golden_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def golden_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / (step + 1)
    return x, torch.ones(4, 2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rec: stepdump.Recorder | None, steps: int = 3) -> None:
    for step in range(steps):
        x, y = golden_batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rec is not None:
            rec.log(loss=loss)


def main() -> None:
    out = HERE / "v1_run"
    shutil.rmtree(out, ignore_errors=True)
    model, opt = golden_model()
    with stepdump.Recorder(out, model, opt) as rec:
        train(model, opt, rec)
    (out / "LOCK").unlink()


if __name__ == "__main__":
    main()
