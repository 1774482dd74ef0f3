"""The axes of the loop matrix (tests/test_loop_matrix.py): optimizer wrappers, model changes mid-run,
recording modes, and the all-pairs selection of their cells.

A wrapper builds, around a model, the optimizer the loop steps and the one the Recorder is given
(the same object, except for SAM, recorded through its ``base_optimizer``), and runs one iteration
the way that wrapper's users write it. A change is what happens to the model (and the optimizer)
at the start of an iteration. Everything is deterministic: a cell is trained twice (unrecorded and
recorded) and once more from a restored step, and the three must agree bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize, prune
from wrapper_shapes import SAM, Lookahead, SGDWithShadow

STEPS = 7
Batch = tuple[torch.Tensor, torch.Tensor]


def batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


# -- optimizer wrappers ---------------------------------------------------------------------


@dataclass
class Loop:
    """One built loop: ``recorded`` is what the Recorder, restore and reexecute are given;
    ``iterate(model, batch, before_update)`` runs one iteration (``before_update()`` is called
    when the params and the optimizer state are those the update starts from) and returns the loss;
    ``add_group(params, lr)`` adds a param group as that wrapper's users do."""

    recorded: torch.optim.Optimizer
    iterate: Callable[[nn.Module, Batch, Callable[[], None]], torch.Tensor]
    add_group: Callable[[list[nn.Parameter], float], None]
    after: Callable[[nn.Module, int], None] = lambda m, t: None  # after iteration t (schedule-free's evaluation)


def _plain_iteration(opt: Any, backward: Callable[[torch.Tensor], None] | None = None
                     ) -> Callable[[nn.Module, Batch, Callable[[], None]], torch.Tensor]:
    def iterate(m: nn.Module, b: Batch, before_update: Callable[[], None]) -> torch.Tensor:
        # the optimizer's zero_grad: a replaced module's params, out of the model, are cleared too
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(m(b[0]), b[1])
        (backward or torch.Tensor.backward)(loss)
        before_update()
        opt.step()
        return loss.detach()
    return iterate


def _adamw(m: nn.Module) -> Loop:
    opt = torch.optim.AdamW(_trainable(m), lr=0.01)
    return Loop(opt, _plain_iteration(opt), lambda ps, lr: opt.add_param_group({"params": ps, "lr": lr}))


def _lookahead(m: nn.Module) -> Loop:
    opt = Lookahead(torch.optim.Adam(_trainable(m), lr=0.01), k=2)
    return Loop(opt, _plain_iteration(opt), lambda ps, lr: opt.add_param_group({"params": ps, "lr": lr}))


def _sam(m: nn.Module) -> Loop:
    sam = SAM(_trainable(m), torch.optim.SGD, lr=0.05, momentum=0.9)

    def iterate(m: nn.Module, b: Batch, before_update: Callable[[], None]) -> torch.Tensor:
        sam.zero_grad(set_to_none=True)
        loss = F.mse_loss(m(b[0]), b[1])
        loss.backward()
        before_update()  # the base update starts from w (second_step puts w back), with this momentum
        sam.first_step(zero_grad=True)
        F.mse_loss(m(b[0]), b[1]).backward()
        sam.second_step(zero_grad=True)
        return loss.detach()

    # SAM's groups are the base optimizer's, with rho/adaptive: added through SAM, as its users do
    return Loop(sam.base_optimizer, iterate, lambda ps, lr: sam.add_param_group({"params": ps, "lr": lr}))


def _schedulefree(m: nn.Module) -> Loop:
    import schedulefree

    opt = schedulefree.AdamWScheduleFree(_trainable(m), lr=0.01, warmup_steps=2)
    opt.train()

    def after(m: nn.Module, t: int) -> None:
        if t % 2 == 1:  # an evaluation at x, as the package's README does: eval(), forward, train()
            opt.eval()
            with torch.no_grad():
                m(batch(1000 + t)[0])
            opt.train()

    return Loop(opt, _plain_iteration(opt), lambda ps, lr: opt.add_param_group({"params": ps, "lr": lr}), after)


def _accelerate(m: nn.Module) -> Loop:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    prepared, opt = acc.prepare(m, torch.optim.AdamW(_trainable(m), lr=0.01))
    assert prepared is m, "accelerate on one CPU process hands the model back as it is"
    return Loop(opt, _plain_iteration(opt, acc.backward),
                lambda ps, lr: opt.add_param_group({"params": ps, "lr": lr}))


def _subclass(m: nn.Module) -> Loop:
    opt = SGDWithShadow(_trainable(m), lr=0.05, momentum=0.9)
    return Loop(opt, _plain_iteration(opt), lambda ps, lr: opt.add_param_group({"params": ps, "lr": lr}))


def _trainable(m: nn.Module) -> list[nn.Parameter]:
    return [p for p in m.parameters() if p.requires_grad]


@dataclass(frozen=True)
class Wrapper:
    """An optimizer wrapper of the matrix.

    Attributes:
        build: The loop around a model.
        unrecorded: Keys of ``state_dict()`` the record does not take (said in a warning when
            recording starts).
        rebuildable: A gradient log can re-apply its updates between keyframes (torch.optim's own
            class); else the recording says at start that only keyframes are readable.
        edits: The loop changes params between updates (schedule-free's ``eval()`` / ``train()``
            round trip, not bitwise): a gradient log says so once and stores them in full.
    """

    build: Callable[[nn.Module], Loop]
    unrecorded: tuple[str, ...] = ()
    rebuildable: bool = True
    edits: bool = False


WRAPPERS: dict[str, Wrapper] = {
    "adamw": Wrapper(_adamw),
    "lookahead": Wrapper(_lookahead, rebuildable=False),
    "sam": Wrapper(_sam),
    "schedulefree": Wrapper(_schedulefree, rebuildable=False, edits=True),
    "accelerate": Wrapper(_accelerate),
    "subclass": Wrapper(_subclass, unrecorded=("shadow",), rebuildable=False),
}


# -- model changes mid-run ------------------------------------------------------------------


class _Halved(nn.Module):
    """A parametrization keeping its one original (the optimizer's param object stays the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def _prune(m: nn.Module, loop: Loop) -> None:
    prune.l1_unstructured(m[2], "weight", 0.5)


def _unprune(m: nn.Module, loop: Loop) -> None:
    prune.remove(m[2], "weight")


def _parametrize(m: nn.Module, loop: Loop) -> None:
    parametrize.register_parametrization(m[0], "weight", _Halved())


def _unparametrize(m: nn.Module, loop: Loop) -> None:
    parametrize.remove_parametrizations(m[0], "weight")  # leaves the parametrized value in the param


def _freeze(m: nn.Module, loop: Loop) -> None:
    m[0].requires_grad_(False)


def _unfreeze_and_add(m: nn.Module, loop: Loop) -> None:
    m[0].requires_grad_(True)
    loop.add_group(list(m[0].parameters()), 0.005)


def _replace(m: nn.Module, loop: Loop) -> None:
    m[2] = nn.Linear(8, 4)  # drawn from the global RNG, as the loop's own init would be
    loop.add_group(list(m[2].parameters()), 0.02)


Step = Callable[[nn.Module, Loop], None]


@dataclass(frozen=True)
class Change:
    """What happens at the start of which iterations; ``setup`` runs on the model before the
    optimizer is built (a layer frozen, to be added as a param group later)."""

    at: dict[int, Step] = field(default_factory=dict)
    setup: Callable[[nn.Module], None] | None = None


CHANGES: dict[str, Change] = {
    "prune": Change({2: _prune, 4: _unprune}),
    "parametrize": Change({2: _parametrize, 4: _unparametrize}),
    "add_group": Change({3: _unfreeze_and_add}, setup=lambda m: m[0].requires_grad_(False)),
    "freeze": Change({2: _freeze, 4: lambda m, loop: m[0].requires_grad_(True)}),
    "replace": Change({3: _replace}),
    "none": Change(),
}

MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "tiered": {"every": 4, "stats_every": 1},
    "gradient_log": {"gradient_log": 4},
}


def cells() -> list[tuple[str, str, str]]:
    """(wrapper, change, mode) cells covering every pair of values of two axes at least once.

    Every (wrapper, change) pair is a cell; its mode is the ``(i + j) % len(MODES)``-th, i and j the
    wrapper's and the change's places: with at least as many wrappers and changes as modes, each
    wrapper and each change then meets every mode (a Latin-square assignment).
    """
    modes = list(MODES)
    return [(w, c, modes[(i + j) % len(modes)])
            for (i, w), (j, c) in itertools.product(enumerate(WRAPPERS), enumerate(CHANGES))]


def build(wrapper: str, change: str, upto: int = -1, perturb: bool = False) -> tuple[nn.Module, Loop]:
    """The model and loop at the start of training, or (``upto``) as they are at the start of
    iteration ``upto``, the changes up to it made; ``perturb``: every param moved, so that a restore
    must set each one."""
    m = model()
    ch = CHANGES[change]
    if ch.setup is not None:
        ch.setup(m)
    loop = WRAPPERS[wrapper].build(m)
    for s in sorted(ch.at):
        if s <= upto:
            ch.at[s](m, loop)
    if perturb:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
    return m, loop
