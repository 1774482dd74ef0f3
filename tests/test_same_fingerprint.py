"""Comparing fingerprints of two kinds (docs/cuda.md, "Comparisons"): equal only when the kind
and the value are; a live or rebuilt tensor fingerprinted under a recorded row's kind.

``same_fingerprint`` is the one rule every comparison site goes through; ``fingerprint_as``
is how a live tensor meets a recorded row. dmix64 is checked against the plain-integer
definition (tests/dmix_reference.py), not against the library's own code.
"""

from __future__ import annotations

import pytest
import torch
from dmix_reference import COMPARE_ROWS as CONTRACT_ROWS
from dmix_reference import reference_dmix64

import stepdump
from stepdump.core import device_lean
from stepdump.core.hashing import DMIX64, XXH3, fingerprint, fingerprint_as, raw_bytes, same_fingerprint

# The contract's rows (tests/dmix_reference.py, which the GPU suite holds too), then more of their kind.
COMPARE_ROWS = [
    *CONTRACT_ROWS,
    # more of the kind: the int64 edges, zero, and every ordering of two kinds
    ("xxh3", 0, "xxh3", 0, True),
    ("xxh3", -(1 << 63), "xxh3", (1 << 63) - 1, False),
    ("dmix64", (1 << 63) - 1, "dmix64", (1 << 63) - 1, True),
    ("dmix64", 0, "xxh3", 0, None),
    ("dmix64", -(1 << 63), "xxh3", -(1 << 63), None),
    ("dmix64", 1, "xxh3", 2, None),
    ("xxh3", 5, "XXH3", 5, None),  # kinds are exact names: no case folding into "the same"
    ("xxh3", 5, "md5", 5, None),  # an unknown kind is never equal to a known one
]


@pytest.mark.parametrize(("ka", "fa", "kb", "fb", "want"), COMPARE_ROWS)
def test_same_fingerprint_rules(ka: str, fa: int, kb: str, fb: int, want: bool | None) -> None:
    assert same_fingerprint(ka, fa, kb, fb) is want
    assert same_fingerprint(kb, fb, ka, fa) is want  # symmetric


def test_kind_names_are_the_device_modules() -> None:
    assert (XXH3, DMIX64) == (device_lean.HOST_FP_KIND, device_lean.DEVICE_FP_KIND)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape) * 31 + sum(shape))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 5).to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]
SHAPES = [(0,), (1,), (3,), (8,), (9,), (33, 17)]  # byte lengths on and off a word


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_as_each_kind(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """xxh3 is :func:`fingerprint`; dmix64 is the definition of the bytes; the two differ (so a
    site that used the wrong one would be seen by the tests that record dmix64 runs)."""
    t = _tensor(dtype, shape)
    xx, dm = fingerprint_as(XXH3, t), fingerprint_as(DMIX64, t)
    assert xx == fingerprint(t)
    assert dm == reference_dmix64(bytes(raw_bytes(t)))
    assert type(dm) is int and type(xx) is int
    assert xx != dm


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_fingerprint_as_a_view_is_that_of_its_contiguous_bytes(layout: str) -> None:
    base = _tensor(torch.float32, (24, 16))
    view = {"transposed": base.T, "sliced": base[3:20:2, 5:], "expanded": base[:1].expand(5, 16)}[layout]
    dense = view.contiguous()
    for kind in (XXH3, DMIX64):
        assert fingerprint_as(kind, view) == fingerprint_as(kind, dense), kind


@pytest.mark.parametrize("kind", ["md5", "XXH3", "", "dmix"])
def test_fingerprint_as_refuses_an_unknown_kind(kind: str) -> None:
    with pytest.raises(stepdump.StepdumpError, match="newer stepdump") as e:
        fingerprint_as(kind, torch.ones(3))
    assert isinstance(e.value, stepdump.FormatVersionError)
    assert repr(kind) in str(e.value)
