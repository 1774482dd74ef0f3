"""Restore any recorded step and continue: bitwise the same run (issue 2 c).

Data comes from the step index (its own generator); dropout draws from the
global torch RNG, which restore must set to the state at the start of the step.
Fresh objects are built from a different seed, so nothing matches by accident.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import (
    MLP,
    assert_same,
    assert_same_tree,
    optimizer_state_clone,
    regression_batch,
)
from torch import nn

import stepdump

N_STEPS = 30


def _sgd(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": 1e-2}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.1, momentum=0.9,
    )
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)


def _adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.8, 0.95),
    )
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)


def _iteration(model, opt, sched, t):
    x, y = regression_batch(t, n=16, d_in=8, d_out=4)
    loss = nn.functional.mse_loss(model(x), y)  # dropout draws from the torch RNG
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss


def _after(model, opt, sched):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "opt": optimizer_state_clone(opt),
        "sched": sched.state_dict(),
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _assert_state(model, opt, sched, want, what):
    for n, p in model.named_parameters():
        assert_same(p.detach(), want["params"][n], f"{what} param {n}")
    got = optimizer_state_clone(opt)
    assert_same_tree(got["state"], want["opt"]["state"], f"{what} optimizer state")
    assert got["param_groups"] == want["opt"]["param_groups"], f"{what} param groups"
    assert sched.state_dict() == want["sched"], f"{what} scheduler"
    assert [g["lr"] for g in opt.param_groups] == want["lr"], f"{what} lr"


@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd-momentum", "adamw"])
def test_restore_and_continue_is_bitwise_identical(tmp_path, make_opt):
    torch.manual_seed(0)
    model = MLP(8, 32, 4, dropout=0.3)
    opt, sched = make_opt(model)
    after = []
    with stepdump.Recorder(tmp_path / "run", model, opt, sched) as rec:
        for t in range(N_STEPS):
            loss = _iteration(model, opt, sched, t)
            rec.log(loss=loss)
            after.append(_after(model, opt, sched))
        rng_end = torch.get_rng_state()  # what the next iteration would start from
    # the scheduler really changed the lr, and dropout really drew random masks
    assert after[-1]["lr"] != after[0]["lr"]

    run = stepdump.open(tmp_path / "run")
    assert run.steps == list(range(N_STEPS + 1))  # and close()'s final record N: the trained state
    assert run.meta["final_step"] == N_STEPS
    for k in (0, 1, 13, N_STEPS - 1, N_STEPS):
        torch.manual_seed(1000 + k)  # a different init and a different RNG stream
        model2 = MLP(8, 32, 4, dropout=0.3)
        opt2, sched2 = make_opt(model2)
        assert not torch.equal(model2.fc1.weight, run.tensor("fc1.weight", k))
        run.restore(k, model2, opt2, sched2)
        assert_same(model2.fc1.weight.detach(), run.tensor("fc1.weight", k), f"restored {k}")
        if k > 0:
            _assert_state(model2, opt2, sched2, after[k - 1], f"restored step {k}")
        if k == N_STEPS:  # the final record's RNG is the state right after the last update
            assert_same(torch.get_rng_state(), rng_end, "RNG of the final record")
        for t in range(k, N_STEPS):
            _iteration(model2, opt2, sched2, t)
            _assert_state(model2, opt2, sched2, after[t], f"restored at {k}, after step {t}")
            if t + 1 <= N_STEPS:
                # restoring record t and redoing iteration t gives record t+1 (N: the final record)
                for n, p in model2.named_parameters():
                    assert_same(p.detach(), run.tensor(n, t + 1), f"record {t + 1} {n}")
    run.close()


def test_without_rng_restore_dropout_diverges(tmp_path):
    """The RNG part of restore matters: with rng=False the continued run differs."""
    torch.manual_seed(0)
    model = MLP(8, 32, 4, dropout=0.5)
    opt, sched = _sgd(model)
    after = []
    with stepdump.Recorder(tmp_path / "run", model, opt, sched):
        for t in range(6):
            _iteration(model, opt, sched, t)
            after.append(_after(model, opt, sched))
    with stepdump.open(tmp_path / "run") as run:
        torch.manual_seed(77)
        model2 = MLP(8, 32, 4, dropout=0.5)
        opt2, sched2 = _sgd(model2)
        run.restore(3, model2, opt2, sched2, rng=False)
        _iteration(model2, opt2, sched2, 3)
        assert not torch.equal(model2.fc1.weight, after[3]["params"]["fc1.weight"])


def test_rng_state_is_the_one_at_start_of_iteration(tmp_path):
    """torch, numpy and Python's random all come back as they were when step t began."""
    random.seed(5)
    np.random.seed(5)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    draws = []
    with stepdump.Recorder(tmp_path / "run", model, opt):
        for t in range(5):
            draws.append((torch.rand(3), np.random.rand(2), random.random()))
            loss = model(torch.randn(4, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        for t in (4, 0, 2):
            torch.manual_seed(99)
            np.random.seed(99)
            random.seed(99)
            fresh = nn.Linear(3, 1)
            run.restore(t, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
            assert_same(torch.rand(3), draws[t][0], f"torch rng at {t}")
            assert np.array_equal(np.random.rand(2), draws[t][1])
            assert random.random() == draws[t][2]
        state = run.rng_state(2)
        assert set(state) >= {"torch", "numpy", "python"}


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
        lambda ps: torch.optim.NAdam(ps, lr=1e-2),
        lambda ps: torch.optim.RAdam(ps, lr=1e-2),
        lambda ps: torch.optim.Adamax(ps, lr=1e-2),
        lambda ps: torch.optim.ASGD(ps, lr=1e-2),
        lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    ],
    ids=["sgd-nesterov", "adam-amsgrad", "adagrad", "rmsprop", "nadam", "radam", "adamax", "asgd", "rprop"],
)
def test_optimizer_state_round_trips_for_many_optimizers(tmp_path, make):
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    opt = make(model.parameters())
    before = []
    with stepdump.Recorder(tmp_path / "run", model, opt):
        for t in range(4):
            x, y = regression_batch(t, d_in=8, d_out=4)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            before.append(optimizer_state_clone(opt))
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        for t in (1, 3):
            torch.manual_seed(50 + t)
            model2 = MLP(8, 16, 4)
            opt2 = make(model2.parameters())
            run.restore(t, model2, opt2)
            got = optimizer_state_clone(opt2)
            assert_same_tree(got["state"], before[t]["state"], f"{type(opt).__name__} state at {t}")
            assert got["param_groups"] == before[t]["param_groups"]
