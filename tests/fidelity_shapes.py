"""Model shapes of the fidelity matrix: what people train beyond one plain Linear stack.

Each is AdamW (for-loop implementation) unless the shape is about the optimizer
(sparse gradients, closures, momentum state of sparse grads). How the cases are
checked is in test_fidelity_matrix.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fidelity_cases import (
    Bag,
    Case,
    Setup,
    Small,
    closure_iteration,
    data,
    mse,
    plain_iteration,
    seed_all,
)
from torch import nn
from torch.optim import lr_scheduler


class WithBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(torch.tanh(self.enc(x))))


class Noisy(nn.Module):
    """Dropout from the torch RNG, noise from numpy's and Python's: restore must set all three."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        h = h + torch.from_numpy(np.random.rand(*h.shape).astype(np.float32)) * 0.01 * random.random()
        return self.fc2(h)


class Branchy(nn.Module):
    """A branch used on some steps only: its params have no grad at the other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.side, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc2(self.side(h) if self.use_side else h)


def _adamw(params: Any, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, foreach=False, **kw)


def _make(model_fn: Callable[[], nn.Module], opt_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
          scaler: bool = False,
          sched_fn: Callable[[torch.optim.Optimizer], Any] | None = None) -> Callable[[int], Setup]:
    def make(seed: int) -> Setup:
        seed_all(seed)
        model = model_fn()
        opt = opt_fn(model) if opt_fn is not None else _adamw(model.parameters())
        return Setup(model, opt, sched=sched_fn(opt) if sched_fn is not None else None,
                     scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None)

    return make


def _frozen() -> nn.Module:
    m = Small()
    m.fc1.requires_grad_(False)
    return m


def _groups(m: nn.Module) -> torch.optim.Optimizer:
    return _adamw([{"params": m.fc1.parameters(), "lr": 3e-2, "weight_decay": 0.1},
                   {"params": m.fc2.parameters(), "betas": (0.8, 0.9)}])


def _branchy_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    setup.model.use_side = t % 2 == 0
    plain_iteration(setup, t, capture)  # zero_grad sets grads to None: the side has none at odd steps


def _side_group(m: nn.Module) -> torch.optim.Optimizer:
    return _adamw([{"params": [*m.fc1.parameters(), *m.fc2.parameters()]},
                   {"params": m.side.parameters(), "lr": 2e-2}])


def _side_late_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    # A whole group without grads at even steps, step 0 included: its AdamW state appears mid-run.
    setup.model.use_side = t % 2 == 1
    plain_iteration(setup, t, capture)


# -- AMP ----------------------------------------------------------------------------

SKIP_AT = (1, 3)  # iterations whose loss is made inf: the GradScaler skips the update


def _amp_step(setup: Setup, t: int, capture: Callable[[], None], *, dtype: torch.dtype, poison: dict[int, float],
              unscale: bool, clip: float | None = None) -> None:
    """One AMP iteration: autocast in ``dtype``, the loss made ``poison[t]`` (inf/NaN: the GradScaler
    skips), then either an explicit ``unscale_`` (and clipping) or scaler.step unscaling on its own."""
    x, y = data(t)
    with torch.autocast("cpu", dtype=dtype):
        loss = mse(setup.model(x), y)
    if t in poison:
        loss = loss * poison[t]
    setup.opt.zero_grad()
    setup.scaler.scale(loss).backward()
    if unscale:
        setup.scaler.unscale_(setup.opt)
        if clip is not None:
            nn.utils.clip_grad_norm_(setup.model.parameters(), clip)
        capture()
    else:
        _capture_unscaled(setup, capture)
    setup.scaler.step(setup.opt)
    setup.scaler.update()
    if setup.sched is not None:
        setup.sched.step()
    setup.loss = float(loss.detach())


def _capture_unscaled(setup: Setup, capture: Callable[[], None]) -> None:
    """Capture the grads the update uses when scaler.step unscales them itself: grad * (1/scale)
    in float32, computed here on copies. The very same scaled grad tensors are put back after,
    so the training is untouched."""
    inv = torch.tensor(1.0 / setup.scaler.get_scale(), dtype=torch.float64).float()
    params = [p for g in setup.opt.param_groups for p in g["params"] if p.grad is not None]
    scaled = [p.grad for p in params]
    for p, g in zip(params, scaled):
        p.grad = g * inv
    try:
        capture()
    finally:
        for p, g in zip(params, scaled):
            p.grad = g


def _amp_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    """bf16 autocast, explicit unscale_ (the grads are final before scaler.step)."""
    _amp_step(setup, t, capture, dtype=torch.bfloat16, poison={2: float("inf")}, unscale=True)


def _amp_fp16_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    """fp16 autocast, no explicit unscale_: scaler.step unscales (or skips) on its own."""
    _amp_step(setup, t, capture, dtype=torch.float16, poison={t: float("inf") for t in SKIP_AT}, unscale=False)


def _amp_clip_sched_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    """Everything at once: fp16 autocast, GradScaler (skips), unscale_ + clipping, a scheduler."""
    _amp_step(setup, t, capture, dtype=torch.float16, poison={2: float("nan")}, unscale=True, clip=0.05)


# -- others -------------------------------------------------------------------------


def _clip_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    setup.opt.zero_grad()
    loss = mse(setup.model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(setup.model.parameters(), 0.05)  # the user's clipping: recorded grads are clipped
    capture()
    setup.opt.step()
    setup.loss = float(loss.detach())


def _accumulate_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    """Three micro-batches per optimizer step: one record per step, with the summed grads."""
    setup.opt.zero_grad()
    total = 0.0
    for k in range(3):
        x, y = data(100 * t + k, n=4)
        loss = mse(setup.model(x), y) / 3
        loss.backward()
        total += float(loss.detach())
    capture()
    setup.opt.step()
    setup.loss = total


ADD_AT = 2


def _added_model() -> nn.Module:
    m = Small()
    m.fc2.requires_grad_(False)
    return m


def _added_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    if t >= ADD_AT:  # unfreeze the head and hand it to the optimizer (after a restore: already there)
        setup.model.fc2.requires_grad_(True)
        if len(setup.opt.param_groups) == 1:
            setup.opt.add_param_group({"params": list(setup.model.fc2.parameters()), "lr": 5e-3})
    plain_iteration(setup, t, capture)


def _outside_make(seed: int) -> Setup:
    seed_all(seed)
    model = Small()
    temp = nn.Parameter(torch.tensor(1.0 + seed))  # another seed, another value: restore must write it
    opt = _adamw([{"params": model.parameters()}, {"params": [temp], "lr": 0.05}])
    return Setup(model, opt, outside={"temperature": temp})


def _outside_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    setup.opt.zero_grad()
    loss = mse(setup.model(x) / setup.outside["temperature"], y)
    loss.backward()
    capture()
    setup.opt.step()
    setup.loss = float(loss.detach())


def shape_cases() -> list[Case]:
    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def one_cycle(o: torch.optim.Optimizer) -> Any:
        return lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20)

    return [
        Case("batchnorm", _make(WithBN), plain_iteration),
        Case("tied-weights", _make(Tied), plain_iteration),
        Case("frozen-layer", _make(_frozen), plain_iteration),
        Case("param-groups", _make(Small, _groups), plain_iteration),
        Case("no-grad-some-steps", _make(Branchy), _branchy_iteration),
        Case("group-without-grads-some-steps", _make(Branchy, _side_group), _side_late_iteration),
        Case("bf16-params", _make(lambda: Small(torch.bfloat16)), plain_iteration),
        Case("fp16-params", _make(lambda: Small(torch.float16)), plain_iteration),
        Case("float64-params", _make(lambda: Small(torch.float64)), plain_iteration),
        Case("complex-params", _make(lambda: Small(torch.complex64)), plain_iteration),
        Case("amp-gradscaler-skip", _make(Small, scaler=True), _amp_iteration),
        Case("amp-fp16-gradscaler-skips-no-explicit-unscale", _make(Small, scaler=True), _amp_fp16_iteration),
        Case("amp-fp16-clip-scheduler", _make(Small, sgd, scaler=True, sched_fn=one_cycle), _amp_clip_sched_iteration),
        Case("grad-clipping", _make(Small), _clip_iteration),
        Case("grad-accumulation", _make(Small), _accumulate_iteration),
        Case("dropout-torch-numpy-python-rng", _make(Noisy), plain_iteration),
        Case("sparse-embedding", _make(Bag, lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1)), plain_iteration),
        Case("sparse-embedding-sgd-momentum", _make(Bag, sgd), plain_iteration),
        Case("params-added-mid-run", _make(_added_model, lambda m: _adamw(m.fc1.parameters())), _added_iteration),
        Case("params-outside-model", _outside_make, _outside_iteration),
        Case("closure-sgd", _make(Small, sgd), closure_iteration),
        Case("closure-lbfgs-strong-wolfe", _make(Small, lambda m: torch.optim.LBFGS(
            m.parameters(), lr=0.5, max_iter=4, history_size=3, line_search_fn="strong_wolfe")), closure_iteration),
    ]
