"""Cases of the fidelity matrix, generated from the installed torch (issue 12).

Optimizers and schedulers are found by walking ``torch.optim``, not listed by
hand: a class torch adds shows up in the matrix by itself. What each needs is
derived from its signature, with argument values looked up by *parameter name*
(``momentum``, ``milestones``, ``lr_lambda``...), never by class. A variant
torch itself refuses on this machine (``fused=True`` where the CPU has no fused
kernel) is left out at collection, with torch's own message as the reason.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import lr_scheduler, swa_utils

# -- discovery -------------------------------------------------------------------


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    return {n: o for n, o in sorted(vars(torch.optim).items())
            if isinstance(o, type) and issubclass(o, torch.optim.Optimizer) and o is not torch.optim.Optimizer}


def scheduler_classes() -> dict[str, type]:
    out = {}
    for mod in (lr_scheduler, swa_utils):
        for n, o in sorted(vars(mod).items()):
            if (isinstance(o, type) and not n.startswith("_") and o.__module__ == mod.__name__
                    and (issubclass(o, lr_scheduler.LRScheduler) or o is lr_scheduler.ReduceLROnPlateau)
                    and o is not lr_scheduler.LRScheduler):
                out[n] = o
    return out


def needs_closure(cls: type[torch.optim.Optimizer]) -> bool:
    """``step(closure)`` with no default: the optimizer evaluates the loss itself (LBFGS)."""
    p = inspect.signature(cls.step).parameters.get("closure")
    return p is not None and p.default is inspect.Parameter.empty


# Options worth a variant each, by constructor parameter name, with what they need beside them.
OPTION_VARIANTS: dict[str, dict[str, Any]] = {
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "amsgrad": {"amsgrad": True},
    "maximize": {"maximize": True},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "decoupled_weight_decay": {"decoupled_weight_decay": True, "weight_decay": 0.05},
    "centered": {"centered": True},
    "capturable": {"capturable": True},
    "weight_decay": {"weight_decay": 0.05},
}
# Base values by parameter name (the for-loop implementation unless a variant says otherwise).
BASE_OPTIONS = {"lr": 1e-2, "foreach": False, "max_iter": 3, "history_size": 4}


def optimizer_variants(cls: type[torch.optim.Optimizer]) -> list[tuple[str, dict[str, Any]]]:
    names = set(inspect.signature(cls).parameters)
    base = {k: v for k, v in BASE_OPTIONS.items() if k in names}
    out = [("default", base)]
    for opt, extra in OPTION_VARIANTS.items():
        if opt in names and all(k in names for k in extra):
            kw = {**base, **extra}
            if opt != "foreach" and "foreach" in names and kw.get("fused"):
                kw.pop("foreach")
            out.append((opt, kw))
    return out


# Scheduler arguments by parameter name; callables take the optimizer.
def _lam(t: int) -> float:
    return 0.95**t


class Warmup:
    """A callable object as lr_lambda: LambdaLR stores its ``__dict__`` in the state."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0

    def __call__(self, t: int) -> float:
        self.calls += 1
        return min(1.0, (t + 1) / self.steps)


SCHEDULER_ARGS: dict[str, Any] = {
    "step_size": 2, "gamma": 0.7, "milestones": [2, 3, 3], "T_max": 4, "eta_min": 1e-4, "T_0": 2, "T_mult": 2,
    "total_iters": 3, "base_lr": 1e-3, "max_lr": 0.1, "step_size_up": 2, "total_steps": 20, "power": 2.0,
    "lr_lambda": _lam, "swa_lr": 0.05, "anneal_epochs": 2, "patience": 0, "factor": 0.5,
}


def scheduler_schedulers(name: str, opt: torch.optim.Optimizer) -> list[Any]:
    """What a composite scheduler composes: a warm-up, then milestones (Counter state)."""
    first = lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    second = lr_scheduler.MultiStepLR(opt, milestones=[1, 3, 3], gamma=0.5)
    return [first, second] if name == "SequentialLR" else [first, lr_scheduler.ExponentialLR(opt, gamma=0.9)]


def build_scheduler(cls: type, opt: torch.optim.Optimizer, overrides: dict[str, Any] | None = None) -> Any:
    kwargs: dict[str, Any] = {}
    for p in inspect.signature(cls).parameters.values():
        if p.name == "optimizer":
            kwargs[p.name] = opt
        elif overrides and p.name in overrides:
            kwargs[p.name] = overrides[p.name]
        elif p.name == "schedulers":
            kwargs[p.name] = scheduler_schedulers(cls.__name__, opt)
        elif p.name == "milestones" and cls.__name__ == "SequentialLR":
            kwargs[p.name] = [2]
        elif p.default is inspect.Parameter.empty or (p.default is None and p.name in SCHEDULER_ARGS) \
                or p.name == "patience":  # None: "one of several must be given" (OneCycleLR total_steps)
            if p.name not in SCHEDULER_ARGS:  # a new scheduler with an argument this table does not know
                raise KeyError(f"{cls.__name__}: no value for required argument {p.name!r}; add it by name")
            kwargs[p.name] = SCHEDULER_ARGS[p.name]
    return cls(**kwargs)


# -- a setup and how one iteration runs ---------------------------------------------


@dataclass
class Setup:
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any = None
    scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    """``make(seed)`` builds fresh objects; ``iterate(setup, t, capture)`` runs iteration t and
    calls ``capture()`` at the moment the record is taken (grads final, nothing updated)."""

    id: str
    make: Callable[[int], Setup]
    iterate: Callable[[Setup, int, Callable[[], None]], None]
    steps: int = 5


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def data(t: int, d_in: int = 6, d_out: int = 3, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


class Small(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8, dtype=dtype)
        self.fc2 = nn.Linear(8, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype))))


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x.abs() * 10).long().clamp(max=29)
        return self.emb(idx).mean(1)[:, :3]


def plain_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    out = setup.model(x)
    loss = nn.functional.mse_loss(out.real if out.is_complex() else out.float(), y)
    setup.opt.zero_grad()
    loss.backward()
    capture()
    setup.opt.step()
    setup.extra["loss"] = float(loss.detach())
    step_scheduler(setup)


def closure_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    calls = [0]

    def closure() -> torch.Tensor:
        setup.opt.zero_grad()
        loss = nn.functional.mse_loss(setup.model(x).float(), y)
        loss.backward()
        if calls[0] == 0:
            capture()  # the record is the first evaluation's
        calls[0] += 1
        return loss

    setup.extra["loss"] = float(setup.opt.step(closure).detach())
    step_scheduler(setup)


def step_scheduler(setup: Setup) -> None:
    if setup.sched is None:
        return
    if isinstance(setup.sched, lr_scheduler.ReduceLROnPlateau):
        setup.sched.step(setup.extra["loss"])
    else:
        setup.sched.step()


def optimizer_case(name: str, cls: type[torch.optim.Optimizer], variant: str, kwargs: dict[str, Any]) -> Case:
    """The case for one optimizer variant; raises torch's own error when torch refuses the
    variant on this machine with every kind of model (the caller leaves it out, saying why)."""
    closure = needs_closure(cls)
    kinds: list[tuple[Callable[[], nn.Module], Callable[[nn.Module], list[nn.Parameter]]]] = [
        (Small, lambda m: list(m.parameters())),
        (Bag, lambda m: list(m.parameters())),  # an optimizer for sparse gradients (SparseAdam)
        (Small, lambda m: [p for p in m.parameters() if p.ndim == 2]),  # one for matrices only (Muon)
    ]
    first_error: Exception | None = None
    for model_cls, params in kinds:
        try:
            model = model_cls()
            probe(cls, kwargs, model, closure, params(model))
            break
        except Exception as e:  # noqa: BLE001 - torch's refusal; try the next kind of model
            first_error = first_error or e
    else:
        assert first_error is not None
        raise first_error

    def make(seed: int) -> Setup:
        seed_all(seed)
        model = model_cls()
        return Setup(model, cls(params(model), **kwargs))

    return Case(f"{name}-{variant}", make, closure_iteration if closure else plain_iteration)


def probe(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], model: nn.Module | None = None,
          closure: bool = False, params: list[nn.Parameter] | None = None) -> None:
    """Two plain steps, no stepdump: raises what torch raises for this configuration."""
    model = model or Small()
    opt = cls(params or list(model.parameters()), **kwargs)
    setup = Setup(model, opt)
    for t in range(2):
        (closure_iteration if closure else plain_iteration)(setup, t, lambda: None)


# -- model shapes (AdamW unless the shape is about the optimizer) ---------------------


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
    """A branch used on even steps only: its params have no grad at the other steps."""

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
          scaler: bool = False) -> Callable[[int], Setup]:
    def make(seed: int) -> Setup:
        seed_all(seed)
        model = model_fn()
        opt = opt_fn(model) if opt_fn is not None else _adamw(model.parameters())
        return Setup(model, opt, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None)

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
    setup.opt.zero_grad(set_to_none=True)
    plain_iteration(setup, t, capture)


def _amp_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(setup.model(x).float(), y)
    if t == 2:
        loss = loss * float("inf")  # the GradScaler skips this step
    setup.opt.zero_grad()
    setup.scaler.scale(loss).backward()
    setup.scaler.unscale_(setup.opt)
    capture()
    setup.scaler.step(setup.opt)
    setup.scaler.update()


def _clip_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    setup.opt.zero_grad()
    nn.functional.mse_loss(setup.model(x), y).backward()
    nn.utils.clip_grad_norm_(setup.model.parameters(), 0.05)  # the user's clipping: recorded grads are clipped
    capture()
    setup.opt.step()


ADD_AT = 2


def _added_model() -> nn.Module:
    m = Small()
    m.fc2.requires_grad_(False)
    return m


def _added_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    if t >= ADD_AT:  # unfreeze the head and hand it to the optimizer (again after a restore: no-op)
        setup.model.fc2.requires_grad_(True)
        if len(setup.opt.param_groups) == 1:
            setup.opt.add_param_group({"params": list(setup.model.fc2.parameters()), "lr": 5e-3})
    plain_iteration(setup, t, capture)


def _outside_make(seed: int) -> Setup:
    seed_all(seed)
    model = Small()
    temp = nn.Parameter(torch.tensor(1.0 + seed))
    opt = _adamw([{"params": model.parameters()}, {"params": [temp], "lr": 0.05}])
    return Setup(model, opt, extra={"temperature": temp})


def _outside_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    setup.opt.zero_grad()
    nn.functional.mse_loss(setup.model(x) / setup.extra["temperature"], y).backward()
    capture()
    setup.opt.step()


def shape_cases() -> list[Case]:
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    return [
        Case("batchnorm", _make(WithBN), plain_iteration),
        Case("tied-weights", _make(Tied), plain_iteration),
        Case("frozen-layer", _make(_frozen), plain_iteration),
        Case("param-groups", _make(Small, _groups), plain_iteration),
        Case("no-grad-some-steps", _make(Branchy), _branchy_iteration),
        Case("bf16-params", _make(lambda: Small(torch.bfloat16)), plain_iteration),
        Case("float64-params", _make(lambda: Small(torch.float64)), plain_iteration),
        Case("complex-params", _make(lambda: Small(torch.complex64)), plain_iteration),
        Case("amp-gradscaler-skip", _make(Small, scaler=True), _amp_iteration),
        Case("grad-clipping", _make(Small), _clip_iteration),
        Case("dropout-torch-numpy-python-rng", _make(Noisy), plain_iteration),
        Case("sparse-embedding", _make(Bag, lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1)), plain_iteration),
        Case("params-added-mid-run", _make(_added_model, lambda m: _adamw(m.fc1.parameters())), _added_iteration),
        Case("params-outside-model", _outside_make, _outside_iteration),
        Case("closure-sgd", _make(Small, sgd), closure_iteration),
    ]
