"""The RNG state taken at every optimizer post-hook for the final record (capture/final.py), read
cheaply (issue 25: ``random.getstate()`` and numpy's ``get_state`` were most of that hook on a small
model's step): what it gives back must be what ``getstate`` would have said at that moment, whatever
was drawn since, on the struct-reading path and on the fallback."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from stepdump.capture import final
from stepdump.core import rng as core_rng


def _python_now() -> tuple:
    return random.getstate()


@pytest.mark.parametrize("struct", [True, False], ids=["struct", "getstate"])
def test_python_state_is_the_one_at_take_time(monkeypatch: pytest.MonkeyPatch, struct: bool) -> None:
    if struct:
        assert core_rng.PY_MT is not None, "CPython's Random struct was not readable here"
    else:
        monkeypatch.setattr(core_rng, "PY_MT", None)
    random.seed(11)
    random.random()
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian (gauss_next) in the state
    rng = final.RngAfterUpdate()
    rng.take()
    expected = _python_now()
    random.random()  # drawn after the update: not the final record's state
    random.gauss(0.0, 1.0)
    got = rng.state()["python"]
    assert got["version"] == expected[0]
    assert tuple(got["state"].tolist()) == expected[1]
    assert got["gauss"] == expected[2] and got["gauss"] is not None
    random.setstate((got["version"], tuple(got["state"].tolist()), got["gauss"]))
    assert random.getstate() == expected


def test_numpy_state_follows_a_replaced_bit_generator() -> None:
    """The address of numpy's state is found once per bit generator: another one set in its place
    (``np.random.set_bit_generator``) is read at its own address."""
    old = np.random.get_bit_generator()
    try:
        rng = final.RngAfterUpdate()
        np.random.seed(3)
        rng.take()  # the address of the first generator's state is kept
        np.random.set_bit_generator(np.random.MT19937(1234))
        np.random.rand(7)
        rng.take()
        expected = np.random.get_state()
        np.random.rand(3)
        got = rng.state()["numpy"]
        assert np.array_equal(got["keys"].numpy(), expected[1]) and got["pos"] == expected[2]
    finally:
        np.random.set_bit_generator(old)


def test_torch_state_is_the_one_at_take_time() -> None:
    torch.manual_seed(5)
    torch.rand(3)
    rng = final.RngAfterUpdate()
    rng.take()
    expected = torch.get_rng_state()
    torch.rand(4)
    assert torch.equal(rng.state()["torch"], expected)


@pytest.mark.parametrize("struct", [True, False], ids=["struct", "getstate"])
def test_get_rng_state_says_what_the_generators_say(monkeypatch: pytest.MonkeyPatch, struct: bool) -> None:
    """core.rng.get_rng_state reads Python's state from its struct and numpy's in the dict form
    (issue 25: a gradient log takes it at every step): the same values, and types, as the generators'
    own getters give, a cached Gaussian of each included, and set_rng_state puts them back."""
    if not struct:
        monkeypatch.setattr(core_rng, "PY_MT", None)
    random.seed(21)
    random.gauss(0.0, 1.0)
    np.random.seed(22)
    np.random.randn()  # numpy's legacy Gaussian cache: has_gauss 1
    torch.manual_seed(23)
    state = core_rng.get_rng_state()
    py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert state["python"]["version"] == py[0] and state["python"]["gauss"] == py[2] is not None
    assert state["python"]["state"].dtype == torch.uint32 and tuple(state["python"]["state"].tolist()) == py[1]
    n = state["numpy"]
    assert (n["alg"], n["pos"], n["has_gauss"], n["cached_gaussian"]) == (npy[0], npy[2], npy[3], npy[4])
    assert npy[3] == 1 and n["keys"].dtype == torch.uint32 and np.array_equal(n["keys"].numpy(), npy[1])
    assert torch.equal(state["torch"], th)
    expected = (random.random(), float(np.random.randn()), torch.rand(2))
    core_rng.set_rng_state(state)
    again = (random.random(), float(np.random.randn()), torch.rand(2))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def _numpy_states() -> list[str]:
    return ["seeded", "a Gaussian cached", "the cache used", "restored with a cache at the same words"]


@pytest.mark.parametrize("case", _numpy_states())
def test_numpy_state_read_from_its_structs_is_get_states(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A gradient log takes the RNG state two or three times a step; numpy's ``get_state`` was most
    of it (40-100 us). get_rng_state reads numpy's words, position and legacy Gaussian cache from
    the C structs instead (core.rng.NP_GAUSS, found and checked on a private RandomState) and never
    calls get_state: the same values, and types, in every case the cache can be in, including a
    state restored with a cached Gaussian at the very words and position read before without one."""
    assert core_rng.NP_GAUSS is not None, "numpy's RandomState struct was not readable here"
    np.random.seed(31)
    np.random.rand(5)
    if case != "seeded":
        np.random.randn()  # caches the second Gaussian of the pair: has_gauss 1
    if case in ("the cache used", "restored with a cache at the same words"):
        saved = np.random.get_state()
        np.random.randn()  # uses the cache: has_gauss 0, words and position unchanged
        if case == "restored with a cache at the same words":
            core_rng.get_rng_state()  # read once without the cache
            np.random.set_state(saved)  # the same words and position, the cache back
    expected = np.random.get_state()

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("np.random.get_state called")

    monkeypatch.setattr(np.random, "get_state", refused)
    got = core_rng.get_rng_state()["numpy"]
    monkeypatch.undo()
    assert got["alg"] == expected[0] == "MT19937"
    assert got["keys"].dtype == torch.uint32 and torch.equal(got["keys"], torch.from_numpy(expected[1].astype(np.uint32)))
    assert type(got["pos"]) is int and got["pos"] == expected[2]
    assert type(got["has_gauss"]) is int and got["has_gauss"] == expected[3] == (0 if case in ("seeded", "the cache used") else 1)
    assert type(got["cached_gaussian"]) is float and got["cached_gaussian"] == expected[4]
    monkeypatch.setattr(core_rng, "NP_GAUSS", None)  # the get_state path: the same record
    slow = core_rng.get_rng_state()["numpy"]
    assert torch.equal(slow["keys"], got["keys"]) and {k: v for k, v in slow.items() if k != "keys"} == \
        {k: v for k, v in got.items() if k != "keys"}

