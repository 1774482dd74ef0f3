"""Cases of the fidelity matrix, generated from the installed torch (issue 12).

Optimizers and schedulers are found by walking ``torch.optim`` (its namespace and,
recursively, the subclasses defined in its public modules), not listed by hand: a
class torch adds shows up in the matrix by itself. What each needs is derived from
its signature, with argument values looked up by *parameter name* (``momentum``,
``milestones``, ``lr_lambda``...), never by class. A variant torch itself refuses on
this machine (``fused=True`` where the CPU has no fused kernel, ``capturable=True``
off an accelerator) is left out at collection, with torch's own message as the reason.

The model shapes (BatchNorm, AMP, sparse, ...) are in fidelity_shapes.py.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers import seed_all
from torch import nn
from torch.optim import lr_scheduler

# -- discovery -------------------------------------------------------------------


def _public_optim_modules() -> None:
    """Import every public module under torch.optim, so ``__subclasses__`` sees what they define."""
    for info in pkgutil.walk_packages(torch.optim.__path__, "torch.optim."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            importlib.import_module(info.name)


def _all_subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _is_public_torch_optim(cls: type) -> bool:
    # torch.optim._multi_tensor holds deprecated foreach=True shims named NewCls: private
    # module, so left out; the foreach variants below cover what they do.
    parts = cls.__module__.split(".")
    return parts[:2] == ["torch", "optim"] and not any(p.startswith("_") for p in parts) \
        and not cls.__name__.startswith("_")


def _discover(base: type, extra: tuple[type, ...] = ()) -> dict[str, type]:
    _public_optim_modules()
    found = {n: o for n, o in vars(torch.optim).items()
             if isinstance(o, type) and issubclass(o, base) and o is not base and not n.startswith("_")}
    for cls in (*_all_subclasses(base), *extra):
        if _is_public_torch_optim(cls) and cls is not base:
            found.setdefault(cls.__name__, cls)
    return dict(sorted(found.items()))


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    return _discover(torch.optim.Optimizer)


def scheduler_classes() -> dict[str, type]:
    # ReduceLROnPlateau derives from LRScheduler in recent torch, not in older ones: named explicitly.
    return _discover(lr_scheduler.LRScheduler, (lr_scheduler.ReduceLROnPlateau,))


def needs_closure(cls: type[torch.optim.Optimizer]) -> bool:
    """``step(closure)`` with no default: the optimizer evaluates the loss itself (LBFGS)."""
    p = inspect.signature(cls.step).parameters.get("closure")
    return p is not None and p.default is inspect.Parameter.empty


# -- optimizer variants ---------------------------------------------------------------

# Options worth a variant each, by constructor parameter name, with what they need beside them.
# A callable value is a factory, called per build: each run gets its own tensor.
OPTION_VARIANTS: dict[str, dict[str, Any]] = {
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "dampening": {"momentum": 0.9, "dampening": 0.3},
    "amsgrad": {"amsgrad": True},
    "maximize": {"maximize": True},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "decoupled_weight_decay": {"decoupled_weight_decay": True, "weight_decay": 0.05},
    "centered": {"centered": True},
    "capturable": {"capturable": True},
    "weight_decay": {"weight_decay": 0.05},
    "line_search_fn": {"line_search_fn": "strong_wolfe"},  # several closure calls per step
    "adjust_lr_fn": {"adjust_lr_fn": "match_rms_adamw"},
    "tensor_lr": {"lr": lambda: torch.tensor(1e-2)},  # a Tensor in param_groups
}
# Switched on together in one more variant: the options interact inside one update.
COMBINED = ("momentum", "nesterov", "amsgrad", "maximize", "decoupled_weight_decay", "centered", "weight_decay")
# Base values by parameter name (the for-loop implementation unless a variant says otherwise).
BASE_OPTIONS: dict[str, Any] = {"lr": 1e-2, "foreach": False, "max_iter": 3, "history_size": 4}


def optimizer_variants(cls: type[torch.optim.Optimizer]) -> list[tuple[str, dict[str, Any]]]:
    names = set(inspect.signature(cls).parameters)
    base = {k: v for k, v in BASE_OPTIONS.items() if k in names}
    out = [("default", base)]
    combined: dict[str, Any] = {}
    for opt, extra in OPTION_VARIANTS.items():
        key = "lr" if opt == "tensor_lr" else opt
        if key in names and all(k in names for k in extra):
            kw = {**base, **extra}
            if opt != "foreach" and "foreach" in names and kw.get("fused"):
                kw.pop("foreach")  # fused and foreach are exclusive: fused alone
            out.append((opt, kw))
            if opt in COMBINED:
                combined.update(extra)
    if len({k for k in combined if k in names} - {"momentum", "weight_decay"}) >= 2:
        out.append(("combined", {**base, **combined}))
    return out


def build_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Call the factories: every build gets fresh objects (a tensor lr shared by two runs
    would make them match by accident)."""
    return {k: v() if callable(v) else v for k, v in kwargs.items()}


# -- schedulers -------------------------------------------------------------------


class CountingDecay:
    """A callable object (``lr_lambda``, ``scale_fn``): its ``__dict__`` is scheduler state."""

    def __init__(self, rate: float, calls: int = 0) -> None:
        self.rate = rate
        self.calls = calls  # changes every call: restore must bring it back

    def __call__(self, t: float) -> float:
        self.calls += 1
        return self.rate ** t


# Scheduler arguments by parameter name (used when required, or None-defaulted but needed).
SCHEDULER_ARGS: dict[str, Any] = {
    "step_size": 2, "gamma": 0.7, "milestones": [2, 3, 3], "T_max": 4, "eta_min": 1e-4, "T_0": 2, "T_mult": 2,
    "total_iters": 3, "base_lr": 1e-3, "max_lr": 0.1, "step_size_up": 2, "total_steps": 20, "power": 2.0,
    "lr_lambda": lambda t: 0.95**t, "swa_lr": 0.05, "anneal_epochs": 2, "patience": 0, "factor": 0.5,
}
# Arguments that take a callable: each gets one more case with a callable object (state-bearing).
CALLABLE_ARGS: dict[str, Callable[[int], Any]] = {
    "lr_lambda": lambda seed: CountingDecay(0.9, calls=100 * seed),
    "scale_fn": lambda seed: CountingDecay(0.8, calls=100 * seed),
}
# What a scheduler taking ``schedulers`` composes, by case-id suffix. The first keeps a
# Counter in its state (MultiStepLR milestones) that must survive the composite's state_dict.
COMPOSITIONS: dict[str, Callable[[torch.optim.Optimizer], list[Any]]] = {
    "": lambda o: [lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
                   lr_scheduler.MultiStepLR(o, milestones=[1, 3, 3], gamma=0.5)],
    "-constant-cosine": lambda o: [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
                                   lr_scheduler.CosineAnnealingLR(o, T_max=3)],
}


def build_scheduler(cls: type, opt: torch.optim.Optimizer, overrides: dict[str, Any] | None = None) -> Any:
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {}
    for p in params.values():
        if p.name == "optimizer":
            kwargs[p.name] = opt
        elif overrides and p.name in overrides:
            kwargs[p.name] = overrides[p.name]
        elif p.name == "schedulers":
            kwargs[p.name] = COMPOSITIONS[""](opt)
        elif p.name == "milestones" and "schedulers" in params:  # boundaries between composed schedulers
            kwargs[p.name] = [2] * (len(kwargs.get("schedulers", [None, None])) - 1)
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
    outside: dict[str, torch.Tensor] = field(default_factory=dict)  # params the model does not own
    loss: float | None = None  # the iteration's loss, for rec.log
    flags: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    """``make(seed)`` builds fresh objects; ``iterate(setup, t, capture)`` runs iteration t and
    calls ``capture()`` at the moment the record is taken (grads final, nothing updated)."""

    id: str
    make: Callable[[int], Setup]
    iterate: Callable[[Setup, int, Callable[[], None]], None]
    steps: int = 5


def data(t: int, d_in: int = 6, d_out: int = 3, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch t from its own generator: the data never depends on the global RNG."""
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
    """An embedding with sparse gradients; indices repeat within a batch (duplicates in the grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x.abs() * 10).long().clamp(max=29)
        return self.emb(idx).mean(1)[:, :3]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.real if out.is_complex() else out.float(), y)


def plain_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    loss = mse(setup.model(x), y)
    setup.opt.zero_grad()
    loss.backward()
    capture()
    setup.opt.step()
    setup.loss = float(loss.detach())
    step_scheduler(setup)


def closure_iteration(setup: Setup, t: int, capture: Callable[[], None]) -> None:
    x, y = data(t)
    calls = [0]

    def closure() -> torch.Tensor:
        setup.opt.zero_grad()
        loss = mse(setup.model(x), y)
        loss.backward()
        if calls[0] == 0:
            capture()  # the record is the first evaluation's
        calls[0] += 1
        return loss

    # The record of step t holds the optimizer state as of before step(): LBFGS adds keys to its
    # state (func_evals, n_iter) before the first closure call, where the grads are taken.
    setup.flags["optimizer_before_step"] = copy.deepcopy(setup.opt.state_dict())
    setup.loss = float(setup.opt.step(closure).detach())
    step_scheduler(setup)


def step_scheduler(setup: Setup) -> None:
    if setup.sched is None:
        return
    if isinstance(setup.sched, lr_scheduler.ReduceLROnPlateau):
        setup.sched.step(setup.loss)  # stepped with a metric
    else:
        setup.sched.step()


def probe(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], model: nn.Module,
          params: list[nn.Parameter]) -> None:
    """Two plain steps, no stepdump: raises what torch raises for this configuration."""
    setup = Setup(model, cls(params, **build_kwargs(kwargs)))
    for t in range(2):
        (closure_iteration if needs_closure(cls) else plain_iteration)(setup, t, lambda: None)


# The variant that drives an optimizer through step(closure) although it takes none by need:
# the record is then taken inside step(), after the closure's first call (capture/hooks.py).
CLOSURE = "closure"


# Kinds of model an optimizer may need, tried in order: a generic rule, not a per-class table.
MODEL_KINDS: list[tuple[Callable[[], nn.Module], Callable[[nn.Module], list[nn.Parameter]]]] = [
    (Small, lambda m: list(m.parameters())),
    (Bag, lambda m: list(m.parameters())),  # for an optimizer of sparse gradients only (SparseAdam)
    (Small, lambda m: [p for p in m.parameters() if p.ndim == 2]),  # for one of matrices only (Muon)
]


def optimizer_case(name: str, cls: type[torch.optim.Optimizer], variant: str, kwargs: dict[str, Any]) -> Case:
    """The case for one optimizer variant; raises torch's own error when torch refuses the
    variant on this machine with every kind of model (the caller leaves it out, saying why)."""
    first_error: Exception | None = None
    for model_cls, params in MODEL_KINDS:
        try:
            model = model_cls()
            probe(cls, kwargs, model, params(model))
            break
        except Exception as e:  # noqa: BLE001 - torch's refusal; try the next kind of model
            first_error = first_error or e
    else:
        assert first_error is not None
        raise first_error

    def make(seed: int) -> Setup:
        seed_all(seed)
        model = model_cls()
        return Setup(model, cls(params(model), **build_kwargs(kwargs)))

    closure = needs_closure(cls) or variant == CLOSURE
    return Case(f"{name}-{variant}", make, closure_iteration if closure else plain_iteration)


def scheduler_cases() -> list[Case]:
    """Each scheduler with SGD + momentum (CyclicLR and OneCycleLR cycle the momentum too)."""

    def case(cid: str, cls: type, overrides: Callable[[int, torch.optim.Optimizer], dict[str, Any]] | None = None,
             groups: int = 1) -> Case:
        def make(seed: int) -> Setup:
            seed_all(seed)
            model = Small()
            if groups == 1:
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            else:  # two groups with their own lr: the scheduler keeps per-group state
                opt = torch.optim.SGD([{"params": model.fc1.parameters()},
                                       {"params": model.fc2.parameters(), "lr": 0.02}], lr=0.05, momentum=0.9)
            setup = Setup(model, opt)
            setup.sched = build_scheduler(cls, opt, overrides(seed, opt) if overrides else None)
            return setup

        return Case(cid, make, plain_iteration, steps=6)

    out = []
    for name, cls in scheduler_classes().items():
        params = inspect.signature(cls).parameters
        out.append(case(name, cls))
        for arg, factory in CALLABLE_ARGS.items():
            if arg in params:
                out.append(case(f"{name}-callable-object", cls, lambda seed, o, a=arg, f=factory: {a: f(seed)}))
        if "schedulers" in params:
            for suffix, compose in COMPOSITIONS.items():
                if suffix:
                    out.append(case(f"{name}{suffix}", cls, lambda seed, o, c=compose: {"schedulers": c(o)}))
    # one lr_lambda per group, an object and a lambda: a list state with a dict and a None
    out.append(case("LambdaLR-two-groups", lr_scheduler.LambdaLR,
                    lambda seed, o: {"lr_lambda": [CountingDecay(0.9, 100 * seed), lambda t: 0.8**t]}, groups=2))
    return out
