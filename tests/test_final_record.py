"""The final record close() writes (issue 15): record N after optimizer steps 0..N-1 is the trained
model, optimizer, scheduler and RNG, with no grads, in every schedule, and restoring it continues
training bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import assert_same, assert_same_tree, catalog_sql, seed_all, snapshot
from torch import nn

import stepdump

N = 5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # dropout and a BatchNorm: the RNG and the buffers matter
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 4))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _iteration(t: int, model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> torch.Tensor:
    x, y = _batch(t)
    x = x + float(np.random.rand()) + random.random()  # numpy's and Python's RNG are in the step too
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    return loss


@pytest.mark.parametrize("schedule", [{}, {"gradient_log": 3}])
def test_final_record_is_the_trained_model_optimizer_scheduler_and_rng(tmp_path, schedule):
    model, opt, sched = _objects()
    seed_all(1)
    with stepdump.Recorder(tmp_path / "run", model, opt, sched, **schedule) as rec:
        for t in range(N):
            rec.log(loss=_iteration(t, model, opt, sched))
        rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        model.eval()  # an evaluation after the last update draws random numbers: not the final record's RNG
        np.random.rand(3)
        random.random()
        torch.rand(3)
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == run.all_steps == list(range(N + 1))
        assert run.meta["final_step"] == N
        assert run.names("grads") and run.tensors(N, "grads") == {}  # update N never ran
        sd = run.state_dict(N)
        live = model.state_dict()
        assert sorted(sd) == sorted(live)
        for k, v in live.items():
            assert_same(sd[k], v, k)  # params and BatchNorm buffers as they are at close
        assert_same_tree(run.optimizer_state_dict(N), opt.state_dict(), "optimizer")
        assert_same_tree(run.scheduler_state_dict(N), sched.state_dict(), "scheduler")
        got = run.rng_state(N)
        assert_same(got["torch"], rng[0], "torch rng")
        assert np.array_equal(got["numpy"]["keys"].numpy(), rng[1][1]) and got["numpy"]["pos"] == rng[1][2]
        assert tuple(got["python"]["state"].tolist()) == rng[2][1]
        assert stepdump.verify(run).ok
        assert stepdump.check(run) == []  # a step without grads is no finding


def test_restoring_the_final_record_continues_bitwise_like_an_uninterrupted_run(tmp_path):
    model, opt, sched = _objects()
    seed_all(2)
    with stepdump.Recorder(tmp_path / "run", model, opt, sched):
        for t in range(N):
            _iteration(t, model, opt, sched)
    ref_model, ref_opt, ref_sched = _objects()
    seed_all(2)
    for t in range(N + 3):  # the same training, never interrupted
        _iteration(t, ref_model, ref_opt, ref_sched)

    fresh, fresh_opt, fresh_sched = _objects(seed=7)  # other weights: restore must set everything
    seed_all(99)  # and another RNG state
    with stepdump.open(tmp_path / "run") as run:
        run.restore(run.steps[-1], fresh, fresh_opt, scheduler=fresh_sched)
    for t in range(N, N + 3):
        _iteration(t, fresh, fresh_opt, fresh_sched)
    for (name, a), b in zip(fresh.state_dict().items(), ref_model.state_dict().values(), strict=True):
        assert_same(a, b, name)
    assert_same_tree(fresh_opt.state_dict(), ref_opt.state_dict(), "optimizer")


@pytest.mark.parametrize("schedule", [
    {"every": None, "stats_every": 1},  # lean: no tensors stored at any step
    {"every": 100, "stats_every": 1},  # tiered: N is not one of its full steps
    {"gradient_log": 3},  # a gradient log: the final record is its last keyframe
])
def test_every_schedule_ends_with_a_full_final_record(tmp_path, schedule):
    model, opt, sched = _objects()
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt, sched, **schedule):
        for t in range(N):
            snaps.append(snapshot(model, opt))
            _iteration(t, model, opt, sched)
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == list(range(N + 1)) and run.meta["final_step"] == N
        assert N in run.steps and run.steps[-1] == N
        for k, v in model.state_dict().items():
            assert_same(run.state_dict(N)[k], v, k)
        assert_same_tree(run.optimizer_state_dict(N), opt.state_dict(), "optimizer")
        if "gradient_log" in schedule:
            assert run.steps == list(range(N + 1))  # every step still reads, rebuilt from the keyframes
            assert_same(run.tensor("0.weight", 4), snaps[4]["params"]["0.weight"], "rebuilt step 4")
        report = stepdump.verify(run)
        assert report.ok, report.problems
        if "gradient_log" in schedule:
            assert report.segments_checked == 3  # 0..3, 3..5 (re-applied onto the final record), 5
        assert stepdump.check(run) == []


def test_no_final_record_without_an_update_or_in_the_middle_of_one(tmp_path):
    model, opt, sched = _objects()
    stepdump.Recorder(tmp_path / "none", model, opt, sched).close()  # no update since it started
    with stepdump.open(tmp_path / "none") as run:
        assert run.all_steps == [] and "final_step" not in run.meta

    rec = stepdump.Recorder(tmp_path / "mid", model, opt, sched)
    _iteration(0, model, opt, sched)
    x, y = _batch(1)
    nn.functional.mse_loss(model(x), y).backward()
    rec.capture()  # record 1 is taken, its update has not run: close() must not overwrite it
    rec.close()
    with stepdump.open(tmp_path / "mid") as run:
        assert run.all_steps == [0, 1] and "final_step" not in run.meta
        assert run.tensors(1, "grads")  # record 1 kept its grads
    assert catalog_sql(tmp_path / "mid", "SELECT count(*) FROM steps WHERE step = 1")[0][0] == 1


def test_the_rng_after_an_update_is_read_once_where_the_next_iteration_start_reads_it(tmp_path, monkeypatch):
    """A gradient log takes every iteration's start state right after the update: the final record's
    RNG is that same reading, not a second one (RngAfterUpdate.take only at the Recorder's start);
    a lean run, which takes no start state, reads it at every update."""
    from stepdump.capture import final

    calls = {"n": 0}
    take = final.RngAfterUpdate.take

    def counted(self):
        calls["n"] += 1
        return take(self)

    monkeypatch.setattr(final.RngAfterUpdate, "take", counted)
    for schedule, expected in (({"gradient_log": 3}, 1), ({"every": None, "stats_every": 1}, 1 + N)):
        calls["n"] = 0
        model, opt, sched = _objects()
        with stepdump.Recorder(tmp_path / str(expected), model, opt, sched, **schedule):
            for t in range(N):
                _iteration(t, model, opt, sched)
        assert calls["n"] == expected, schedule
