"""The training workloads the benchmarks record: model, optimizer, one step.

Each workload is built fresh (same seed) for every variant, so every variant
trains the same model on the same data and pays the same allocation costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Workload:
    """A model, its optimizer and a closure that runs one training iteration.

    ``step(hook)`` runs forward, backward, then ``hook()`` (where a hand-written
    recorder would capture: grads final, params not yet updated), then
    ``optimizer.step()``. stepdump does not use the hook: it captures from the
    optimizer's step pre-hook, which fires at the same moment.
    """

    name: str
    title: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[Callable[[], None] | None], float]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a full record holds: params, grads, optimizer state."""
        for n, p in self.model.named_parameters():
            yield f"params/{n}", p
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                yield f"grads/{n}", p.grad
        for n, p in self.model.named_parameters():
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    yield f"optimizer/{n}.{k}", v

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


# -- (A) MLP -----------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp(seed: int = 0, blocks: int = 4, d: int = 512, h: int = 2048, batch: int = 64) -> Workload:
    """(A) 4 blocks Linear(512,2048) -> GELU -> Linear(2048,512), Adam, MSE."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[_Block(d, h) for _ in range(blocks)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, d, generator=g)
    y = torch.randn(batch, d, generator=g)
    loss_fn = nn.MSELoss()

    def step(hook: Callable[[], None] | None = None) -> float:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        if hook is not None:
            hook()
        opt.step()
        return float(loss.detach())

    return Workload("A", f"MLP {blocks}x[Linear({d},{h})-GELU-Linear({h},{d})], Adam, batch {batch}, MSE",
                    model, opt, step)


# -- (B) GPT-style transformer ---------------------------------------------------------
class TinyGPT(nn.Module):
    """Token + position embeddings, causal TransformerEncoder layers, LM head."""

    def __init__(self, vocab: int = 4096, d: int = 256, heads: int = 4, layers: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def gpt(seed: int = 0, batch: int = 8, seq: int = 128, vocab: int = 4096) -> Workload:
    """(B) 4 layers, d_model 256, 4 heads, seq 128, vocab 4096, AdamW, random tokens."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, seq=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss_fn = nn.CrossEntropyLoss()

    def step(hook: Callable[[], None] | None = None) -> float:
        opt.zero_grad(set_to_none=False)
        logits = model(x)
        loss = loss_fn(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        if hook is not None:
            hook()
        opt.step()
        return float(loss.detach())

    return Workload("B", f"GPT-style transformer: 4 layers, d_model 256, 4 heads, seq {seq}, vocab {vocab}, "
                         f"batch {batch}, AdamW, random tokens", model, opt, step)


WORKLOADS: dict[str, Callable[..., Workload]] = {"A": mlp, "B": gpt}


def tiny_linear(seed: int = 0, d_in: int = 512, d_out: int = 512, batch: int = 32) -> Workload:
    """A single Linear layer with Adam: for the read-side and long-run benchmarks."""
    torch.manual_seed(seed)
    model = nn.Linear(d_in, d_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randn(batch, d_out, generator=g)

    def step(hook: Callable[[], None] | None = None) -> float:
        opt.zero_grad(set_to_none=False)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if hook is not None:
            hook()
        opt.step()
        return float(loss.detach())

    return Workload("tiny", f"Linear({d_in},{d_out}), Adam, batch {batch}", model, opt, step)
