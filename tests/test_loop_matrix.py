"""The loop matrix: optimizer wrappers x model changes mid-run x recording modes (tests/loop_shapes.py).

Axes: a Lookahead-style wrapper (timm's, in-suite), a SAM-style two-step optimizer recorded through
its ``base_optimizer`` (davda54/sam, in-suite), schedule-free AdamW (the ``schedulefree`` package,
with an ``eval()`` / ``train()`` evaluation every other step), accelerate's prepared AdamW
(``Accelerator(cpu=True)``), a user's SGD subclass with an extra ``state_dict`` entry, and plain
AdamW as the control; changes: a prune then ``prune.remove``, a parametrization added then removed,
a frozen layer unfrozen and added as a param group, a layer frozen then unfrozen
(``requires_grad``), a module replaced (its params a new group), none; modes: full, tiered
(``every=4, stats_every=1``) and ``gradient_log=4``.

The full product is 108 cells; :func:`loop_shapes.cells` generates 36: every (wrapper, change) pair,
each with the mode ``(i + j) % 3`` (i, j: their places on their axes), so that every (wrapper, mode)
and every (change, mode) pair is met too (``test_cells_cover_every_pair`` checks it). For each cell:

1. recording does not change the training: the model's and the optimizer's ``state_dict()`` after the
   last step are bitwise those of the same loop unrecorded;
2. every step's record equals what the loop held when that update began: ``run.state_dict(t)`` the live
   model ``state_dict()`` (names, their order, values) and ``run.optimizer_state_dict(t)`` the
   optimizer's ``state_dict()``, bitwise; where stepdump cannot record something it says so while
   recording, and the test asserts the warning (state_dict entries it does not take; a gradient log of
   an optimizer it cannot re-apply, whose steps between keyframes are then refused on read, never
   returned). A tiered run's stats-only steps hold the fingerprint of each live param by its name;
3. restore of a middle step into the model and loop as they were then (every param moved first) and
   training on to the end ends bitwise as the original run, or is refused with a stepdump error naming
   the reason;
4. ``stepdump.reexecute`` of that (untampered) step reproduces, or is refused with the reason; it is
   never "suspected corruption".

The loops zero grads through the optimizer, to None. Two more loops carry a grad into the next
iteration, which the optimizer steps from, so restore must set it (state ``carried_grads``,
capture/carried.py): ``model.zero_grad()`` after a module was replaced (the old module's params,
still in the optimizer, keep their last grad) and ``zero_grad(set_to_none=False)`` (an unused expert
keeps a zero grad, which AdamW steps from).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, param_names
from loop_shapes import CHANGES, MODES, STEPS, WRAPPERS, Loop, batch, build, cells
from torch import nn

import stepdump
from stepdump.errors import RebuildError, StepdumpError
from stepdump.reexec.verdict import CORRUPTION, REPRODUCES

CELLS = cells()


def test_cells_cover_every_pair() -> None:
    assert len(CELLS) == len(WRAPPERS) * len(CHANGES) == len(set(CELLS))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        axes = (list(WRAPPERS), list(CHANGES), list(MODES))
        met = {(c[a], c[b]) for c in CELLS}
        assert met == {(x, y) for x in axes[a] for y in axes[b]}, (a, b)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, _clone(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


@dataclass
class Trace:
    """What the loop held when each update began: the model's and the recorded optimizer's
    ``state_dict()``, every param by the name a run gives it, and the optimizer's tensors by
    ``{param}.{key}`` (``state_dict()`` maps its indices to the params in group order)."""

    model: list[OrderedDict[str, torch.Tensor]] = field(default_factory=list)
    optimizer: list[dict[str, Any]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def take(self, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model.append(_clone(m.state_dict()))
        self.optimizer.append(_clone(opt.state_dict()))
        names = param_names(m, opt)
        ordered = [p for g in opt.param_groups for p in g["params"]]
        self.params.append({names[id(p)]: p.detach().clone() for p in [*m.parameters(), *ordered]})
        self.state.append({f"{names[id(ordered[i])]}.{k}": v for i, s in self.optimizer[-1]["state"].items()
                           for k, v in s.items() if isinstance(v, torch.Tensor)})


def _train(m: nn.Module, loop: Loop, change: str, start: int = 0, rec: Any = None, trace: Trace | None = None) -> None:
    """Iterations ``start``..STEPS-1; a model and loop given at ``start`` > 0 already hold the change
    made at the start of that iteration (as record ``start`` does)."""
    at = CHANGES[change].at
    for t in range(start, STEPS):
        if t in at and (t > start or start == 0):
            at[t](m, loop)
        b = batch(t)
        if rec is not None:
            rec.log_batch(b)

        def before_update() -> None:
            if trace is not None:
                trace.take(m, loop.recorded)

        loss = loop.iterate(m, b, before_update)
        if rec is not None:
            rec.log(loss=loss)
        loop.after(m, t)


def _same_optimizer(got: dict[str, Any], want: dict[str, Any], unrecorded: tuple[str, ...], what: str) -> None:
    """Bitwise, less the entries stepdump said it does not record, and less per-param state that is an
    empty dict (schedule-free's ``train()`` makes one for each param before any step; loading a state
    without it leaves the optimizer as it was)."""
    def used(sd: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in sd.items() if k not in unrecorded}
        out["state"] = {i: s for i, s in sd["state"].items() if s}
        return out

    assert_same_tree(used(got), used(want), what)


def _same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: names {list(got)} != {list(want)}"
    for k, v in want.items():
        assert_same(got[k], v, f"{what} {k}")


def _stepdump_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("stepdump")]


@pytest.mark.parametrize(("wrapper", "change", "mode"), [pytest.param(*c, id="-".join(c)) for c in CELLS])
def test_cell(tmp_path: Path, caplog: Any, wrapper: str, change: str, mode: str) -> None:
    w = WRAPPERS[wrapper]
    plain, plain_loop = build(wrapper, change)
    _train(plain, plain_loop, change)

    m, loop = build(wrapper, change)
    trace = Trace()
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "r", m, loop.recorded, **MODES[mode]) as rec:
        _train(m, loop, change, rec=rec, trace=trace)
    # 1. training unchanged
    _same_model(m.state_dict(), plain.state_dict(), "training changed by recording: model")
    assert_same_tree(loop.recorded.state_dict(), plain_loop.recorded.state_dict(), "training changed: optimizer")

    # What cannot be recorded is said while recording, once each, and nothing else is warned.
    warned = _stepdump_warnings(caplog)
    expected: list[Callable[[str], bool]] = [lambda s, k=k: f"'{k}'" in s and "does not record" in s
                                             for k in w.unrecorded]
    unreadable = mode == "gradient_log" and not w.rebuildable
    if unreadable:
        expected.append(lambda s: "keyframes" in s and "gradient_log" in s)
    if mode == "gradient_log" and w.edits:
        expected.append(lambda s: "params changed outside the optimizer" in s)
    for ok in expected:
        assert sum(map(ok, warned)) == 1, warned
    assert all(any(ok(s) for ok in expected) for s in warned), f"unexpected warnings: {warned}"

    # 2. every step's record is the loop's state at that update
    run = stepdump.open(tmp_path / "r")
    full = set(range(0, STEPS, 4)) if mode == "tiered" else set(range(STEPS))
    if unreadable:  # the keyframes: every 4 steps and at each change of the model's structure
        assert {0, 4, STEPS} <= set(run.steps) < full | {STEPS}, run.steps
    else:
        assert run.steps == sorted(full | {STEPS}), "steps stored in full (or rebuilt from the log), and the final"
    refused = []
    for t in range(STEPS):
        if t not in full:
            _stats_match(run, t, trace.params[t], trace.state[t])
            continue
        try:
            sd = run.state_dict(t)
        except RebuildError as e:
            assert unreadable and t not in run.steps and "not a torch.optim class" in str(e), e
            refused.append(t)
            continue
        _same_model(sd, trace.model[t], f"step {t} model")
        _same_optimizer(run.optimizer_state_dict(t), trace.optimizer[t], w.unrecorded, f"step {t} optimizer")
    assert 0 not in refused and 4 not in refused, refused  # keyframes read as recorded
    _same_model(run.state_dict(STEPS), m.state_dict(), "final record")
    _same_optimizer(run.optimizer_state_dict(STEPS), loop.recorded.state_dict(), w.unrecorded, "final optimizer")

    # 3. restore a middle step + continue: bitwise, or refused with the reason
    mid = 4 if mode == "tiered" else 5
    m2, loop2 = build(wrapper, change, upto=mid, perturb=True)
    try:
        run.restore(mid, m2, loop2.recorded)
    except StepdumpError as e:
        assert mid in refused, f"restore({mid}) refused: {e}"
        assert "not a torch.optim class" in str(e), e
    else:
        assert mid not in refused
        _train(m2, loop2, change, start=mid)
        _same_model(m2.state_dict(), m.state_dict(), f"restore({mid}) + continue: model")
        _same_optimizer(loop2.recorded.state_dict(), loop.recorded.state_dict(), w.unrecorded,
                        f"restore({mid}) + continue: optimizer")

    # 4. re-execution of an untampered step (between keyframes, or between full steps: replayed
    # from step 4 with the loop's train_step) never suspects corruption
    again = 5
    m3, loop3 = build(wrapper, change, upto=again, perturb=True)

    drawn = iter(range(4, again))  # a tiered run's replay from step 4 hands None: the loop draws its own

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, b: Any) -> torch.Tensor:
        return loop3.iterate(model, batch(next(drawn)) if b is None else b, lambda: None)

    given = {"batch": batch(again)} if mode == "tiered" else {}  # a stats step holds its batch's fingerprint
    try:
        r = stepdump.reexecute(run, again, m3, loop3.recorded, train_step, repeat=2, **given)
    except StepdumpError as e:
        assert again in refused and "not a torch.optim class" in str(e), f"reexecute({again}) refused: {e}"
    else:
        assert r.cause != CORRUPTION and "corruption" not in r.summary(), r.summary()
        assert r.verdict == REPRODUCES, r.summary()
        # ... comparing every quantity the record holds: the loss, the grads, and every param and
        # optimizer tensor the update left (a wrapper's state too, not only what its own .state has)
        held = len(run.fingerprints(again, kinds=("grads",))) + \
            len(run.fingerprints(again + 1, kinds=("params", "optimizer")))
        assert r.compared == 1 + held, (r.compared, held)


def _stats_match(run: Any, t: int, params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """A stats-only step holds, for every param of that step by its name (the model's, then the
    optimizer's others as ``group{i}.param{j}``), and at the steps a lean step reads the optimizer
    state (docs/performance.md: every ``OPTIMIZER_EVERY``-th) for every tensor of the optimizer's
    ``state_dict()``, the fingerprint of its bytes then, and no other."""
    from stepdump.capture.lean import OPTIMIZER_EVERY
    from stepdump.core.hashing import fingerprint

    for kind, live in (("params", params), ("optimizer", state if t % OPTIMIZER_EVERY == 0 else {})):
        fps = {name: fp for (k, name), fp in run.fingerprints(t, [kind]).items() if k == kind}
        assert sorted(fps) == sorted(live), f"step {t} {kind}: names {sorted(fps)} != {sorted(live)}"
        for name, v in live.items():
            assert fps[name] == fingerprint(v), f"step {t}: fingerprint of {kind} {name} is not the live one's"


def test_grads_carried_across_iterations_are_restored_or_said(tmp_path: Path, caplog: Any) -> None:
    """The matrix's loops zero grads through the optimizer. A loop that calls ``model.zero_grad()``
    after replacing a module leaves the old module's params (still in the optimizer) with their last
    grad, and AdamW goes on updating them from it at every step. Restore + continue must end as the
    original run, or the recording must say it will not."""
    def train(m: nn.Module, loop: Loop, start: int, rec: Any = None) -> None:
        for t in range(start, STEPS):
            if t == 3 and start < 3:
                CHANGES["replace"].at[3](m, loop)
            m.zero_grad(set_to_none=True)
            x, y = batch(t)
            nn.functional.mse_loss(m(x), y).backward()
            loop.recorded.step()

    m, loop = build("adamw", "none")
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "r", m, loop.recorded):
        train(m, loop, 0)
    if any("grad" in s for s in _stepdump_warnings(caplog)):
        return  # said while recording: what the test asks for
    m2, loop2 = build("adamw", "replace", upto=5, perturb=True)
    stepdump.open(tmp_path / "r").restore(5, m2, loop2.recorded)
    train(m2, loop2, 5)
    _same_model(m2.state_dict(), m.state_dict(), "restore(5) + continue: model")
    _same_optimizer(loop2.recorded.state_dict(), loop.recorded.state_dict(), (), "restore(5) + continue: optimizer")


class _TwoExperts(nn.Module):
    """A routed layer: expert ``b`` serves steps 0, 3, 6 only (a mixture of experts' unused expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return (self.a if t % 3 else self.b)(x)


def test_zero_grads_kept_by_set_to_none_false_are_restored_or_said(tmp_path: Path, caplog: Any) -> None:
    """The loops of torch before 2.0 zero grads to zeros, not None: a param unused at some step still
    has a (zero) grad, and AdamW updates it. Restore + continue must end as the original run, or the
    recording must say it will not."""
    def built() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = _TwoExperts()
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def train(m: nn.Module, opt: torch.optim.Optimizer, start: int) -> None:
        for t in range(start, STEPS):
            opt.zero_grad(set_to_none=False)
            x, y = batch(t)
            nn.functional.mse_loss(m(x, t), y).backward()
            opt.step()

    m, opt = built()
    with caplog.at_level(logging.WARNING), stepdump.Recorder(tmp_path / "r", m, opt):
        train(m, opt, 0)
    if any("grad" in s for s in _stepdump_warnings(caplog)):
        return  # said while recording: what the test asks for
    m2, opt2 = built()
    stepdump.open(tmp_path / "r").restore(4, m2, opt2)
    train(m2, opt2, 4)
    _same_model(m2.state_dict(), m.state_dict(), "restore(4) + continue: model")
