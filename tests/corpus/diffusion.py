"""A class-conditional DDPM denoiser trained the diffusers way.

Imitates huggingface/diffusers ``examples/unconditional_image_generation/train_unconditional.py``
(uniform random timesteps, ``noise_scheduler.add_noise``, MSE on the noise, AdamW, a cosine
schedule with warmup from lr 0, ``clip_grad_norm_``) with the embeddings of
``src/diffusers/models/unets/unet_2d.py``: ``time_embedding_type="learned"`` makes ``time_proj``
an ``nn.Embedding(num_train_timesteps, C)`` (only the rows of the batch's timesteps get a
gradient: a dense grad of which most rows are zero) and ``num_class_embeds`` a
``class_embedding`` table. A small MLP stands in for the UNet; the "images" are 16-vectors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import stepdump
from corpus import MODES

STEPS, WARMUP, T = 30, 5, 1000
CLASSES = 10
FAULTS: dict[str, int] = {}


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time_proj = nn.Embedding(T, 16)  # time_embedding_type="learned"
        self.time_embedding = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32))
        self.class_embedding = nn.Embedding(CLASSES, 32)
        self.conv_in = nn.Linear(16, 32)
        self.mid = nn.Sequential(nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.conv_out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        emb = self.time_embedding(self.time_proj(t)) + self.class_embedding(c)
        return self.conv_out(self.mid(self.conv_in(x) + emb))


def cosine_schedule_with_warmup(opt: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """diffusers.optimization.get_cosine_schedule_with_warmup."""
    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-6)
    sched = cosine_schedule_with_warmup(opt, WARMUP, STEPS)
    betas = torch.linspace(1e-4, 0.02, T)  # DDPMScheduler(beta_schedule="linear")
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    gen = torch.Generator().manual_seed(1)
    protos = torch.randn(CLASSES, 16, generator=gen)
    with stepdump.Recorder(path, model, opt, sched, **MODES[mode]) as rec:
        for _ in range(STEPS):
            c = torch.randint(0, CLASSES, (16,), generator=gen)
            clean = protos[c] + 0.1 * torch.randn(16, 16, generator=gen)
            noise = torch.randn(16, 16, generator=gen)
            t = torch.randint(0, T, (16,), generator=gen)
            a = alphas_cumprod[t][:, None]
            noisy = a.sqrt() * clean + (1 - a).sqrt() * noise  # noise_scheduler.add_noise
            loss = nn.functional.mse_loss(model(noisy, t, c), noise)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            rec.log(loss=loss.item(), lr=sched.get_last_lr()[0])
    return {"": path}
