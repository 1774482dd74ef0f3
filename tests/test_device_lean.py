"""The device fingerprint and lean pack by torch ops (core/device_lean.py), on the CPU.

The same code runs on a GPU (tests_gpu/ holds it to the same definition there); here it is
held to the plain-integer definition of dmix64 (tests/dmix_reference.py) and to
``device_stats``, for every dtype and for byte lengths on and off a word.
"""

from __future__ import annotations

import pytest
import torch
from dmix_reference import CHANGES, changed_pair, reference_dmix64
from helpers import assert_same

from stepdump.core.device_lean import device_fingerprint, fused_stats, lean_pack, reference_pack
from stepdump.core.hashing import raw_bytes
from stepdump.core.stats import STATS_LEN, device_stats

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
SHAPES = [(0,), (1,), (3,), (7,), (8,), (9,), (33, 17), (4, 256, 3)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 5).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_is_the_definition(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    got = device_fingerprint(t)
    assert got.dtype == torch.int64 and got.dim() == 0
    assert int(got) == reference_dmix64(bytes(raw_bytes(t)))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "odd offset", "channels_last"])
def test_fingerprint_of_a_view_is_that_of_its_contiguous_bytes(layout: str) -> None:
    base = _tensor(torch.float32, (64, 48))
    view = {
        "transposed": base.T,
        "sliced": base[3:50:2, 5:],
        "expanded": base[:1].expand(5, 48),
        "odd offset": base.reshape(-1)[1:100],  # storage offset of 4 bytes: not a word boundary
        "channels_last": _tensor(torch.float32, (2, 3, 4, 5)).to(memory_format=torch.channels_last),
    }[layout]
    assert int(device_fingerprint(view)) == reference_dmix64(bytes(raw_bytes(view)))


def test_fingerprint_of_a_sparse_tensor_covers_its_structure() -> None:
    i = torch.tensor([[0, 2, 2], [1, 0, 3]])
    a = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0]), (3, 4))
    b = torch.sparse_coo_tensor(i.flip(1), torch.tensor([3.0, 2.0, 1.0]), (3, 4))  # same values, other order
    for t in (a, b, a.coalesce()):
        assert int(device_fingerprint(t)) == reference_dmix64(bytes(raw_bytes(t)))
    assert int(device_fingerprint(a)) != int(device_fingerprint(b))


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_changes_it(change: str) -> None:
    a, b = changed_pair(bytes(raw_bytes(_tensor(torch.float32, (1001,)))), change)
    assert a != b  # the control
    fa, fb = (int(device_fingerprint(torch.frombuffer(bytearray(x), dtype=torch.uint8))) for x in (a, b))
    assert fa == reference_dmix64(bytes(a)) and fb == reference_dmix64(bytes(b))
    assert fa != fb


@pytest.mark.parametrize("nonfinite", [False, True])
def test_fused_stats_rows_are_device_stats(nonfinite: bool) -> None:
    ts = [_tensor(d, (1 + 97 * i, 3), seed=i) for i, d in enumerate(DTYPES)] + [torch.empty(0)]
    if nonfinite:
        for t in ts:
            if t.dtype.is_floating_point and t.numel() > 20:
                t.view(-1)[::7] = float("nan")
                t.view(-1)[1::13] = float("inf")
    got = fused_stats(ts)
    assert got.shape == (len(ts), STATS_LEN) and got.dtype == torch.float64
    for i, t in enumerate(ts):
        assert_same(got[i], device_stats(t), f"tensor {i} {t.dtype}")


def test_lean_pack_is_stats_bits_then_fingerprint() -> None:
    ts = [_tensor(d, (500 + i,), seed=i) for i, d in enumerate((torch.float32, torch.bfloat16, torch.int64))]
    for pack in (lean_pack(ts), reference_pack(ts)):
        assert pack.shape == (len(ts), STATS_LEN + 1) and pack.dtype == torch.int64
        assert_same(pack[:, :STATS_LEN].view(torch.float64), fused_stats(ts), "stats columns")
        for i, t in enumerate(ts):
            assert int(pack[i, STATS_LEN]) == reference_dmix64(bytes(raw_bytes(t))), i
    assert lean_pack([]).shape == (0, STATS_LEN + 1)
