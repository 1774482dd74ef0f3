"""The optimizer state's walk kept while its objects are the same (capture/opt_walk.py): after any
change a loop or an optimizer can make to ``optimizer.state``, the kept walk is exactly a fresh one
(the same tensor objects, names, keys and extras), and it is reused only where nothing changed."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stepdump
from stepdump.capture import lean
from stepdump.capture.opt_walk import OptStateWalker
from stepdump.capture.step_state import StateWalk, walk

OPS = ["nothing", "in place", "tensor replaced", "int replaced", "key added", "key removed", "dict replaced",
       "new mapping", "state for a param without", "sparse value", "param's state dropped"]


def _same(a: StateWalk, b: StateWalk) -> bool:
    ea = [(e.kind, e.name, id(e.tensor), e.full, e.param, e.key) for e in a.entries]
    eb = [(e.kind, e.name, id(e.tensor), e.full, e.param, e.key) for e in b.entries]
    xa = {n: {k: id(v) for k, v in d.items()} for n, d in a.extra.items()}
    xb = {n: {k: id(v) for k, v in d.items()} for n, d in b.extra.items()}
    return ea == eb and xa == xb


def _apply(op: str, state: defaultdict, params: list, i: int) -> defaultdict:
    p = params[i % 2]  # params 0 and 1 have state from the start; param 2 only after "state for a param without"
    if op == "in place" and state.get(p):
        dense = [v for v in state[p].values() if isinstance(v, torch.Tensor) and v.layout == torch.strided]
        if dense:
            dense[0].add_(1.0)
    elif op == "tensor replaced" and state.get(p):
        state[p]["exp_avg"] = torch.zeros(3)
    elif op == "int replaced" and state.get(p):
        state[p]["count"] = state[p].get("count", 0) + 1
    elif op == "key added" and state.get(p):
        state[p][f"k{i}"] = torch.ones(2)
    elif op == "key removed" and state.get(p) and len(state[p]) > 1:
        del state[p][next(iter(state[p]))]
    elif op == "dict replaced" and state.get(p):
        state[p] = dict(state[p])
    elif op == "new mapping":
        state = defaultdict(dict, state)
    elif op == "state for a param without":
        state[params[2]] = {"exp_avg": torch.ones(3)}
    elif op == "sparse value" and state.get(p):
        state[p]["sparse"] = torch.ones(3).to_sparse()
    elif op == "param's state dropped":
        state.pop(p, None)
    return state


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=12))
def test_the_kept_walk_is_always_a_fresh_walk(ops: list[str]) -> None:
    params = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    state: defaultdict = defaultdict(dict)
    for p in params[:2]:
        state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn(3), "count": 0}
    walker = OptStateWalker()
    for i, op in enumerate(ops):
        state = _apply(op, state, params, i)
        before = walker._kept
        got = walker(named, state)
        assert _same(got, walk(named, state)), (i, op)
        if op in ("nothing", "in place") and before is not None:
            assert got is before[1], "nothing replaced: the kept walk is reused"


def test_a_replaced_optimizer_tensor_is_the_one_a_lean_step_describes(tmp_path) -> None:
    """A loop that replaces an optimizer state tensor (here with zeros) between updates: the next lean
    step that reads the optimizer state describes the new tensor, not the one the last walk found."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    every = lean.OPTIMIZER_EVERY
    x = torch.randn(8, 4)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1):
        for t in range(2 * every + 1):
            if t == 2 * every:  # after the walk of step `every` was kept
                opt.state[model.weight]["exp_avg"] = torch.zeros_like(model.weight)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    with stepdump.open(tmp_path / "run") as run:
        s = run.stats(kind="optimizer", name="weight.exp_avg")
        norms = dict(zip(s["step"], s["norm"], strict=True))
        assert norms[every] > 0 and norms[2 * every] == 0.0


@pytest.mark.parametrize("kind", ["dict", "defaultdict"])
def test_a_state_that_is_not_dicts_of_dicts_is_walked_every_time(kind) -> None:
    """A param's state that is not a dict (a custom mapping): nothing is kept, every walk is fresh."""

    class Mapping(dict):
        pass

    p = nn.Parameter(torch.randn(2))
    state = {p: {"a": torch.ones(1)}} if kind == "dict" else defaultdict(dict, {p: {"a": torch.ones(1)}})
    walker = OptStateWalker()
    first = walker([("p", p)], state)
    assert _same(first, walk([("p", p)], state))
    state[p] = Mapping(b=torch.zeros(1))
    assert [e.name for e in walker([("p", p)], state).entries] == ["p.b"]
