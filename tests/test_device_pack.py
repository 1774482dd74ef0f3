"""capture/device_pack.py on the CPU: the rows a lean CUDA step sends are the pack's, read back
exactly (the same code runs on a GPU with a pinned host copy; tests_gpu/ runs it there)."""

from __future__ import annotations

import math

import pytest
import torch
from dmix_reference import reference_dmix64

from stepdump.capture.device_pack import DevicePack, heads, pack_on_device, rows
from stepdump.core.device_lean import DEVICE_FP_KIND
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import raw_bytes
from stepdump.core.stats import compute_stats, device_stats
from stepdump.store.format import format_shape


def _entries(nonfinite: bool) -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    ts = {
        "w": torch.randn(33, 7, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "z": torch.zeros(5, dtype=torch.float16),
        "e": torch.empty(0),
        "step": torch.tensor(7.0),
        "i": torch.randint(-9, 9, (4, 5), generator=g),
    }
    if nonfinite:
        ts["w"].view(-1)[::5] = float("nan")
        ts["w"].view(-1)[1::11] = float("-inf")
        ts["b"][0] = float("inf")
    out = [("params", n, t, False, None, None) for n, t in ts.items()]
    out.append(("optimizer", "w.exp_avg", torch.ones(2, 2), False, "w", "exp_avg"))
    return out


@pytest.mark.parametrize("nonfinite", [False, True])
def test_rows_are_the_stats_and_dmix64_of_each_tensor(nonfinite: bool) -> None:
    entries = _entries(nonfinite)
    host = pack_on_device(entries, pin=False)
    got = rows(DevicePack(heads(entries), host))
    assert [(r.kind, r.name, r.param, r.key) for r in got] == [e[0:2] + e[4:6] for e in entries]
    for r, e in zip(got, entries, strict=True):
        t = e[2]
        assert r.dtype == stored_dtype(t) and r.shape == format_shape(t.shape)
        assert r.fp_kind == DEVICE_FP_KIND
        assert r.fp == reference_dmix64(bytes(raw_bytes(t))), e[1]
        want = device_stats(t).tolist()
        assert r.stats[:4] == tuple(int(v) for v in want[:4]) and all(isinstance(v, int) for v in r.stats[:4])
        for v, w in zip(r.stats[4:], want[4:], strict=True):
            assert (v is None and math.isnan(w)) or (v is not None and v == w), (e[1], r.stats, want)


def test_a_finite_tensor_row_agrees_with_the_host_stats_where_they_are_exact() -> None:
    """Counts, min, max and the zero fraction are the same numbers the CPU path stores."""
    entries = [e for e in _entries(False) if e[2].numel()]
    host = pack_on_device(entries, pin=False)
    for r, e in zip(rows(DevicePack(heads(entries), host)), entries, strict=True):
        want = compute_stats(e[2])
        assert r.stats[:6] == want[:6] and r.stats[9] == want[9], (e[1], r.stats, want)


def test_empty_tensor_has_no_values() -> None:
    entries = [("grads", "e", torch.empty(0, 3), False, None, None)]
    host = pack_on_device(entries, pin=False)
    (r,) = rows(DevicePack(heads(entries), host))
    assert r.stats == (0, 0, 0, 0, None, None, None, None, None, None)
    assert r.shape == format_shape((0, 3))
