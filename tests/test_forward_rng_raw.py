"""The RNG a training forward starts from (FORMAT.md ``forward_rng``), told apart from the
iteration's start RNG by raw readings of the generators (core/rng.py ``raw_rng``) before any dict
is built: the same records as comparing whole states, without building them when nothing drew.

A gradient-log run of a small loop that draws from torch, numpy or Python's ``random`` before
some forwards and not before others: every record's ``forward_rng`` is ``[None]`` exactly where
nothing drew (the iteration's start state), else the state right before that forward, bit for
bit; where nothing drew, the forward pre-hook built no RNG dict at all.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import stepdump
from stepdump.capture import iteration
from stepdump.core import rng as core_rng
from stepdump.store.format import STATE_FORWARD_RNG

DRAWS = {
    "torch": lambda: torch.rand(3),
    "numpy": lambda: np.random.rand(3),
    "python": lambda: random.random(),
    "numpy gauss": lambda: np.random.standard_normal(),  # leaves a cached Gaussian behind
}


@pytest.mark.parametrize("draw", list(DRAWS))
def test_forward_rng_is_none_exactly_where_nothing_drew(tmp_path: Path, monkeypatch, draw: str) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    built = []
    real = iteration.get_rng_state

    def counting() -> dict:
        built.append(1)
        return real()

    monkeypatch.setattr(iteration, "get_rng_state", counting)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    drew_at = {1, 3, 4}
    before_forward = {}
    built_at = {}
    with stepdump.Recorder(tmp_path / "run", model, opt, gradient_log=4, on_error="raise"):
        for t in range(6):
            if t in drew_at:
                DRAWS[draw]()
            before_forward[t] = core_rng.get_rng_state()
            n = len(built)
            model(x).pow(2).mean().backward()
            built_at[t] = len(built) - n
            opt.step()
            opt.zero_grad()
    run = stepdump.open(tmp_path / "run")
    for t in range(6):
        fwd = run.step_state(t).get(STATE_FORWARD_RNG)
        assert fwd is not None and len(fwd) == 1, (t, fwd)
        if t in drew_at:
            assert fwd[0] is not None and core_rng.same_rng_state(fwd[0], before_forward[t]), t
        else:
            assert fwd[0] is None, t
            assert built_at[t] == 0, (t, built_at[t])  # told by the raw reading: no dict built


def test_raw_readings_are_equal_exactly_when_the_states_are() -> None:
    a = core_rng.raw_rng()
    assert a is not None and a == core_rng.raw_rng()
    for d in DRAWS.values():
        before = core_rng.raw_rng()
        d()
        assert core_rng.raw_rng() != before


def test_a_state_s_raw_reading_is_the_one_read_when_it_was_taken() -> None:
    # raw_of(get_rng_state()) == raw_rng() at that moment, with numpy's Gaussian cache and Python's
    # gauss_next set or not: the forward pre-hook compares the two.
    np.random.seed(3)
    random.seed(3)
    for prime in (lambda: None, lambda: np.random.standard_normal(), lambda: random.gauss(0, 1)):
        prime()
        assert core_rng.raw_of(core_rng.get_rng_state()) == core_rng.raw_rng()
        before = core_rng.get_rng_state()
        torch.rand(1)
        assert core_rng.raw_of(before) != core_rng.raw_rng()
