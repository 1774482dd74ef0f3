"""The small LightningModule of tests/test_integrations_lightning.py under ``StepdumpCallback``.

Its ``Net`` (an MLP with BatchNorm) with the optimizer a Lightning user writes in
``configure_optimizers``: AdamW with a per-step warmup + cosine schedule, trained with
``accumulate_grad_batches=2`` and ``gradient_clip_val``. Upstream: Lightning-AI/pytorch-lightning
``src/lightning/pytorch/loops/optimization/automatic.py`` (the step, closure and clipping order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from corpus import MODES

STEPS = 24
FAULTS: dict[str, int] = {}


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    from helpers import regression_loader
    from test_integrations_lightning import Net, _trainer

    from stepdump.integrations.lightning import StepdumpCallback

    class Cosine(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 4)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    trainer = _trainer([StepdumpCallback(path, **MODES[mode])], max_steps=STEPS, accumulate_grad_batches=2,
                       gradient_clip_val=0.5)
    trainer.fit(Cosine(), regression_loader())
    return {"": path}
