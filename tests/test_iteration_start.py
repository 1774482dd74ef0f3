"""Where an iteration starts (issue 28, items 1 and 4): what a record's RNG and buffers are
when the loop does more than one model's update, or evaluates, between two updates.

Each case records a real loop, then for every recorded step k restores record k into fresh
objects, runs the loop on from iteration k and compares the end state bit for bit with the
uninterrupted run: params, buffers (BatchNorm's running stats and ``num_batches_tracked``)
and optimizer state. Scalars are checked against the values each iteration computed.

* the two-Recorder GAN pattern (dcgan's loop: D's update, then G's, which runs netD again):
  D's record starts where the loop iteration does (after G's update), not at D's own update;
  ``errD`` logged after both updates lands on the iteration that computed it;
* a diffusion-style loop that samples (draws from the global RNG) every 3 steps: record t
  holds the RNG iteration t's training work starts with, after the sampling.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree
from torch import nn

import stepdump

N = 7  # iterations; evaluations after iterations 2 and 5 (and before 3 and 6)
B = 4


# -- a dcgan-style GAN, recorded with one Recorder per optimizer ---------------------------------
class Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 8)
        self.drop = nn.Dropout(0.2)  # G's forward draws from the RNG

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.drop(self.fc(z))).view(-1, 1, 8)


class Disc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.fc = nn.Linear(18, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.leaky_relu(self.bn(self.conv(x)), 0.2)
        return torch.sigmoid(self.fc(h.flatten(1))).view(-1)


def gan_objects(seed: int) -> tuple[Gen, Disc, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    g, d = Gen(), Disc()
    return (g, d, torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.5, 0.999)))


REAL = torch.linspace(-1, 1, N * B * 8).view(N, B, 1, 8).sin()


def gan_iteration(i: int, g: Gen, d: Disc, opt_g: Any, opt_d: Any, order: str) -> tuple[float, float]:
    """One iteration of dcgan's loop (``order="DG"``), or with G's update first (``"GD"``)."""
    bce = nn.BCELoss()
    ones, zeros = torch.ones(B), torch.zeros(B)

    def d_update(fake: torch.Tensor) -> float:
        d.zero_grad()
        err_real = bce(d(REAL[i]), ones)
        err_real.backward()
        err_fake = bce(d(fake.detach()), zeros)
        err_fake.backward()
        opt_d.step()
        return float((err_real + err_fake).detach())

    def g_update(fake: torch.Tensor) -> float:
        g.zero_grad()
        err = bce(d(fake), ones)  # runs netD (BatchNorm in train mode) and backprops through it
        err.backward()
        opt_g.step()
        return float(err.detach())

    fake = g(torch.randn(B, 3))
    if order == "DG":
        err_d = d_update(fake)
        err_g = g_update(fake)
    else:
        err_g = g_update(fake)
        err_d = d_update(g(torch.randn(B, 3)))
    return err_d, err_g


def end_state(*objs: Any) -> list[Any]:
    out: list[Any] = []
    for o in objs:
        out.append({k: v.clone() for k, v in o.state_dict().items()} if isinstance(o, nn.Module)
                   else o.state_dict())
    return out


def idle_recorder(path: Path) -> stepdump.Recorder:
    """A Recorder left open in the process (a notebook cell never closed, an earlier test) that
    recorded a step before the loop under test and then stays idle: it must not change that loop's records."""
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rec = stepdump.Recorder(path, m, opt, on_error="raise")
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    return rec


@pytest.mark.parametrize("idle", [False, True], ids=["alone", "idle_recorder_open"])
@pytest.mark.parametrize("order", ["DG", "GD"])
def test_two_recorders_gan_restore_and_logs(tmp_path: Path, order: str, idle: bool) -> None:
    other = idle_recorder(tmp_path / "idle") if idle else None
    g, d, opt_g, opt_d = gan_objects(0)
    logged: list[tuple[float, float]] = []
    with stepdump.Recorder(tmp_path / "D", d, opt_d, on_error="raise") as rec_d, \
            stepdump.Recorder(tmp_path / "G", g, opt_g, on_error="raise") as rec_g:
        for i in range(N):
            err_d, err_g = gan_iteration(i, g, d, opt_g, opt_d, order)
            rec_d.log(errD=err_d)  # after both updates, as dcgan logs
            rec_g.log(errG=err_g)
            logged.append((err_d, err_g))
    want = end_state(g, d, opt_g, opt_d)
    if other is not None:
        other.close()

    # Recording changed nothing.
    g0, d0, og0, od0 = gan_objects(0)
    for i in range(N):
        gan_iteration(i, g0, d0, og0, od0, order)
    assert_same_tree(end_state(g0, d0, og0, od0), want, "without recording")

    run_d, run_g = stepdump.open(tmp_path / "D"), stepdump.open(tmp_path / "G")
    # Each log at the iteration that computed it.
    sd, sg = run_d.scalars(), run_g.scalars()
    assert [sd.loc[i, "errD"] for i in range(N)] == [e for e, _ in logged]
    assert [sg.loc[i, "errG"] for i in range(N)] == [e for _, e in logged]
    for k in range(N + 1):
        # Both records of iteration k start at the same moment: the same RNG.
        assert_same_tree(run_d.rng_state(k), run_g.rng_state(k), f"RNG of step {k}")
        g1, d1, og1, od1 = gan_objects(1)
        run_d.restore(k, d1, od1)
        run_g.restore(k, g1, og1)
        for i in range(k, N):
            gan_iteration(i, g1, d1, og1, od1, order)
        assert_same_tree(end_state(g1, d1, og1, od1), want, f"restore({k}) + continue")


# -- a diffusion-style loop with sampling between updates ---------------------------------------
class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(9, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(0.1)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.nn.functional.silu(self.bn(self.fc1(x)))))


DATA = torch.linspace(-2, 2, N * B * 8).view(N, B, 8).cos()


def sample(model: Denoiser, how: str) -> None:
    """Sampling / evaluation between updates; each draws from the global RNG."""
    if how == "eval_mode":
        model.eval()
    with torch.no_grad():
        if how == "loader":  # a fresh shuffled DataLoader iterator draws its seed from the global RNG
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(DATA[0]), batch_size=2, shuffle=True)
            for (x,) in loader:
                model(torch.cat([x, torch.zeros(len(x), 1)], 1))
        else:
            x = torch.randn(B, 8)
            for k in range(3):
                x = x - 0.1 * model(torch.cat([x, torch.full((B, 1), float(k))], 1))
                if how == "trailing" or k < 2:
                    x = x + 0.01 * torch.randn(B, 8)  # "trailing": a draw after the last forward
    if how == "eval_mode":
        model.train()


def diffusion_iteration(i: int, model: Denoiser, opt: Any) -> float:
    x0 = DATA[i]
    t = torch.randint(0, 10, (B, 1)).float()
    noise = torch.randn_like(x0)
    xt = x0 * (1 - t / 10) + noise * t / 10
    loss = nn.functional.mse_loss(model(torch.cat([xt, t], 1)), noise)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def diffusion_objects(seed: int) -> tuple[Denoiser, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Denoiser()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def run_diffusion(model: Denoiser, opt: Any, start: int, how: str, where: str,
                  rec: stepdump.Recorder | None = None) -> list[float]:
    """Iterations start..N-1; sampling every 3 steps, at the end of iteration i (``where="end"``)
    or at the start of iteration i before its training work (``"start"``, not before ``start``:
    record ``start`` holds the state after it)."""
    losses = []
    for i in range(start, N):
        if where == "start" and i % 3 == 0 and i > start:
            sample(model, how)
            if rec is not None and how == "trailing":
                rec.begin_iteration()
        losses.append(diffusion_iteration(i, model, opt))
        if rec is not None:
            rec.log(loss=losses[-1])
        if where == "end" and i % 3 == 2:
            sample(model, how)
            if rec is not None and how == "trailing":
                rec.begin_iteration()  # the documented fix where the sampler draws after its last forward
    return losses


SHAPES = [(how, where) for how in ("no_grad", "eval_mode", "loader", "trailing") for where in ("end", "start")]


@pytest.mark.parametrize("how,where", SHAPES)
@pytest.mark.parametrize("mode", ["full", "keyframes", "gradient_log"])
def test_restore_after_sampling_is_bitwise(tmp_path: Path, how: str, where: str, mode: str) -> None:
    model, opt = diffusion_objects(0)
    opts: dict[str, Any] = {"full": {}, "keyframes": {"keyframe_every": 3}, "gradient_log": {"gradient_log": 3}}[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing ambiguous here: no warning
        with stepdump.Recorder(tmp_path / "r", model, opt, on_error="raise", **opts) as rec:
            losses = run_diffusion(model, opt, 0, how, where, rec)
    want = end_state(model, opt)
    m0, o0 = diffusion_objects(0)
    assert run_diffusion(m0, o0, 0, how, where) == losses
    assert_same_tree(end_state(m0, o0), want, "without recording")

    run = stepdump.open(tmp_path / "r")
    assert list(run.scalars()["loss"])[:N] == losses
    for k in run.steps:
        m1, o1 = diffusion_objects(1)
        run.restore(k, m1, o1)
        run_diffusion(m1, o1, k, how, where)
        for (name, a), b in zip(m1.state_dict().items(), want[0].values()):
            assert_same(a, b, f"restore({k}) + continue: {name}")
        assert_same_tree(o1.state_dict(), want[1], f"restore({k}) + continue: optimizer")


@pytest.mark.parametrize("order", ["DG", "GD"])
def test_two_recorders_diff_names_d_lr_change(tmp_path: Path, order: str) -> None:
    """D's lr changed before iteration 3 of run b: the diff of the D runs names it at step 3,
    as the earliest difference (hyperparameters), with everything before it identical."""
    for tag in ("a", "b"):
        g, d, opt_g, opt_d = gan_objects(0)
        with stepdump.Recorder(tmp_path / tag / "D", d, opt_d, on_error="raise") as rec_d, \
                stepdump.Recorder(tmp_path / tag / "G", g, opt_g, on_error="raise") as rec_g:
            for i in range(N):
                if tag == "b" and i == 3:
                    opt_d.param_groups[0]["lr"] = 5e-4
                err_d, err_g = gan_iteration(i, g, d, opt_g, opt_d, order)
                rec_d.log(errD=err_d)
                rec_g.log(errG=err_g)
    result = stepdump.diff(stepdump.open(tmp_path / "a" / "D"), stepdump.open(tmp_path / "b" / "D"))
    assert result.first_step == 3
    first = result.differences[0]
    assert (first.step, first.stage, first.what, first.a, first.b) == (3, "hyperparameters", "lr", 1e-3, 5e-4)
