"""timm's warmup: from ``warmup_lr_init`` (1e-6) to the base lr, then cosine, set by hand each update.

Imitates huggingface/pytorch-image-models ``timm/scheduler/cosine_lr.py`` (``CosineLRScheduler._get_lr``
with ``warmup_t``, ``warmup_lr_init`` and ``warmup_prefix=True``) as ``train.py`` drives it per update
(``lr_scheduler.step_update(num_updates)``), with AdamW and weight decay left off biases and norm
layers (``param_groups_weight_decay``). The model and data are the classification loop's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import stepdump
from corpus import MODES
from corpus.classification import CLASSES, Net, data

STEPS = 30
WARMUP_T = 5
BASE_LR, WARMUP_LR_INIT, LR_MIN = 5e-3, 1e-6, 1e-5
FAULTS: dict[str, int] = {}


def lr_at(t: int) -> float:
    if t < WARMUP_T:
        return WARMUP_LR_INIT + t * (BASE_LR - WARMUP_LR_INIT) / WARMUP_T
    t -= WARMUP_T
    return LR_MIN + 0.5 * (BASE_LR - LR_MIN) * (1 + math.cos(math.pi * t / (STEPS - WARMUP_T)))


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    centers = torch.randn(CLASSES, 3, 8, 8, generator=gen)
    model = Net()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.05}],
                            lr=BASE_LR)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    with stepdump.Recorder(path, model, opt, **MODES[mode]) as rec:
        for t in range(STEPS):
            for g in opt.param_groups:  # lr_scheduler.step_update(num_updates=t)
                g["lr"] = lr_at(t)
            image, target = data(gen, centers)
            loss = criterion(model(image), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.log(loss=loss.item())
    return {"": path}
