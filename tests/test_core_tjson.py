"""Typed JSON (store.tjson): non-tensor state survives the store unchanged."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import assert_same_tree
from hypothesis import given, settings
from hypothesis import strategies as st

from stepdump.core import tjson


def _round_trip(obj):
    """encode -> strict JSON text -> decode, with tensors kept aside by ref like the store does."""
    blobs: dict[str, torch.Tensor] = {}

    def put(ref, t):
        assert ref not in blobs, f"two tensors share the ref {ref!r}"
        blobs[ref] = t.clone()

    text = tjson.dumps(tjson.encode(obj, put))
    json.loads(text)  # strict JSON: no NaN/Infinity literals
    # strict JSON: no bare NaN/Infinity literals (a key or string "NaN" is fine)
    def _refuse(const):
        raise AssertionError(f"non-strict JSON constant {const} in {text!r}")

    json.loads(text, parse_constant=_refuse)
    return tjson.decode(tjson.loads(text), lambda ref: blobs[ref]), blobs


def test_round_trip_of_typical_state():
    state = {
        "betas": (0.9, 0.999),
        "nested": ((1, 2), [3, (4.5, "x")]),
        "by_index": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, 1: {"momentum_buffer": None}},
        "mixed_keys": {1: "a", "1": "b", 2.5: "c", None: "d", (1, 2): "f"},
        "bool_keys": {True: "e", False: "g"},  # not in mixed_keys: True == 1 would replace key 1's value
        "floats": [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-300, 1.7976931348623157e308],
        "flags": [True, False, None],
        "lr": 0.1 * 3,
        "tensors": [torch.arange(5), torch.randn(3).to(torch.bfloat16), torch.tensor(True), torch.empty(0, 2)],
        "uint8 rng": torch.get_rng_state(),
        "tag-like keys": {"$tuple": 1, "$tensor": "x"},
        "single": {"$float": "inf"},
        "str": "ünïcode / slashes",
    }
    back, blobs = _round_trip(state)
    assert_same_tree(back, state)
    assert type(back["betas"]) is tuple
    assert isinstance(back["by_index"], dict) and set(back["by_index"]) == {0, 1}
    assert math.copysign(1.0, back["floats"][4]) == -1.0  # -0.0 kept
    assert len(blobs) == 7


def test_numpy_values_become_plain_values():
    obj = {"i": np.int64(7), "f": np.float32(0.5), "inf": np.float64(np.inf), "arr": np.arange(4, dtype=np.int32)}
    back, _ = _round_trip(obj)
    assert back["i"] == 7 and type(back["i"]) is int
    assert back["f"] == 0.5 and type(back["f"]) is float
    assert back["inf"] == math.inf
    assert torch.equal(back["arr"], torch.arange(4, dtype=torch.int32))


def test_unstorable_objects_are_dropped_not_executed(caplog):
    class Thing:
        pass

    back, _ = _round_trip({"fn": Thing(), "ok": 1})
    assert back == {"fn": None, "ok": 1}
    assert "Thing" in caplog.text


def test_tensor_refs_are_unique_even_when_paths_collide():
    """Keys containing '/' or both 0 and '0' must not make two tensors share one stored blob."""
    a, b, c, d = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([4.0])
    obj = {"a/b": a, "a": {"b": b}, "m": {0: c, "0": d}}
    back, blobs = _round_trip(obj)
    assert len(blobs) == 4
    assert_same_tree(back, obj)


def test_decoding_never_builds_other_objects():
    tree = {"$repr": "os.system('rm -rf /')"}
    assert tjson.decode(tree, lambda ref: pytest.fail("no tensor here")) is None
    assert tjson.decode({"a": {"$tuple": [1, {"$float": "nan"}]}}, lambda r: None)["a"][0] == 1


_keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.builds(lambda n, s: torch.randn(n, generator=torch.Generator().manual_seed(s)),
              st.integers(0, 4), st.integers(0, 1000)),
)
_trees = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_round_trip_property(obj):
    back, _ = _round_trip(obj)
    assert_same_tree(back, obj)


def test_counter_and_uncoalesced_sparse_tensors_come_back_as_they_were():
    import collections

    sparse = torch.sparse_coo_tensor(torch.tensor([[3, 1, 3]]), torch.tensor([1.0, 2.0, 0.5]), (5,))
    assert not sparse.is_coalesced()
    back, _ = _round_trip({"milestones": collections.Counter([2, 4, 4]), "buf": sparse})
    assert type(back["milestones"]) is collections.Counter and back["milestones"] == collections.Counter([2, 4, 4])
    got = back["buf"]
    assert got.layout == torch.sparse_coo and not got.is_coalesced() and got.shape == (5,)
    assert torch.equal(got._indices(), sparse._indices()) and torch.equal(got._values(), sparse._values())


@pytest.mark.parametrize("hostile", [
    {"indices": {"$tensor": "i"}, "values": {"$tensor": "v"}, "size": [2], "coalesced": False},  # index 3 >= 2
    {"indices": {"$tensor": "i"}, "values": {"$tensor": "v"}, "size": [-1], "coalesced": False},
    {"indices": {"$tensor": "i"}, "values": {"$tensor": "v"}, "size": "5", "coalesced": False},
    {"indices": 7, "values": {"$tensor": "v"}, "size": [5], "coalesced": False},
])
def test_a_hostile_sparse_tensor_is_a_corrupt_data_error(hostile):
    import stepdump

    stored = {"i": torch.tensor([[3, 1, 3]]), "v": torch.tensor([1.0, 2.0, 0.5])}
    with pytest.raises(stepdump.CorruptDataError, match="sparse tensor is malformed"):
        tjson.decode({"$sparse_coo": hostile}, stored.__getitem__)


def test_subclasses_of_plain_types_encode_as_before_the_fast_paths():
    """Exact str, bool, int, None, float and lists of them are taken as they are; their subclasses
    (an IntEnum, numpy's float64, a str subclass) still go the long way: ints and floats as plain
    ones, the same JSON as a plain value gives."""
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    got = tjson.encode({"a": [1, True, None, "x"], "b": Level.HIGH, "c": np.float64(float("inf")),
                        "d": [Level.HIGH, 2], "e": Name("n"), "f": float("nan"), "g": -0.0}, lambda r, t: None)
    assert got["a"] == [1, True, None, "x"]
    assert got["b"] == 3 and type(got["b"]) is int
    assert got["c"] == {"$float": "inf"} and got["f"] == {"$float": "nan"}
    assert got["d"] == [3, 2] and type(got["d"][0]) is int
    assert got["e"] == "n" and math.copysign(1.0, got["g"]) == -1.0
