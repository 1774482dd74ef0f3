"""numpy's global generator over any of numpy's bit generators (``np.random.set_bit_generator``:
PCG64, PCG64DXSM, Philox, SFC64; MT19937, the default, as control): its state is recorded
losslessly, without pickle and without integers JSON or SQLite cannot hold, and restoring it gives
the very next draws of the original run, the legacy Gaussian cache and the bit generator's
buffered 32-bit half included. The C-struct fast path reads MT19937's words only from an
MT19937."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same
from torch import nn

import stepdump
from stepdump.capture import final
from stepdump.core import rng as core_rng
from stepdump.core import tjson

BITGENS = [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937]
IDS = [c.__name__ for c in BITGENS]
INT64 = (-(2**63), 2**63 - 1)


@pytest.fixture(autouse=True)
def _keep_numpy_global() -> Iterator[None]:
    """Every test here replaces numpy's global bit generator: the one it found is put back."""
    old = np.random.get_bit_generator()
    try:
        yield
    finally:
        np.random.set_bit_generator(old)


def _use(cls: Any, seed: int = 7) -> None:
    """``cls`` as numpy's global bit generator, drawn from so that every part of its state is
    in play: the words moved, a legacy Gaussian cached, and (where the generator has one) half
    of a 64-bit output buffered for the next 32-bit draw."""
    np.random.set_bit_generator(cls(seed))
    np.random.random(3)
    if cls is not np.random.MT19937:
        for _ in range(16):  # a 32-bit draw takes half an output; the bounded draw may reject a few
            np.random.randint(0, 10, size=1, dtype=np.uint32)
            if np.random.get_state(legacy=False)["has_uint32"]:
                break
        assert np.random.get_state(legacy=False)["has_uint32"] == 1
    np.random.standard_normal()  # the legacy API draws Gaussians in pairs: the second is cached
    assert np.random.get_state(legacy=False)["has_gauss"] == 1


def _next_draws() -> bytes:
    """The next draws of numpy's global generator, as bytes (bitwise equality)."""
    return b"".join((np.random.standard_normal(1).tobytes(),  # the cached Gaussian first
                     np.random.randint(0, 2**31, size=3, dtype=np.uint32).tobytes(),  # the buffered half
                     np.random.random(5).tobytes(), np.random.standard_normal(3).tobytes()))


def _through_the_store(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` written as a step's typed JSON and read back (tensors kept aside as the store
    keeps blobs), checking that the JSON holds no integer outside int64."""
    blobs: dict[str, torch.Tensor] = {}
    text = tjson.dumps(tjson.encode({"rng": state}, lambda ref, t: blobs.__setitem__(ref, t.clone())))

    def ints(node: Any) -> Iterator[int]:
        if isinstance(node, dict):
            for v in node.values():
                yield from ints(v)
        elif isinstance(node, list):
            for v in node:
                yield from ints(v)
        elif isinstance(node, int) and not isinstance(node, bool):
            yield node

    tree = json.loads(text)
    assert all(INT64[0] <= i <= INT64[1] for i in ints(tree)), "an integer SQLite and JSON readers cannot hold"
    return tjson.decode(tjson.loads(text), lambda ref: blobs[ref])["rng"]


@pytest.mark.parametrize("cls", BITGENS, ids=IDS)
def test_state_of_any_bit_generator_round_trips_bit_exactly(cls: Any) -> None:
    _use(cls)
    state = core_rng.get_rng_state()
    assert state["numpy"]["alg"] == cls.__name__
    expected = _next_draws()
    core_rng.set_rng_state(state)
    assert _next_draws() == expected
    core_rng.set_rng_state(_through_the_store(state))  # as a recorded step holds it
    assert _next_draws() == expected


@pytest.mark.parametrize("cls", BITGENS, ids=IDS)
def test_restoring_sets_the_recorded_bit_generator_class(cls: Any) -> None:
    """A state recorded over one bit generator restored while numpy's global is another (a fresh
    process, a loop that replaced it): the recorded class is set, with the recorded state."""
    _use(cls)
    state = core_rng.get_rng_state()
    expected = _next_draws()
    other = np.random.MT19937 if cls is not np.random.MT19937 else np.random.PCG64
    np.random.set_bit_generator(other(99))
    core_rng.set_rng_state(_through_the_store(state))
    assert type(np.random.get_bit_generator()) is cls
    assert _next_draws() == expected


@pytest.mark.parametrize("cls", BITGENS, ids=IDS)
def test_same_rng_state_compares_every_part(cls: Any) -> None:
    _use(cls)
    a = core_rng.get_rng_state()
    assert core_rng.same_rng_state(a, core_rng.get_rng_state())
    assert core_rng.same_rng_state(a, _through_the_store(a))
    np.random.standard_normal()  # uses the cached Gaussian only: the words do not move
    b = core_rng.get_rng_state()
    assert not core_rng.same_rng_state(a, b)
    core_rng.set_rng_state(a)
    np.random.random()
    assert not core_rng.same_rng_state(a, core_rng.get_rng_state())
    other = np.random.MT19937 if cls is not np.random.MT19937 else np.random.PCG64
    np.random.set_bit_generator(other(7))
    assert not core_rng.same_rng_state(a, core_rng.get_rng_state())


@pytest.mark.parametrize("cls", BITGENS[:-1], ids=IDS[:-1])
def test_the_struct_reader_never_reads_mt_words_from_another_generator(cls: Any) -> None:
    _use(cls)
    assert core_rng.numpy_mt() is None


@pytest.mark.parametrize("cls", BITGENS, ids=IDS)
def test_final_record_rng_is_the_state_at_the_update(cls: Any) -> None:
    """capture/final.py takes the state at every update; draws made after it (an evaluation)
    are not the final record's: its numpy state is the one taken, whatever the bit generator."""
    _use(cls)
    rng = final.RngAfterUpdate()
    rng.take()
    expected = _next_draws()
    np.random.random(4)  # drawn after the update
    got = rng.state()
    assert got["numpy"]["alg"] == cls.__name__
    core_rng.set_rng_state(_through_the_store(got))
    assert _next_draws() == expected


def _iteration(model: nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """One step of a loop whose data comes from numpy's global generator; its draws as bytes."""
    x = np.random.standard_normal((4, 3)).astype(np.float32)
    noise = np.random.random((4, 2)).astype(np.float32)
    opt.zero_grad()
    loss = ((model(torch.from_numpy(x)) - torch.from_numpy(noise)) ** 2).mean()
    loss.backward()
    opt.step()
    return x.tobytes() + noise.tobytes()


def _objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("cls", [np.random.PCG64, np.random.Philox], ids=["PCG64", "Philox"])
def test_a_recorded_run_over_another_bit_generator_restores_numpy_bit_exactly(tmp_path, cls: Any) -> None:
    steps = 4
    model, opt = _objects()
    np.random.set_bit_generator(cls(5))
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise"):
        for _ in range(steps):
            _iteration(model, opt)
    ref_model, ref_opt = _objects()
    np.random.set_bit_generator(cls(5))
    draws = [_iteration(ref_model, ref_opt) for _ in range(steps + 2)]  # the same loop, uninterrupted

    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == list(range(steps + 1)) and run.meta["final_step"] == steps
        for k in (2, steps):  # a recorded iteration's start, and the final record
            fresh, fresh_opt = _objects()
            np.random.set_bit_generator(np.random.MT19937(123))  # a fresh process: numpy's default
            run.restore(k, fresh, fresh_opt)
            assert type(np.random.get_bit_generator()) is cls
            for t in range(k, steps + 2):
                assert _iteration(fresh, fresh_opt) == draws[t], f"numpy draws of iteration {t} after restoring {k}"
            for (name, a), b in zip(fresh.state_dict().items(), ref_model.state_dict().values(), strict=True):
                assert_same(a, b, name)


@pytest.mark.parametrize("cls", [np.random.PCG64, np.random.MT19937], ids=["PCG64", "MT19937"])
def test_trainer_export_numpy_state_is_what_set_state_takes(cls: Any) -> None:
    """``stepdump export --to hf-trainer`` writes numpy's state in the form the Trainer hands to
    ``np.random.set_state``: MT19937's legacy tuple, another bit generator's dict."""
    from stepdump.read.export_trainers import _hf_rng

    _use(cls)
    out = _hf_rng(_through_the_store(core_rng.get_rng_state()))
    expected = _next_draws()
    np.random.set_state(out["numpy"])
    assert _next_draws() == expected


def test_a_damaged_or_foreign_numpy_state_is_refused_and_changes_nothing(tmp_path) -> None:
    """A record whose numpy state is damaged, or names a bit generator numpy does not have, is a
    clear stepdump error; restore's trial refuses it before anything changed."""
    from stepdump.read.restore_checks import trial_rng

    _use(np.random.PCG64)
    good = core_rng.get_rng_state()
    damaged = {**good, "numpy": {**good["numpy"], "state": {**good["numpy"]["state"], "has_uint32": "1; import os"}}}
    foreign = {**good, "numpy": {**good["numpy"], "alg": "os.system"}}
    np.random.set_bit_generator(np.random.SFC64(3))
    before = np.random.get_state(legacy=False)
    with pytest.raises(stepdump.errors.CorruptDataError, match="where an integer belongs"):
        core_rng.set_rng_state(damaged)
    with pytest.raises(stepdump.errors.RestoreMismatchError, match="not one of numpy's"):
        core_rng.set_rng_state(foreign)
    for state in (damaged, foreign):
        with pytest.raises(stepdump.errors.RestoreMismatchError, match="nothing was changed"):
            trial_rng(state, 3)
    assert type(np.random.get_bit_generator()) is np.random.SFC64
    after = np.random.get_state(legacy=False)
    assert after["state"]["state"].tolist() == before["state"]["state"].tolist()
    assert (after["has_gauss"], after["gauss"]) == (before["has_gauss"], before["gauss"])
