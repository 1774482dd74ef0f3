"""The edit watch's whole-param hashes (capture/outside.py) run on the training thread only where a
record is compared with the update before it: every step of a gradient log, the steps stored in full
otherwise, never a lean step (issue 40: on workload A they were ~3 ms of every lean step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stepdump
from stepdump.capture import outside

MODES = {  # kwargs, hashes expected in steps 1..10 (each watched record: one after its update, one before the next)
    "lean": ({"every": None, "stats_every": 1}, 0),
    "tiered every=5": ({"every": 5, "stats_every": 1}, 4),  # records 5 and 10 are full
    "gradient log": ({"gradient_log": 4}, 20),
}


@pytest.mark.parametrize("mode", MODES)
def test_whole_param_hashes_only_where_a_record_is_compared(tmp_path, monkeypatch, mode) -> None:
    kwargs, want = MODES[mode]
    calls = []
    real = outside.ParamWatch._fingerprints

    def counted(self: outside.ParamWatch, params: dict) -> dict:
        calls.append(len(params))
        return real(self, params)

    monkeypatch.setattr(outside.ParamWatch, "_fingerprints", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", **kwargs):
        step()  # step 0 (a keyframe or a full record in the watched modes)
        calls.clear()
        for _ in range(10):
            step()
        got = len(calls)
    assert got == want, f"{mode}: {got} whole-param hashes in 10 steps"
