"""nanoGPT: a GPT trained with gradient accumulation, clipping and a hand-set warmup + cosine lr.

Imitates karpathy/nanoGPT ``model.py`` (``GPT`` with ``wte``/``wpe`` embeddings, pre-norm blocks,
``lm_head`` tied to ``wte``, normal(0, 0.02) init with scaled ``c_proj``, and
``configure_optimizers``: AdamW, betas (0.9, 0.95), decay only on tensors of 2+ dims) and
``train.py`` (``get_lr``: linear warmup ``lr * (it + 1) / (warmup_iters + 1)`` then cosine to
``min_lr``, written into every param group; ``gradient_accumulation_steps`` micro-batches each
scaled by 1/steps; ``clip_grad_norm_(grad_clip=1.0)``; ``zero_grad(set_to_none=True)``). The loop
also logs the pre-clip norm ``clip_grad_norm_`` returns, as ``grad_norm``. Tiny sizes, a
synthetic token stream with a learnable pattern.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import stepdump
from corpus import MODES

VOCAB, BLOCK, N_EMBD, N_HEAD, N_LAYER = 32, 8, 16, 2, 2
MAX_ITERS, WARMUP_ITERS, GRAD_ACCUM = 30, 4, 2
LEARNING_RATE, MIN_LR, GRAD_CLIP = 1e-3, 1e-4, 1.0  # config/train_shakespeare_char.py
FAULTS = {"nan_forward": 15, "exploding_grad": 16}
EXPLODING = "transformer.h.0.mlp.c_fc.weight"


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (z.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(N_EMBD), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(N_EMBD), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(BLOCK, N_EMBD),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def get_lr(it: int) -> float:
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    decay_ratio = (it - WARMUP_ITERS) / (MAX_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (LEARNING_RATE - MIN_LR)


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(0.1, LEARNING_RATE)
    gen = torch.Generator().manual_seed(1)
    # A stream where each token mostly follows from the one before: something to learn.
    stream = [0]
    for _ in range(4000):
        nxt = (stream[-1] * 5 + 3) % VOCAB
        stream.append(nxt if torch.rand(1, generator=gen) < 0.9 else int(torch.randint(0, VOCAB, (1,), generator=gen)))
    data = torch.tensor(stream)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK, (8,), generator=gen)
        return torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])

    iter_num = 0

    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * float("nan") if fault == "nan_forward" and iter_num == FAULTS["nan_forward"] else None

    model.transformer.ln_f.register_forward_hook(poison)
    X, Y = get_batch()
    with stepdump.Recorder(path, model, optimizer, **MODES[mode]) as rec:
        while iter_num < MAX_ITERS:
            lr = get_lr(iter_num)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            for _ in range(GRAD_ACCUM):
                _, loss = model(X, Y)
                loss = loss / GRAD_ACCUM
                X, Y = get_batch()
                loss.backward()
            if fault == "exploding_grad" and iter_num == FAULTS["exploding_grad"]:
                model.get_parameter(EXPLODING).grad.mul_(1e4)  # one layer's backward goes wrong
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rec.log(loss=loss.item() * GRAD_ACCUM, grad_norm=grad_norm.item())
            iter_num += 1
    return {"": path}
