"""Lean rows describe the params the optimizer steps from, whatever ran between the steps.

A lean record (``every=None, stats_every=1``, and the stats steps of ``every=N,
stats_every=1``) reads params from the iteration's first training forward on, on a
worker thread (capture/lean.py). Loops that run other forwards with grad enabled, or
change weights without a version bump, must not make those rows describe other bytes:
a torch_ema-style swap of the EMA weights through ``.data``, an EMA ``copy_`` in and out,
an evaluation of a deep copy, a second model sharing the Parameter objects, a re-init
through ``.data`` or a numpy view between backward and step. For each loop and both lean
spellings: every param row's fingerprint is exactly that of the param at the optimizer's
pre-hook (taken by the test's own pre-hook with core/hashing.py), its stats are those of
the same bytes (bitwise: the recorder's own functions on the test's copy), the optimizer
state rows likewise, and training is unchanged.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import gen, lean_model, snapshot
from torch import nn

import stepdump
from stepdump.capture import lean
from stepdump.capture.step_state import Entry
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import compute_stats

STEPS = 8
MODES = {"lean": {"every": None, "stats_every": 1}, "tiered": {"every": 5, "stats_every": 1}}


# Every test here runs both ways a lean step is read: by the worker from the forward on (a
# model over lean.INLINE_BYTES), and whole at the pre-hook on the training thread (a small one).
@pytest.fixture(autouse=True, params=["worker", "inline"])
def lean_path(request, monkeypatch) -> str:
    monkeypatch.setattr(lean, "INLINE_BYTES", 0 if request.param == "worker" else 1 << 40)
    return request.param


@dataclass
class Ctx:
    """One training loop's objects; ``shadow`` holds EMA weights, one per param."""

    model: nn.Sequential
    opt: torch.optim.Optimizer
    shadow: list[torch.Tensor] = field(default_factory=list)
    other: nn.Module | None = None

    def batch(self, t: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = gen(t, salt)
        return torch.randn(16, 80, generator=g), torch.randn(16, 70, generator=g)


def _train_part(ctx: Ctx, t: int, between: Callable[[Ctx, int], None] | None = None,
                trained: nn.Module | None = None) -> None:
    """Forward, backward, ``between`` (after the backward), step, EMA update."""
    x, y = ctx.batch(t)
    ctx.opt.zero_grad()
    nn.functional.mse_loss((trained or ctx.model)(x), y).backward()
    if between is not None:
        between(ctx, t)
    ctx.opt.step()
    with torch.no_grad():
        for p, s in zip(ctx.model.parameters(), ctx.shadow, strict=True):
            s.mul_(0.9).add_(p, alpha=0.1)


def _evaluate(model: nn.Module, ctx: Ctx, t: int) -> None:
    x, _ = ctx.batch(t, salt=7)
    model(x).sum()  # grad enabled, no backward: an evaluation written without no_grad


# -- the loops: one iteration each ------------------------------------------------------------


def ema_swap_data(ctx: Ctx, t: int) -> None:
    """torch_ema style: swap the EMA weights in through .data, evaluate, swap back, train."""
    params = list(ctx.model.parameters())
    for p, s in zip(params, ctx.shadow, strict=True):
        p.data, s.data = s.data, p.data
    _evaluate(ctx.model, ctx, t)
    for p, s in zip(params, ctx.shadow, strict=True):
        p.data, s.data = s.data, p.data
    _train_part(ctx, t)


def ema_copy(ctx: Ctx, t: int) -> None:
    """Copy the EMA weights in under no_grad, evaluate with grad, copy the weights back, train."""
    params = list(ctx.model.parameters())
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for p, s in zip(params, ctx.shadow, strict=True):
            p.data.copy_(s)
    _evaluate(ctx.model, ctx, t)
    with torch.no_grad():
        for p, b in zip(params, backup, strict=True):
            p.data.copy_(b)
    _train_part(ctx, t)


def ema_copy_after_backward(ctx: Ctx, t: int) -> None:
    """The EMA evaluation between backward and step (copy in, evaluate with grad, copy back)."""
    def evaluate(ctx: Ctx, t: int) -> None:
        params = list(ctx.model.parameters())
        backup = [p.detach().clone() for p in params]
        for p, s in zip(params, ctx.shadow, strict=True):
            p.data.copy_(s)
        _evaluate(ctx.model, ctx, t)
        for p, b in zip(params, backup, strict=True):
            p.data.copy_(b)

    _train_part(ctx, t, between=evaluate)


def eval_deepcopy(ctx: Ctx, t: int) -> None:
    """Evaluate a deep copy holding the EMA weights, with grad enabled (the live params untouched)."""
    ev = copy.deepcopy(ctx.model)
    with torch.no_grad():
        for q, s in zip(ev.parameters(), ctx.shadow, strict=True):
            q.copy_(s)
    _evaluate(ev, ctx, t)
    _train_part(ctx, t)


def shared_params(ctx: Ctx, t: int) -> None:
    """Train through a second model made of the same modules (so the same Parameter objects);
    the recorded model only evaluates, with the EMA weights swapped in through .data."""
    params = list(ctx.model.parameters())
    for p, s in zip(params, ctx.shadow, strict=True):
        p.data, s.data = s.data, p.data
    _evaluate(ctx.model, ctx, t)
    for p, s in zip(params, ctx.shadow, strict=True):
        p.data, s.data = s.data, p.data
    _train_part(ctx, t, trained=ctx.other)


def reinit_assign(ctx: Ctx, t: int) -> None:
    """Re-initialise a layer between backward and step by assigning .data (a new storage)."""
    def reinit(ctx: Ctx, t: int) -> None:
        if t % 3 == 1:
            w = ctx.model[0].weight
            w.data = torch.randn(w.shape, generator=gen(t, 3)) * 0.1
    _train_part(ctx, t, between=reinit)


def reinit_in_place(ctx: Ctx, t: int) -> None:
    """Re-initialise a layer between backward and step in place through .data (no version bump)."""
    def reinit(ctx: Ctx, t: int) -> None:
        if t % 3 == 1:
            ctx.model[2].weight.data.normal_(0.0, 0.1, generator=gen(t, 4))
    _train_part(ctx, t, between=reinit)


def reinit_numpy(ctx: Ctx, t: int) -> None:
    """Write into a param through a numpy view of its storage between backward and step."""
    def write(ctx: Ctx, t: int) -> None:
        if t % 2 == 0:
            ctx.model[0].weight.detach().numpy()[:5] *= 0.5
    _train_part(ctx, t, between=write)


LOOPS: dict[str, Callable[[Ctx, int], None]] = {f.__name__: f for f in (
    ema_swap_data, ema_copy, ema_copy_after_backward, eval_deepcopy, shared_params, reinit_assign,
    reinit_in_place, reinit_numpy)}


def _ctx() -> Ctx:
    model = lean_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    shadow = [p.detach().clone() * 0.5 for p in model.parameters()]  # far from the live weights
    return Ctx(model, opt, shadow, nn.Sequential(*model))


def _run(loop: Callable[[Ctx, int], None], rec_kw: dict[str, Any] | None, path: Any) -> tuple[Ctx, list[dict]]:
    """Train STEPS iterations; the truth at each optimizer pre-hook, taken by the test's own hook
    (registered first, so it runs before the Recorder's; nothing runs between them)."""
    ctx = _ctx()
    truth: list[dict] = []
    ctx.opt.register_step_pre_hook(lambda o, a, k: truth.append(snapshot(ctx.model, ctx.opt)))
    if rec_kw is None:
        for t in range(STEPS):
            loop(ctx, t)
        return ctx, truth
    with stepdump.Recorder(path, ctx.model, ctx.opt, on_error="raise", **rec_kw):
        for t in range(STEPS):
            loop(ctx, t)
    return ctx, truth


def _want_stats(kind: str, name: str, t: torch.Tensor, stored: bool) -> tuple:
    """The stats the record must hold for these bytes: the recorder's own functions on them."""
    if stored:
        return compute_stats(t)
    (row,) = lean.lean_rows([Entry(kind, name, t, False)], set())
    return row.stats


def _same(a: Any, b: Any) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return float(a) == float(b)


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("name", LOOPS, ids=str)
def test_lean_rows_describe_the_params_the_optimizer_steps_from(tmp_path, monkeypatch, name, mode) -> None:
    monkeypatch.setattr(lean, "OPTIMIZER_EVERY", 2)  # optimizer state rows at steps 0, 2, 4, 6
    monkeypatch.setattr(lean, "_CHUNK", 1000)  # the weights (7200, 6300 elements) read in several chunks
    loop = LOOPS[name]
    plain, _ = _run(loop, None, None)
    ctx, truth = _run(loop, MODES[mode], tmp_path / "run")
    for a, b in zip(ctx.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: training changed by recording"
    assert len(truth) == STEPS
    run = stepdump.open(tmp_path / "run")
    frame = run.stats()
    cols = ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "norm", "zero_frac")
    for t, snap in enumerate(truth):
        stored = t in run.steps
        fps = run.fingerprints(t)
        kinds = ("params",) if t % 2 or t == 0 else ("params", "optimizer")  # Adam has no state before step 0
        for kind in kinds:
            assert snap[kind], f"{name} step {t}: nothing to compare for {kind}"
            for tname, live in snap[kind].items():
                what = f"{name} {mode} step {t} {kind} {tname}"
                assert fps[(kind, tname)] == fingerprint(live), f"{what}: fingerprint is not the params' at step()"
                row = frame[(frame.step == t) & (frame.kind == kind) & (frame.name == tname)].iloc[0]
                want = _want_stats(kind, tname, live, stored)
                got = tuple(row[c] for c in cols)
                assert all(_same(g, w) for g, w in zip(got, want, strict=True)), f"{what}: stats {got} != {want}"


@pytest.mark.parametrize("numel", [4097, lean._CHUNK, lean._CHUNK + 1, 3 * lean._CHUNK + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_rows_are_exact_and_the_same_read_privately_or_live(numel, dtype) -> None:
    t = torch.randn(numel, generator=gen(numel), dtype=dtype)
    t[numel // 2] = 0.0
    entry = [Entry("params", "w", t, False)]
    (live,) = lean.lean_rows(entry, set())
    (private,) = lean.lean_rows(entry, set(), private=True)
    assert live == private
    assert live.fp == fingerprint(t)  # xxh3 streamed over the chunks is xxh3 of the whole
    want = compute_stats(t)
    assert live.stats[:6] == want[:6]  # numel, exact NaN/Inf counts, min, max
    assert math.isclose(live.stats[8], want[8], rel_tol=1e-6)  # the norm, summed another way


def test_a_tensor_with_nan_read_privately_is_left_to_the_pre_hook() -> None:
    t = torch.randn(3 * lean._CHUNK)
    t[5] = float("nan")
    entry = [Entry("params", "w", t, False)]
    assert lean.lean_rows(entry, set(), private=True) == []
    (row,) = lean.lean_rows(entry, set())
    assert row.stats == compute_stats(t) and row.fp == fingerprint(t)  # every stat, exact counts


def test_a_param_given_its_own_bytes_as_another_shape_is_described_as_it_is_now(tmp_path) -> None:
    """A param the update leaves alone (no grad this step), given a view of its own bytes with another
    shape between the forward and the update (``.data``: no version bump, the same bytes, the same
    fingerprint): its row at that step says the shape it has at the pre-hook, not the one it had when
    the row was read at the forward. (Another dtype of the same bytes is refused for a param by torch.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    model.spare = nn.Parameter(torch.randn(4, 3))  # never in the loss: no grad, the update skips it
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 6)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1):
        for t in range(3):
            model(x).pow(2).mean().backward()
            if t == 2:
                model.spare.data = model.spare.data.view(3, 4)
            opt.step()
            opt.zero_grad()
    with stepdump.open(tmp_path / "run") as run:
        rows = run.stats(kind="params", name="spare")
        assert list(rows[rows["step"] <= 2]["shape"]) == ["4,3", "4,3", "3,4"]  # (step 3: the final record)
        assert int(rows[rows["step"] == 2]["fingerprint"].iloc[0]) == fingerprint(model.spare)
