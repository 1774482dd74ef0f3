"""Health stats: the CPU definition (compute_stats) and the device one (device_stats) agree.

device_stats is what runs on CUDA tensors; it is plain torch, so its logic is
checked here on the CPU against compute_stats: counts exactly, floats closely.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepdump.core.hashing import fingerprint
from stepdump.core.stats import STATS_LEN, compute_stats, device_stats

NAN, INF = float("nan"), float("inf")


def _assert_agree(t: torch.Tensor) -> None:
    ref = compute_stats(t)
    dev = device_stats(t)
    assert dev.dtype == torch.float64 and dev.shape == (STATS_LEN,)
    got = dev.tolist()
    assert len(ref) == STATS_LEN
    # numel, nan, +inf, -inf: exact
    assert [int(v) for v in got[:4]] == list(ref[:4]), (got[:4], ref[:4])
    assert all(float(v).is_integer() for v in got[:4])
    # min, max, mean, std, norm, zero_frac: None <-> NaN, else close
    for i, (r, d) in enumerate(zip(ref[4:], got[4:]), start=4):
        if r is None:
            assert math.isnan(d), f"stat {i}: want missing (NaN), got {d}"
        else:
            assert d == pytest.approx(r, rel=1e-5, abs=1e-6), f"stat {i}: {d} != {r}"
    # min and max are elements of the tensor: exact
    if ref[4] is not None:
        assert got[4] == ref[4] and got[5] == ref[5]


CASES = {
    "float32": torch.randn(50),
    "float32 2d planted": torch.tensor([[NAN, 1.0, INF], [-INF, 0.0, -3.5], [2.0, NAN, 0.0]]),
    "float64": torch.randn(7, 3, dtype=torch.float64) * 1e3,
    "bfloat16": (torch.randn(33) * 10).to(torch.bfloat16),
    "float16 with inf": torch.tensor([1.0, 70000.0, -1.0, 0.0], dtype=torch.float16),
    "int64": torch.randint(-100, 100, (20,)),
    "int32": torch.arange(-5, 5, dtype=torch.int32),
    "uint8": torch.randint(0, 255, (16,), dtype=torch.uint8),
    "bool": torch.tensor([True, False, False, True, True]),
    "complex64": torch.randn(6, dtype=torch.complex64),
    "all nan": torch.full((5,), NAN),
    "all inf": torch.tensor([INF, -INF, INF]),
    "nan and inf only": torch.tensor([NAN, INF, -INF, NAN]),
    "empty float": torch.empty(0),
    "empty 2d": torch.empty(3, 0),
    "empty int": torch.empty(0, dtype=torch.int64),
    "scalar": torch.tensor(2.5),
    "scalar nan": torch.tensor(NAN),
    "constant": torch.full((9,), 0.1),
    "zeros": torch.zeros(4, 4),
    "huge": torch.tensor([3e38, 3e38, -3e38], dtype=torch.float32),
    "tiny": torch.tensor([1e-45, -1e-45, 0.0], dtype=torch.float32),
    "non-contiguous": torch.randn(6, 4).t(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_device_stats_agree_with_compute_stats(name):
    _assert_agree(CASES[name])


def test_known_values():
    t = torch.tensor([[NAN, 1.0, INF], [-INF, 0.0, -3.5], [2.0, NAN, 0.0]])
    n, nan, pinf, ninf, mn, mx, mean, std, norm, zf = compute_stats(t)
    finite = torch.tensor([1.0, 0.0, -3.5, 2.0, 0.0], dtype=torch.float64)
    assert (n, nan, pinf, ninf) == (9, 2, 1, 1)
    assert (mn, mx) == (-3.5, 2.0)
    assert mean == pytest.approx(finite.mean().item())
    assert std == pytest.approx(finite.std(correction=0).item())
    assert norm == pytest.approx(finite.norm().item())
    assert zf == pytest.approx(2 / 9)
    # no finite element: counts and zero fraction only
    assert compute_stats(torch.full((4,), NAN)) == (4, 4, 0, 0, None, None, None, None, None, 0.0)
    assert compute_stats(torch.empty(0)) == (0, 0, 0, 0, None, None, None, None, None, None)
    # a constant tensor has std exactly 0
    assert compute_stats(torch.full((9,), 0.1))[7] == 0.0


def test_fingerprint_is_of_the_exact_bytes():
    a = torch.tensor([0.0, 1.0])
    b = torch.tensor([-0.0, 1.0])
    assert torch.equal(a, b)
    assert fingerprint(a) != fingerprint(b)  # -0.0 and 0.0 differ in bits
    assert fingerprint(a) == fingerprint(a.clone())
    nc = torch.randn(4, 3).t()
    assert fingerprint(nc) == fingerprint(nc.contiguous())
    assert fingerprint(torch.tensor([NAN])) == fingerprint(torch.tensor([NAN]))
    assert -(2**63) <= fingerprint(torch.randn(10)) < 2**63  # fits SQLite's INTEGER


_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(_floats32, max_size=40),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_device_stats_agree_property(values, dtype):
    _assert_agree(torch.tensor(values, dtype=torch.float32).to(dtype))


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=30))
def test_device_stats_agree_on_ints(values):
    _assert_agree(torch.tensor(values, dtype=torch.int64))


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 70000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_and_large_paths_agree_with_device_stats(n, dtype):
    """compute_stats takes a numpy path up to 4096 elements and torch above: both match."""
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g, dtype=dtype) * 3 + 1
    t[::7] = 0.0
    if n > 2:
        t[1] = -0.0
    _assert_agree(t)
    t[0] = NAN
    _assert_agree(t)
