"""stepdump.diff: first divergent step and tensor, bitwise by default."""

from __future__ import annotations

import torch
from helpers import record_run, tiny_model
from torch import nn

import stepdump


def test_identical_runs_are_identical(tmp_path):
    a = stepdump.open(record_run(tmp_path / "a", steps=12))
    b = stepdump.open(record_run(tmp_path / "b", steps=12))
    res = stepdump.diff(a, b)
    assert res.identical and res.first_step is None and res.tensors == []
    assert res.comparable and res.complete and res.differences == [] and res.reading == ""
    assert res.steps_compared == len(a.stats_steps) >= 12
    assert res.first_scalar_diff is None
    assert "identical" in res.summary()
    # and it says what it compared: every tensor, the state at every (full) step, lr, loss
    cov = res.coverage
    assert cov.tensors == len(a.names("params")) + len(a.names("grads")) + len(a.names("optimizer"))
    assert cov.kinds == ["params", "grads", "optimizer"] and cov.state_steps >= 12 and cov.state_missing == 0
    assert {"hyperparameters", "rng", "scheduler"} <= set(cov.state_parts)
    assert cov.scalars == ["loss", "lr"] and cov.lr_steps == 12


def test_single_flipped_bit_found_at_its_step_and_tensor(tmp_path):
    k = 7

    def flip(step, model, opt):
        if step == k:
            w = model[2].weight
            with torch.no_grad():
                bits = w.view(torch.int32)
                bits[1, 3] ^= 1  # lowest mantissa bit of one element
    a = stepdump.open(record_run(tmp_path / "a", steps=12))
    b = stepdump.open(record_run(tmp_path / "b", steps=12, before_step=flip))
    res = stepdump.diff(a, b)
    assert res.first_step == k
    first = res.first_tensor
    assert (first.kind, first.name) == ("params", "2.weight")
    assert first.reason == "values" and first.n_diff == 1 and first.numel == 64
    assert 0 < first.max_abs < 1e-6
    # grads at step k were computed before the flip, so only the param differs at k
    assert all(t.kind == "params" for t in res.tensors)
    # a 1-ulp change may round away in the loss; if the loss differs, it is only later
    assert res.first_scalar_diff is None or res.first_scalar_diff[0] > k


def test_tolerance_hides_small_differences(tmp_path):
    def flip(step, model, opt):
        if step == 3:
            with torch.no_grad():
                model[0].bias.view(torch.int32)[0] ^= 1
    a = stepdump.open(record_run(tmp_path / "a", steps=4))
    b = stepdump.open(record_run(tmp_path / "b", steps=4, before_step=flip))
    assert stepdump.diff(a, b).first_step == 3
    assert stepdump.diff(a, b, atol=1e-5).identical


def test_different_lengths_and_stats_only_steps(tmp_path):
    a = stepdump.open(record_run(tmp_path / "a", steps=10, every=5))
    b = stepdump.open(record_run(tmp_path / "b", steps=6, every=5, model=tiny_model(act=nn.Tanh())))
    res = stepdump.diff(a, b)
    assert res.steps_only_in_a == sorted(set(a.stats_steps) - set(b.stats_steps)) and res.steps_only_in_b == []
    assert len(res.steps_only_in_a) == 4 and min(res.steps_only_in_a) >= 6 and not res.complete
    # Step 0: params equal (same seed), the loss and grads differ: GELU vs Tanh. Step 0 is full.
    assert res.first_step == 0
    assert {t.kind for t in res.tensors} == {"grads"}
    assert [d.stage for d in res.differences] == ["forward"] + ["grads"] * 4  # the loss, then the grads
    assert res.reading.startswith("params equal, loss differs at step 0 → the batch or the model's code differs")
    c = stepdump.open(record_run(tmp_path / "c", steps=3, every=None))
    d = stepdump.open(record_run(tmp_path / "d", steps=3, every=None, model=tiny_model(act=nn.Tanh())))
    res = stepdump.diff(c, d)
    assert res.first_step == 0 and res.tensors[0].reason == "fingerprint"
    assert res.tensors[0].max_abs is None


def test_names_only_in_one_run(tmp_path):
    a = stepdump.open(record_run(tmp_path / "a", steps=3))
    b = stepdump.open(record_run(tmp_path / "b", steps=3, exclude="2.*"))
    res = stepdump.diff(a, b)
    assert res.identical and not res.complete  # equal where compared; the rest is listed, not assumed
    assert ("params", "2.weight") in res.names_only_in_a and res.names_only_in_b == []
    assert f"{len(res.names_only_in_a)} tensors only in A (e.g. params 2.bias)" in res.summary()
    res = stepdump.diff(a, b, kinds=["grads"])
    assert all(k == "grads" for k, _ in res.names_only_in_a)
