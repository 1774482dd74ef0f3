"""Image classification the torchvision way, in miniature.

Imitates pytorch/vision ``references/classification/train.py`` (``main`` and ``train_one_epoch``):
SGD with momentum and weight decay in two param groups (no decay on norm layers,
``utils.set_weight_decay``), ``LinearLR(start_factor=0.01)`` warmup then ``CosineAnnealingLR``
chained by ``SequentialLR`` and stepped once per epoch (so the lr climbs in stairs),
``CrossEntropyLoss(label_smoothing=0.1)``, mixup on the batch (``transforms.RandomMixup``),
bf16 autocast (``--amp``; bf16 on a CPU, no GradScaler), and an EMA of the weights
(``utils.ExponentialMovingAverage``, a ``torch.optim.swa_utils.AveragedModel``) updated every
``model_ema_steps`` iterations. A tiny CNN on 3x8x8 synthetic images of 10 classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import stepdump
from corpus import MODES

STEPS_PER_EPOCH = 4
EPOCHS = 8
WARMUP_EPOCHS = 3
CLASSES = 10
# Faults this loop can plant, and the step each starts at.
FAULTS = {"nan_batch": 13, "lr_x1000": 14, "dead_relu": 10, "frozen_in_optimizer": 0,
          "forgotten_in_optimizer": 0, "loss_flat": 0}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def set_weight_decay(model: nn.Module, weight_decay: float, norm_weight_decay: float = 0.0,
                     skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """torchvision's utils.set_weight_decay: norm layers' params in a group of their own."""
    norm, other = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:  # as upstream: frozen params are left out
                continue
            if any(p is q for q in skip):
                continue
            (norm if isinstance(module, nn.modules.batchnorm._BatchNorm) else other).append(p)
    return [{"params": other, "weight_decay": weight_decay}, {"params": norm, "weight_decay": norm_weight_decay}]


def mixup(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, alpha: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """transforms.RandomMixup: one-hot targets, the batch mixed with itself rolled by one."""
    target = nn.functional.one_hot(y, CLASSES).float()
    lam = float(torch.distributions.Beta(alpha, alpha).sample()) if torch.rand(1, generator=gen) < 0.5 else 1.0
    return x.roll(1, 0).mul(1 - lam).add(x * lam), target.roll(1, 0).mul(1 - lam).add(target * lam)


def data(gen: torch.Generator, centers: torch.Tensor, shuffled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, CLASSES, (16,), generator=gen)
    x = centers[y] + 0.5 * torch.randn(16, 3, 8, 8, generator=gen)
    if shuffled:  # a data-pipeline bug: labels no longer belong to their images
        y = torch.randint(0, CLASSES, (16,), generator=gen)
    return x, y


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    centers = torch.randn(CLASSES, 3, 8, 8, generator=gen)
    model = Net()
    skip = (model.fc1.bias,) if fault == "forgotten_in_optimizer" else ()
    opt = torch.optim.SGD(set_weight_decay(model, 1e-4, skip=skip), lr=0.2, momentum=0.9, weight_decay=1e-4)
    if fault == "frozen_in_optimizer":
        model.fc1.weight.requires_grad_(False)  # by mistake, after the optimizer took it
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=WARMUP_EPOCHS)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS - WARMUP_EPOCHS)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, schedulers=[warmup, cosine], milestones=[WARMUP_EPOCHS])
    decay = 0.99
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(decay), use_buffers=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    with stepdump.Recorder(path, model, opt, sched, **MODES[mode]) as rec:
        for epoch in range(EPOCHS):
            model.train()
            for i in range(STEPS_PER_EPOCH):
                t = epoch * STEPS_PER_EPOCH + i
                image, target = mixup(*data(gen, centers, fault == "loss_flat"), gen)
                if fault == "nan_batch" and t == FAULTS["nan_batch"]:
                    image[3, 0, 2, 2] = float("nan")  # one corrupt pixel in one image
                if fault == "dead_relu" and t == FAULTS["dead_relu"]:
                    with torch.no_grad():
                        model.fc1.bias.fill_(-1e3)  # every unit after fc1 stops firing
                rec.log_batch((image, target))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    output = model(image)
                    loss = criterion(output, target)
                opt.zero_grad()
                loss.backward()
                if fault == "lr_x1000" and t == FAULTS["lr_x1000"]:
                    for g in opt.param_groups:
                        g["lr"] *= 1000
                opt.step()
                if fault == "lr_x1000" and t == FAULTS["lr_x1000"]:
                    for g in opt.param_groups:
                        g["lr"] /= 1000
                if t % 2 == 0:  # model_ema_steps
                    ema.update_parameters(model)
                    if epoch < WARMUP_EPOCHS:
                        ema.n_averaged.fill_(0)  # upstream: the EMA restarts while the lr warms up
                acc1 = (output.argmax(1) == target.argmax(1)).float().mean()
                rec.log(loss=loss.item(), acc1=acc1.item())
            sched.step()
    return {"": path}
