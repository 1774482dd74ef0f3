"""bf16 autocast on CPU with a GradScaler; a step with an inf gradient is skipped (issue 2 e)."""

from __future__ import annotations

import math

import torch
from helpers import (
    MLP,
    assert_final_record,
    assert_run_matches,
    assert_same,
    regression_batch,
    snapshot,
)
from torch import nn

import stepdump

INF_STEP = 4
N_STEPS = 9
INIT_SCALE = 2.0**10


def _train(tmp_path, optimizer_cls, explicit_unscale=True):
    assert hasattr(torch.amp, "GradScaler"), "this torch has no torch.amp.GradScaler"
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    opt = optimizer_cls(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    snaps, scales, losses = [], [], []
    with stepdump.Recorder(tmp_path / "run", model, opt, scaler=scaler) as rec:
        for t in range(N_STEPS):
            x, y = regression_batch(t, d_in=8, d_out=4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
            if t == INF_STEP:
                loss = loss * float("inf")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scales.append(scaler.get_scale())
            if explicit_unscale:
                scaler.unscale_(opt)  # grads as the update sees them
            snaps.append(snapshot(model, opt))
            scaler.step(opt)
            scaler.update()
            rec.log(loss=loss)
            losses.append(loss.item())
    return model, opt, scaler, snaps, scales, losses


def test_gradscaler_skipped_step_is_recorded_and_marked(tmp_path):
    model, opt, scaler, snaps, scales, losses = _train(tmp_path, torch.optim.Adam)
    k = INF_STEP
    assert scales[k + 1] == scales[k] / 2  # the scaler really backed off
    with stepdump.open(tmp_path / "run") as run:
        # steps 0..N-1, then the final record N: the state after the last update, the scaler's too
        assert run.all_steps == list(range(N_STEPS + 1))
        assert run.steps == list(range(N_STEPS + 1))
        assert_final_record(run, model, opt, step=N_STEPS)
        assert run.scaler_state_dict(N_STEPS)["scale"] == scaler.get_scale()
        assert run.skipped_steps == [k]
        sc = run.scalars()
        assert list(sc.index) == list(range(N_STEPS + 1))
        assert not sc.loc[N_STEPS, "skipped"] and math.isnan(sc.loc[N_STEPS, "loss"])  # nothing logged there
        sc = sc.drop(index=N_STEPS)
        assert sc["skipped"].dtype == bool
        assert list(sc["skipped"]) == [t == k for t in range(N_STEPS)]
        assert math.isinf(sc.loc[k, "loss"])
        assert sc.loc[k + 1, "loss"] == losses[k + 1]
        # grad_scale is logged automatically: the scale the iteration used
        assert list(sc["grad_scale"]) == scales
        assert sc.loc[k + 1, "grad_scale"] == sc.loc[k, "grad_scale"] / 2
        # the scaler's own state says the same
        assert run.scaler_state_dict(k)["scale"] == INIT_SCALE
        assert run.scaler_state_dict(k + 1)["scale"] == run.scaler_state_dict(k)["scale"] / 2
        # no update at the skipped step: params and optimizer state carry over unchanged
        for name in run.names("params"):
            assert_same(run.tensor(name, k + 1), run.tensor(name, k), f"{name} across skipped step")
            assert not torch.equal(run.tensor(name, k), run.tensor(name, k - 1))
        for name in run.names("optimizer"):
            assert_same(run.tensor(name, k + 1, "optimizer"), run.tensor(name, k, "optimizer"), name)
        # the inf grads that made the scaler skip are what the record holds
        grad_stats = run.stats(kind="grads", steps=k)
        assert (grad_stats["nan"] + grad_stats["posinf"] + grad_stats["neginf"]).sum() > 0
        assert (run.stats(kind="grads", steps=k + 1)[["nan", "posinf", "neginf"]] == 0).all().all()
        # and every tensor of every step is what the loop had before scaler.step
        for t in range(N_STEPS):
            assert_run_matches(run, t, snaps[t])


def test_scaler_unscaling_inside_step_records_unscaled_grads_and_restores(tmp_path):
    """Usual loop without unscale_(): the record holds the grads the update used (unscaled)."""
    _, _, _, snaps, scales, _ = _train(tmp_path, torch.optim.SGD, explicit_unscale=False)
    with stepdump.open(tmp_path / "run") as run:
        assert run.skipped_steps == [INF_STEP]
        for t in (0, INF_STEP + 1, N_STEPS - 1):
            for name, scaled in snaps[t]["grads"].items():
                # scales are powers of two, so unscaling is exact
                assert_same(run.tensor(name, t, "grads"), scaled * (1.0 / scales[t]), f"grad {name} at {t}")
                assert not torch.equal(run.tensor(name, t, "grads"), scaled)
            for name, p in snaps[t]["params"].items():
                assert_same(run.tensor(name, t), p)
        model = MLP(8, 16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        run.restore(INF_STEP + 2, model, opt, scaler=scaler)
        assert scaler.get_scale() == scales[INF_STEP + 2] == INIT_SCALE / 2
