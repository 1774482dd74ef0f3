"""Loop shapes that edit params between updates or draw from the RNG inside the iteration, for the
re-execution cause tests (tests/test_reexec_causes.py).

Each shape is a training loop as people write it: nanoGPT's ``get_batch`` drawing its indices from
the global torch RNG (and prefetching the next micro-batch between forwards), a clamp after the
step, an EMA swapped in for an evaluation, a schedule-free-style optimizer whose ``eval()`` /
``train()`` round trip is not bitwise, a Lookahead-style sync of slow weights every few steps, and a
batch augmentation drawing from numpy and torch. The recorded loop and the ``train_step`` given to
``reexecute`` run the same :func:`iteration`; only where the batches come from differs (drawn and
logged, or the recorded ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import stepdump

ACCUM, STEPS, N = 2, 6, 48
MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "keyframe": {"keyframe_every": 3},
    "gradlog": {"gradient_log": 3},
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 12), nn.Dropout(0.25), nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 6, generator=g), torch.randn(N, 1, generator=g)


class ScheduleFreeSGD(torch.optim.Optimizer):
    """The shape of schedule-free SGD (Defazio et al.; the ``schedulefree`` package): the params hold
    an interpolation y of the base sequence z and its average x; ``eval()`` moves them to x and
    ``train()`` back to y, a round trip that is not bitwise (a division and a multiplication)."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.training = True

    @torch.no_grad()
    def eval(self) -> None:
        if self.training:
            for g in self.param_groups:
                for p in g["params"]:
                    if "z" in self.state[p]:
                        p.sub_(self.state[p]["z"], alpha=1 - g["beta"]).div_(g["beta"])
            self.training = False

    @torch.no_grad()
    def train(self) -> None:
        if not self.training:
            for g in self.param_groups:
                for p in g["params"]:
                    if "z" in self.state[p]:
                        p.mul_(g["beta"]).add_(self.state[p]["z"], alpha=1 - g["beta"])
            self.training = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "z" not in st:
                    st["z"] = p.detach().clone()
                st["z"].add_(p.grad, alpha=-g["lr"])
                p.lerp_(st["z"], 1 - g["beta"])


@dataclass
class Shape:
    """One loop: how its optimizer is made, how a batch is drawn, what it does after the update."""

    name: str
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    draw: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    after_step: Callable[[nn.Module, torch.optim.Optimizer, int, dict[str, Any]], None]
    #: Steps t whose record t+1 holds params the loop changed after update t (None: none).
    edits: Callable[[int], bool] = lambda t: False


def _get_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(N, (8,))  # nanoGPT's get_batch: the global torch RNG
    return x[ix], y[ix]


def _augment(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    start = int(np.random.randint(0, N - 8))  # numpy picks the window, torch adds the jitter
    xb = x[start:start + 8]
    return xb + 0.05 * torch.randn_like(xb), y[start:start + 8]


def _nothing(model: nn.Module, opt: torch.optim.Optimizer, t: int, held: dict[str, Any]) -> None:
    pass


def _clamp(model: nn.Module, opt: torch.optim.Optimizer, t: int, held: dict[str, Any]) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.25, 0.25)  # through .data: no version counter sees it


def _evaluate(model: nn.Module) -> None:
    x, _ = data()
    model.eval()
    with torch.no_grad():
        model(x[:4])
    model.train()


def _ema_swap(model: nn.Module, opt: torch.optim.Optimizer, t: int, held: dict[str, Any]) -> None:
    ema = held.setdefault("ema", [p.detach().clone() for p in model.parameters()])
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.lerp_(p, 0.1)
    if t % 2 == 1:  # evaluate the EMA weights: swap in, evaluate, swap back (bitwise round trip)
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                tmp = p.detach().clone()
                p.copy_(e)
                e.copy_(tmp)
        _evaluate(model)
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                tmp = p.detach().clone()
                p.copy_(e)
                e.copy_(tmp)


def _sf_eval(model: nn.Module, opt: torch.optim.Optimizer, t: int, held: dict[str, Any]) -> None:
    if t % 2 == 1:
        opt.eval()  # type: ignore[attr-defined]
        _evaluate(model)
        opt.train()  # type: ignore[attr-defined]


def _lookahead(model: nn.Module, opt: torch.optim.Optimizer, t: int, held: dict[str, Any]) -> None:
    slow = held.setdefault("slow", [p.detach().clone() for p in model.parameters()])
    if t % 3 == 2:  # every k=3 updates: slow += 0.5 (fast - slow); fast = slow
        with torch.no_grad():
            for s, p in zip(slow, model.parameters()):
                s.add_(p - s, alpha=0.5)
                p.data.copy_(s)


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=0.01)


SHAPES = {
    "get_batch": Shape("get_batch", _adamw, _get_batch, _nothing),
    "augment": Shape("augment", _sgd, _augment, _nothing),
    "clamp": Shape("clamp", _sgd, _get_batch, _clamp, edits=lambda t: True),
    "ema_swap": Shape("ema_swap", _adamw, _get_batch, _ema_swap),
    "schedule_free": Shape("schedule_free", lambda m: ScheduleFreeSGD(m.parameters()), _get_batch, _sf_eval,
                           edits=lambda t: t % 2 == 1),
    "lookahead": Shape("lookahead", _adamw, _get_batch, _lookahead, edits=lambda t: t % 3 == 2),
}


def iteration(model: nn.Module, opt: torch.optim.Optimizer, fetch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
              log: Callable[[Any], None] | None = None) -> float:
    """One nanoGPT-style iteration: the first micro-batch fetched, then each forward followed by the
    next fetch (the prefetch between micro-batches), backward, and one update."""
    total = 0.0
    batch = fetch()
    for i in range(ACCUM):
        if log is not None:
            log(batch)
        loss = F.mse_loss(model(batch[0]), batch[1]) / ACCUM
        if i + 1 < ACCUM:
            batch = fetch()  # drawn while the forward's graph is alive, as nanoGPT prefetches
        loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def factory(shape: Shape) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """(model, optimizer, train_step) as ``reexecute`` takes them: train_step runs :func:`iteration`
    on the recorded micro-batches (a list, one per ``log_batch`` call)."""
    torch.manual_seed(0)
    model = Net()

    def train_step(m: nn.Module, o: torch.optim.Optimizer, micro: list) -> float:
        it = iter(micro)
        return iteration(m, o, lambda: next(it))

    return model, shape.optimizer(model), train_step


def train(shape: Shape, steps: int = STEPS, path: Path | None = None, mode: str = "full",
          flip: tuple[int, str] | None = None, **options: Any) -> dict[str, torch.Tensor]:
    """Run the loop (recorded at ``path`` in ``mode`` when given); return the final params.
    ``flip``: (step, param name): one bit of that grad flips right before the update at that step
    (an optimizer pre-hook registered before the Recorder's), as a hardware fault would."""
    model, opt, _ = factory(shape)
    np.random.seed(3)
    x, y = data()
    held: dict[str, Any] = {}
    if flip is not None:
        def flipper(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if held.get("t") == flip[0]:
                g = model.get_parameter(flip[1]).grad
                g.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        opt.register_step_pre_hook(flipper)
    rec = stepdump.Recorder(path, model, opt, **{**MODES[mode], **options}) if path is not None else None
    try:
        for t in range(steps):
            held["t"] = t
            loss = iteration(model, opt, lambda: shape.draw(x, y), rec.log_batch if rec is not None else None)
            if rec is not None:
                rec.log(loss=loss)
            shape.after_step(model, opt, t, held)
    finally:
        if rec is not None:
            rec.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
