"""Small, fast training loops (issue 25): where a per-step fixed cost dominates.

* ``nanogpt_tiny``: nanoGPT's tiny config (2 layers, n_embd 64, block 64, batch 8, gradient
  accumulation 2, AdamW, clipping at 1.0), random tokens, vocab 65 (shakespeare_char's).
  ``entry="forward"`` calls ``model(x)``; ``entry="encode"`` calls ``model.encode(x)``, which
  runs the submodules one by one, so the top module's forward hooks never fire (a loop
  that calls the model through another entry point).
* ``rl_small``: a cleanrl-PPO-sized update (two 64-wide MLP heads, Adam, clipping, 4
  minibatches of 64 per step is too slow; one minibatch of 256 per step), ~ms per step.

Each returns a :class:`workloads.Workload` (``step(hook)``: one optimizer step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from workloads import Workload


class _Attn(nn.Module):
    def __init__(self, d: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _Attn(d, heads, block)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model at a small config (weight-tied head)."""

    def __init__(self, vocab: int = 65, block: int = 64, layers: int = 2, heads: int = 4, d: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(_Block(d, heads, block) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        """The logits, through the submodules one by one (not ``forward``: no top-level hooks fire)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.encode(idx)


def nanogpt_tiny(seed: int = 0, entry: str = "forward", batch: int = 8, block: int = 64,
                 accumulation: int = 2, vocab: int = 65) -> Workload:
    """nanoGPT tiny: 2 layers, n_embd 64, block 64, batch 8, accumulation 2, AdamW, clip 1.0."""
    torch.manual_seed(seed)
    model = NanoGPT(vocab=vocab, block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (accumulation, batch, block + 1), generator=g)
    call = model if entry == "forward" else model.encode

    def step(hook: Callable[[], None] | None = None) -> float:
        total = 0.0
        for micro in range(accumulation):
            x, y = tokens[micro, :, :-1], tokens[micro, :, 1:]
            logits = call(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)) / accumulation
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if hook is not None:
            hook()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    n = sum(p.numel() for p in model.parameters())
    return Workload(f"tiny-{entry}", f"nanoGPT tiny (2 layers, n_embd 64, block {block}, batch {batch}, "
                    f"accumulation {accumulation}, AdamW, clip 1.0; {n / 1e3:.0f} k params), called through "
                    f"`{'model(x)' if entry == 'forward' else 'model.encode(x)'}`", model, opt, step)


class _PPO(nn.Module):
    def __init__(self, obs: int = 8, act: int = 4, h: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))
        self.actor = nn.Sequential(nn.Linear(obs, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, act))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(x), self.critic(x)


def rl_small(seed: int = 0, batch: int = 256, obs: int = 8, act: int = 4) -> Workload:
    """A cleanrl-PPO-sized update: actor and critic MLPs (64 wide), Adam, clip 0.5, one minibatch."""
    torch.manual_seed(seed)
    model = _PPO(obs, act)
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, obs, generator=g)
    a = torch.randint(0, act, (batch,), generator=g)
    adv = torch.randn(batch, generator=g)
    ret = torch.randn(batch, generator=g)
    old_logp = torch.full((batch,), -math.log(act))

    def step(hook: Callable[[], None] | None = None) -> float:
        logits, value = model(x)
        logp = torch.distributions.Categorical(logits=logits).log_prob(a)
        ratio = (logp - old_logp).exp()
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss = pg + 0.5 * ((value.squeeze(-1) - ret) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if hook is not None:
            hook()
        opt.step()
        return float(loss.detach())

    n = sum(p.numel() for p in model.parameters())
    return Workload("rl", f"PPO-sized update (actor + critic MLPs 64 wide, Adam, clip 0.5, batch {batch}; "
                    f"{n / 1e3:.1f} k params)", model, opt, step)


TINY: dict[str, Callable[[], Workload]] = {
    "tiny-forward": lambda: nanogpt_tiny(entry="forward"),
    "tiny-encode": lambda: nanogpt_tiny(entry="encode"),
    "rl": rl_small,
}


def segment_steps(w: Workload, least: int, min_seconds: float) -> int:
    """Steps of ``w`` a timed segment takes: at least ``least``, and at least ``min_seconds`` at the
    speed of five steps timed after five to warm up (the writer commits about once a COMMIT_WINDOW:
    a segment shorter than a few windows would leave its writer work to close(), timed apart)."""
    for _ in range(5):
        w.step(None)
    t0 = time.perf_counter()
    for _ in range(5):
        w.step(None)
    return max(least, math.ceil(min_seconds / ((time.perf_counter() - t0) / 5)))
