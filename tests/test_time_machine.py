"""Keyframes + verified replay, localize, and the flight-recorder ring (issue 6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stepdump
from stepdump.analysis.localize import Setup, localize


class Net(nn.Module):
    def __init__(self, approximate: str = "none", width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, width)
        self.act1 = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.GELU(approximate=approximate)
        self.fc3 = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.drop(self.act1(self.fc1(x))))))


def build(seed: int, approximate: str = "none", lr: float = 1e-2, width: int = 16):
    torch.manual_seed(seed)
    model = Net(approximate, width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train_step(model, opt, b):
    x, y = b
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def record(path, steps=24, approximate="none", change_lr_at=None, width=16, **kw):
    model, opt = build(0, approximate, width=width)
    with stepdump.Recorder(path, model, opt, **kw) as rec:
        for s in range(steps):
            if change_lr_at is not None and s == change_lr_at:
                opt.param_groups[0]["lr"] *= 2
            b = batch(s)
            rec.log_batch(b)
            train_step(model, opt, b)
    return stepdump.open(path)


def test_replay_rebuilds_every_step_bitwise(tmp_path):
    full = record(tmp_path / "full")
    kf = record(tmp_path / "kf", keyframe_every=8)
    # keyframes, and the final record 24 (stored in full in every schedule)
    assert kf.steps == [0, 8, 16, 24] and kf.stats_steps == list(range(25)) and kf.meta["final_step"] == 24
    for name in full.names("params"):
        assert torch.equal(kf.tensor(name, 24), full.tensor(name, 24)), name
    for step in range(24):
        model, opt = build(seed=99)  # different init: everything must come from the run
        res = stepdump.replay(kf, step, model, opt, train_step)
        assert res.keyframe == step - step % 8
        for kind in ("params", "grads", "optimizer"):
            for name in full.names(kind):
                try:
                    want = full.tensor(name, step, kind)
                except stepdump.StepNotFoundError:
                    continue  # optimizer state does not exist before the first update
                assert torch.equal(res.tensor(name, kind), want), (step, kind, name)
        # the live objects are left in the state of record `step`
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), full.tensor(name, step))


def test_replay_with_planted_lr_change_diverges_at_that_step(tmp_path):
    kf = record(tmp_path / "kf", keyframe_every=8, change_lr_at=11)
    model, opt = build(0)
    with pytest.raises(stepdump.ReplayDiverged) as err:
        stepdump.replay(kf, 15, model, opt, train_step)
    # lr changed before update 11: the replay sees the other lr at step 11.
    assert err.value.step == 11 and err.value.name == "lr"
    assert "step 11" in str(err.value)
    model, opt = build(0)
    with pytest.raises(stepdump.ReplayDiverged) as err:  # a changed weight: found by fingerprints
        stepdump.replay(kf, 3, model, opt, lambda m, o, b: (train_step(m, o, b), m.fc1.bias.data.add_(1e-3)))
    assert err.value.step == 1 and err.value.kind in ("params", "grads")
    assert "thread" in str(err.value)


def test_keyframe_mode_is_much_smaller_than_full(tmp_path):
    from stepdump.cli.common import run_bytes

    full = record(tmp_path / "full", steps=32, width=256)
    kf = record(tmp_path / "kf", steps=32, keyframe_every=32, width=256)
    # One full step in 32 plus per-step RNG, batch, stats: the benchmark measures workload A.
    assert run_bytes(kf.path) < 0.08 * run_bytes(full.path)


def test_diff_and_localize_name_the_changed_module(tmp_path):
    ref = record(tmp_path / "ref", steps=6)
    port = record(tmp_path / "port", steps=6, approximate="tanh")
    res = stepdump.diff(ref, port)
    assert res.first_step == 0
    assert res.first_tensor.kind == "grads"
    loc = localize(ref, res.first_step, Setup(*build(1), train_step), Setup(*build(2, "tanh"), train_step))
    assert loc.module == "act2" and loc.phase == "forward"
    assert loc.diff.max_abs > 0 and "act2" in loc.summary()
    same = localize(ref, 3, Setup(*build(1), train_step), Setup(*build(2), train_step))
    assert same.module is None and "identical" in same.summary()


def test_ring_writes_exactly_the_n_steps_before_a_nan(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    k, n, after = 12, 4, 2
    with stepdump.Recorder(tmp_path / "r", model, opt, ring=n, after=after) as rec:
        for s in range(25):
            opt.zero_grad()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            if s == k:
                model.weight.grad[0, 0] = float("nan")
            opt.step()
            rec.log(loss=loss)
            if s == k:
                with torch.no_grad():
                    model.weight.nan_to_num_(0.0)
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [*range(k - n, k + after + 1), 25]  # and the final record 25
    assert run.meta["final_step"] == 25
    assert run.stats_steps == list(range(26))  # stats continue in between
    assert torch.isnan(run.tensor("weight", k, kind="grads")).any()
    assert run.state_dict(k - n)  # full state of the earliest ring step


def test_ring_with_user_trigger_and_validation(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "r", model, opt, ring=2, after=0, trigger=lambda info: info.step == 7):
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    with stepdump.open(tmp_path / "r") as run:
        assert run.steps == [5, 6, 7, 10] and run.meta["final_step"] == 10  # 10: the final record
    with pytest.raises(stepdump.ConfigError, match="ring"):
        stepdump.Recorder(tmp_path / "x", model, opt, ring=2, every=5)
    with pytest.raises(stepdump.ConfigError, match="trigger"):
        stepdump.Recorder(tmp_path / "y", model, opt, ring=2, trigger=42)
    # trigger= / after= without ring= did nothing, silently; a misspelt trigger name too
    for bad in ({"trigger": "nan_in"}, {"trigger": "nan_inf"}, {"after": 3}):
        with pytest.raises(stepdump.ConfigError, match="ring=N"):
            stepdump.Recorder(tmp_path / "z", model, opt, **bad)
    with pytest.raises(stepdump.ConfigError, match="trigger='nan_in'"):
        stepdump.Recorder(tmp_path / "z", model, opt, ring=2, trigger="nan_in")
    assert not (tmp_path / "z").exists()  # refused before anything was created
