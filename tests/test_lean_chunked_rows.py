"""Large tensors' lean rows (the chunked path of capture/lean.py) are the update's bytes, exactly.

A weight over ``packed.CHUNK`` elements is read by the lean worker in chunks (``lean._chunked``:
xxh3, norm, min and max per chunk), while the forward and backward run, through a private copy;
the optimizer pre-hook keeps a row only where its fingerprint is that of the param then. The
loops here change such weights through ``.data`` or a numpy view between the backward and the
step (no version bump, or new memory): every param row must still be the bytes the update read
(fingerprint exact, stats bitwise those of the recorder's own functions on the test's copy), and
training unchanged. The weights are read in four chunks each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import gen, snapshot
from torch import nn

import stepdump
from stepdump.capture import lean, packed
from stepdump.capture.step_state import Entry
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import compute_stats

STEPS = 4
LEAN = {"every": None, "stats_every": 1}


@pytest.fixture(autouse=True)
def large_path(monkeypatch) -> None:
    monkeypatch.setattr(lean, "INLINE_BYTES", 0)  # the worker's path, not the small step's inline read
    monkeypatch.setattr(lean, "_CHUNK", 50_000)  # each large weight read in four chunks
    monkeypatch.setattr(lean, "OPTIMIZER_EVERY", 2)  # optimizer state rows at steps 0 (none yet), 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Two weights over packed.CHUNK elements (the chunked path), the rest packed.
    model = nn.Sequential(nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 30))
    assert sum(p.numel() > packed.CHUNK for p in model.parameters()) == 2
    return model


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(t, 11)
    return torch.randn(8, 400, generator=g), torch.randn(8, 30, generator=g)


def in_place_data(model: nn.Module, t: int) -> None:
    """A weight re-initialised in place through .data between backward and step (no version bump)."""
    model[2].weight.data.normal_(0.0, 0.05, generator=gen(t, 4))


def numpy_view(model: nn.Module, t: int) -> None:
    """A write through a numpy view of a weight's storage between backward and step."""
    model[0].weight.detach().numpy()[:7] *= 0.5


def assign_data(model: nn.Module, t: int) -> None:
    """A weight given new memory through .data between backward and step."""
    w = model[0].weight
    w.data = torch.randn(w.shape, generator=gen(t, 5)) * 0.05


BETWEEN: dict[str, Callable[[nn.Module, int], None]] = {f.__name__: f for f in (in_place_data, numpy_view, assign_data)}


def _train(between: Callable[[nn.Module, int], None], path: Any = None) -> tuple[nn.Module, list[dict]]:
    """STEPS iterations, ``between`` after each backward; the truth at each pre-hook, taken by the
    test's own hook (registered first, so it runs before the Recorder's)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    truth: list[dict] = []
    opt.register_step_pre_hook(lambda o, a, k: truth.append(snapshot(model, opt)))
    rec = stepdump.Recorder(path, model, opt, on_error="raise", **LEAN) if path is not None else None
    for t in range(STEPS):
        x, y = _batch(t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        between(model, t)
        opt.step()
    if rec is not None:
        rec.close()
    return model, truth


def _same(a: Any, b: Any) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return float(a) == float(b)


@pytest.mark.parametrize("name", BETWEEN)
def test_large_params_changed_between_forward_and_step_are_recorded_as_the_update_reads_them(tmp_path, name) -> None:
    plain, _ = _train(BETWEEN[name])
    model, truth = _train(BETWEEN[name], tmp_path / "run")
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: training changed by recording"
    run = stepdump.open(tmp_path / "run")
    frame = run.stats()
    cols = ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "norm", "zero_frac")
    for t, snap in enumerate(truth):
        fps = run.fingerprints(t)
        for kind in ("params", "optimizer") if t == 2 else ("params",):
            assert snap[kind]
            for tname, live in snap[kind].items():
                what = f"{name} step {t} {kind} {tname}"
                assert fps[(kind, tname)] == fingerprint(live), f"{what}: not the bytes the update read"
                (want,) = lean.lean_rows([Entry(kind, tname, live, False)], set())  # the recorder's own functions
                row = frame[(frame.step == t) & (frame.kind == kind) & (frame.name == tname)].iloc[0]
                got = tuple(row[c] for c in cols)
                assert all(_same(g, w) for g, w in zip(got, want.stats, strict=True)), f"{what}: {got} != {want.stats}"


@pytest.mark.parametrize("private", [False, True])
def test_a_strided_1d_tensor_is_read_as_its_bytes_in_order(private) -> None:
    """A 1-d view with a stride (a slice with a step) takes the chunked path like any other."""
    base = torch.randn(2 * (3 * lean._CHUNK + 7), generator=gen(1))
    t = base[::2]
    assert not t.is_contiguous() and t.numel() > packed.CHUNK
    (row,) = lean.lean_rows([Entry("params", "w", t, False)], set(), private=private)
    assert row.fp == fingerprint(t)
    want = compute_stats(t)
    assert row.stats[:6] == want[:6]
    assert math.isclose(row.stats[8], want[8], rel_tol=1e-4)  # the norm, summed another way (fp32)
