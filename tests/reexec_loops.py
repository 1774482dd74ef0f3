"""Loops for the re-execution tests: a nanoGPT-style GPT (dropout, AdamW, gradient accumulation 2,
clipping, warmup + cosine lr set by hand) and a small regression model with a NaN planted in one
module's forward. Each exposes a factory ``() -> (model, optimizer, train_step)`` as the CLI's
``--entry`` expects, and ``record(path, mode, ...)`` that trains with that same train_step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import stepdump

VOCAB, BLOCK, N_EMBD, N_HEAD, N_LAYER, ACCUM, CLIP = 32, 8, 16, 2, 2, 2, 1.0
LR, MIN_LR, WARMUP, MAX_ITERS = 1e-3, 1e-4, 2, 8
FLIPPED = "transformer.h.0.mlp.c_fc.weight"

MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lean": {"every": None, "stats_every": 1},
    "keyframe": {"keyframe_every": 3},
    "gradlog": {"gradient_log": 3},
    "every2": {"every": 2},
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(N_EMBD, 3 * N_EMBD), nn.Linear(N_EMBD, N_EMBD)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (z.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for z in self.c_attn(x).split(N_EMBD, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Noise(nn.Module):
    """Noise from a generator seeded from the OS: no restored RNG state can make it repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator()
        self.gen.seed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * torch.randn(x.shape, generator=self.gen)


class MLP(nn.Module):
    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD)
        self.noise = Noise() if noisy else nn.Identity()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.noise(self.gelu(self.c_fc(x)))))


class Block(nn.Module):
    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(N_EMBD), Attention(), nn.LayerNorm(N_EMBD), MLP(noisy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(BLOCK, N_EMBD), drop=nn.Dropout(0.1),
            h=nn.ModuleList([Block(noisy and i == 0) for i in range(N_LAYER)]), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1))))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_lr(it: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (MAX_ITERS - WARMUP))) * (LR - MIN_LR)


def _iteration(opt: torch.optim.Optimizer) -> int:
    """Updates done so far, from AdamW's own step counter (what nanoGPT's iter_num counts)."""
    p = opt.param_groups[0]["params"][0]
    return int(opt.state[p]["step"]) if p in opt.state else 0


def gpt_train_step(model: nn.Module, opt: torch.optim.Optimizer, micro: list) -> float:
    for group in opt.param_groups:
        group["lr"] = get_lr(_iteration(opt))
    total = 0.0
    for x, y in micro:
        loss = model(x, y) / ACCUM
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def gpt_factory(noisy: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = GPT(noisy)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    return model, opt, gpt_train_step


def token_batches(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (400,), generator=gen)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(ACCUM):
            ix = torch.randint(len(data) - BLOCK - 1, (4,), generator=gen)
            micro.append((torch.stack([data[i:i + BLOCK] for i in ix]),
                          torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])))
        out.append(micro)
    return out


def flip_low_bit(t: torch.Tensor) -> None:
    """One flipped bit: the lowest mantissa bit of the first element (a float32 tensor)."""
    t.view(-1)[:1].view(torch.int32).bitwise_xor_(1)


def record_gpt(path: Path, mode: str, *, steps: int = 6, flip_at: int | None = None, noisy: bool = False) -> Path:
    """Train the GPT for ``steps`` iterations, each micro-batch given to ``log_batch``. ``flip_at``: one
    bit of one grad flips after clipping, before the update (an optimizer pre-hook registered before
    the Recorder's): the update uses it and the record holds it, as a fault in the hardware would."""
    model, opt, train_step = gpt_factory(noisy)
    if flip_at is not None:
        def flip(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if _iteration(o) == flip_at:
                flip_low_bit(model.get_parameter(FLIPPED).grad)
        opt.register_step_pre_hook(flip)
    with stepdump.Recorder(path, model, opt, **MODES[mode]) as rec:
        for micro in token_batches(steps):
            for b in micro:
                rec.log_batch(b)
            rec.log(loss=train_step(model, opt, micro))
    return path


# -- a NaN planted in one module's forward ---------------------------------------------------------
class Prep(nn.Module):
    """Square roots of the features: a NaN wherever the batch holds a negative value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x) * 2.0


def nan_factory() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("prep", Prep())
    model.add_module("fc1", nn.Linear(4, 8))
    model.add_module("act", nn.Tanh())
    model.add_module("fc2", nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), nan_train_step


def nan_train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> float:
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def nan_batch(step: int, bad_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.rand(6, 4, generator=g), torch.rand(6, 1, generator=g)
    if step == bad_step:
        x[2, 1] = -0.5  # one bad sample in one batch
    return x, y


def record_nan(path: Path, mode: str, bad_step: int, steps: int = 6) -> Path:
    model, opt, train_step = nan_factory()
    with stepdump.Recorder(path, model, opt, **MODES[mode]) as rec:
        for t in range(steps):
            b = nan_batch(t, bad_step)
            rec.log_batch(b)
            rec.log(loss=train_step(model, opt, b))
    return path
