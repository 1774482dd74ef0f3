"""One run over several (model, optimizer) pairs (issue 28 item 1): ``Recorder(path, models=, optimizers=)``.

The dcgan-style loop of test_iteration_start.py (D's update then G's, which runs netD again:
BatchNorm in D), recorded jointly, in both update orders and three schedules:

* training is bitwise the same as without recording;
* record k of the joint run holds, per pair, the model and optimizer state at the top of loop
  iteration k (compared with snapshots taken there), names prefixed by pair (``D/fc.weight``);
* restore(k) of the whole run into fresh objects + continuing is bitwise at every step
  (params, buffers incl. ``num_batches_tracked``, Adam state);
* each log at the iteration that computed it; the joint diff names D's lr change at step 3;
  ``check`` finds nothing on the healthy run; export per model; the report covers both pairs.

An actor-critic on one model (shared trunk with BatchNorm, two heads, two optimizers) restores
bitwise; a param in two optimizers, a critic stepping twice per iteration, and an optimizer
missing an iteration are refused with a ConfigError that names them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree
from test_iteration_start import B, N, end_state, gan_iteration, gan_objects
from torch import nn

import stepdump
from stepdump.checks import Severity
from stepdump.errors import ConfigError, StepdumpError

MODES: dict[str, dict[str, Any]] = {"full": {}, "keyframes": {"keyframe_every": 3}, "gradient_log": {"gradient_log": 3}}


def snapshot(*objs: Any) -> list[Any]:
    return [{k: v.clone() for k, v in o.state_dict().items()} if isinstance(o, nn.Module) else
            __import__("copy").deepcopy(o.state_dict()) for o in objs]


def record_gan(path: Path, order: str, lr_change: bool = False, **opts: Any) -> tuple[list[Any], list[Any]]:
    """Record the GAN jointly; return (per-iteration snapshots at the loop top, logged values)."""
    g, d, opt_g, opt_d = gan_objects(0)
    tops, logged = [], []
    with stepdump.Recorder(path, models={"G": g, "D": d}, optimizers={"G": opt_g, "D": opt_d},
                           on_error="raise", **opts) as rec:
        for i in range(N):
            if lr_change and i == 3:
                opt_d.param_groups[0]["lr"] = 5e-4
            tops.append(snapshot(g, d, opt_g, opt_d))
            err_d, err_g = gan_iteration(i, g, d, opt_g, opt_d, order)
            rec.log(errD=err_d, errG=err_g)  # after both updates, as dcgan logs
            logged.append((err_d, err_g))
    tops.append(snapshot(g, d, opt_g, opt_d))
    return tops, logged


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("order", ["DG", "GD"])
def test_joint_gan_restores_bitwise_at_every_step(tmp_path: Path, order: str, mode: str) -> None:
    tops, logged = record_gan(tmp_path / "j", order, **MODES[mode])
    want = tops[-1]
    g0, d0, og0, od0 = gan_objects(0)  # recording changed nothing
    for i in range(N):
        gan_iteration(i, g0, d0, og0, od0, order)
    assert_same_tree(end_state(g0, d0, og0, od0), want, "without recording")

    run = stepdump.open(tmp_path / "j")
    assert type(run).__name__ == "JointRun" and run.pair_names == ["G", "D"] and run.order == list(order)
    assert run.all_steps == list(range(N + 1))
    assert set(run.names("params")) == {"G/fc.weight", "G/fc.bias", "D/conv.weight", "D/conv.bias", "D/bn.weight",
                                        "D/bn.bias", "D/fc.weight", "D/fc.bias"}
    sc = run.scalars()
    assert [sc.loc[i, "errD"] for i in range(N)] == [e for e, _ in logged]
    assert [sc.loc[i, "errG"] for i in range(N)] == [e for _, e in logged]
    assert list(sc["D/lr"])[:N] == [1e-3] * N and list(sc["G/lr"])[:N] == [2e-3] * N
    steps = run.steps
    assert steps == (list(range(N + 1)) if mode != "keyframes" else [0, 3, 6, 7])
    for k in steps:
        top_g, top_d, top_og, top_od = tops[k]
        assert_same_tree(dict(run.state_dict(k, model="D")), top_d, f"D's model at step {k}")
        assert_same_tree(dict(run.state_dict(k, model="G")), top_g, f"G's model at step {k}")
        assert_same_tree(run.optimizer_state_dict(k, optimizer="D"), top_od, f"D's optimizer at step {k}")
        assert_same_tree(run.optimizer_state_dict(k, optimizer="G"), top_og, f"G's optimizer at step {k}")
        assert_same(run.tensor("D/bn.running_var", k, kind="buffers"), top_d["bn.running_var"], f"buffer {k}")
        assert_same_tree(run.pair("D").rng_state(k), run.pair("G").rng_state(k), f"RNG of step {k}")
        g1, d1, og1, od1 = gan_objects(1)
        run.restore(k, models={"G": g1, "D": d1}, optimizers={"G": og1, "D": od1})
        for i in range(k, N):
            gan_iteration(i, g1, d1, og1, od1, order)
        assert_same_tree(end_state(g1, d1, og1, od1), want, f"restore({k}) + continue")


@pytest.mark.parametrize("order", ["DG", "GD"])
def test_joint_diff_names_d_lr_change(tmp_path: Path, order: str) -> None:
    record_gan(tmp_path / "a", order)
    record_gan(tmp_path / "b", order, lr_change=True)
    record_gan(tmp_path / "a2", order)
    a, b = stepdump.open(tmp_path / "a"), stepdump.open(tmp_path / "b")
    result = stepdump.diff(a, b)
    assert result.first_step == 3 and result.pair == "D"
    first = result.differences[0]
    assert (first.step, first.stage, first.what, first.a, first.b) == (3, "hyperparameters", "D/lr", 1e-3, 5e-4)
    assert set(result.per_pair) == {"G", "D"} and result.per_pair["D"].first_step == 3
    assert "in pair D, first at D/lr" in result.headline()
    same = stepdump.diff(a, stepdump.open(tmp_path / "a2"))
    assert same.identical and same.first_step is None
    with pytest.raises(ConfigError, match="joint run"):
        stepdump.diff(a, a.pair("D"))


def test_joint_check_report_export(tmp_path: Path) -> None:
    tops, _ = record_gan(tmp_path / "j", "DG")
    run = stepdump.open(tmp_path / "j")
    assert stepdump.check(run) == []  # healthy: no false alarm
    out = run.export(4, tmp_path / "d4.pt", model="D")
    saved = torch.load(out, weights_only=True)
    assert_same_tree(dict(saved["model"]), tops[4][1], "exported D")
    assert_same_tree(saved["optimizer"], tops[4][3], "exported D optimizer")
    with pytest.raises(ConfigError, match="model='D'"):
        run.state_dict(4)
    html = (stepdump.report(run, tmp_path / "r.html") if hasattr(stepdump, "report") else
            __import__("stepdump.render.html", fromlist=["write_report"]).write_report(run, tmp_path / "r.html"))
    text = Path(html).read_text()
    assert "G/fc.weight" in text and "D/conv.weight" in text
    # A reader that does not know joint.json finds no run there: refused, never half read.
    with pytest.raises(StepdumpError):
        stepdump.read.run.Run(tmp_path / "j")


# -- actor-critic: one model, a shared trunk, two heads, two optimizers ---------------------------
class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.actor = nn.Linear(8, 3)
        self.critic = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.actor(nn.functional.dropout(h, 0.1)), self.critic(h)


OBS = torch.linspace(-1, 1, N * B * 4).view(N, B, 4).cos()


def ac_objects(seed: int) -> tuple[ActorCritic, Any, Any]:
    torch.manual_seed(seed)
    m = ActorCritic()
    return (m, torch.optim.Adam([*m.trunk.parameters(), *m.actor.parameters()], lr=1e-2),
            torch.optim.SGD(m.critic.parameters(), lr=1e-3, momentum=0.9))


def ac_iteration(i: int, m: ActorCritic, opt_a: Any, opt_c: Any) -> float:
    logits, _ = m(OBS[i])
    act = torch.distributions.Categorical(logits=logits).sample()  # draws from the RNG
    opt_a.zero_grad()
    (-logits.log_softmax(-1).gather(1, act[:, None]).mean()).backward()
    opt_a.step()
    _, value = m(OBS[i])  # the critic's pass sees the trunk after the actor's update
    opt_c.zero_grad()
    loss = (value.squeeze(1) - act.float()).pow(2).mean()
    loss.backward()
    opt_c.step()
    return float(loss.detach())


def test_actor_critic_shared_trunk_restores_bitwise(tmp_path: Path) -> None:
    m, opt_a, opt_c = ac_objects(0)
    tops = []
    with stepdump.Recorder(tmp_path / "ac", models={"actor": m, "critic": m},
                           optimizers={"actor": opt_a, "critic": opt_c}, on_error="raise") as rec:
        for i in range(N):
            tops.append(snapshot(m))
            rec.log(value_loss=ac_iteration(i, m, opt_a, opt_c))
    want = end_state(m, opt_a, opt_c)
    m0, a0, c0 = ac_objects(0)
    for i in range(N):
        ac_iteration(i, m0, a0, c0)
    assert_same_tree(end_state(m0, a0, c0), want, "without recording")

    run = stepdump.open(tmp_path / "ac")
    assert run.doc["model_of"] == {"actor": "actor", "critic": "actor"}
    for k in run.steps:
        if k < N:  # the module both pairs share, as it was at the top of the iteration (either name)
            assert_same_tree(dict(run.state_dict(k, model="critic")), tops[k][0], f"model at step {k}")
        m1, a1, c1 = ac_objects(1)
        run.restore(k, models={"actor": m1, "critic": m1}, optimizers={"actor": a1, "critic": c1})
        for i in range(k, N):
            ac_iteration(i, m1, a1, c1)
        assert_same_tree(end_state(m1, a1, c1), want, f"restore({k}) + continue")
    # No false alarm: each param judged in the pair whose optimizer updates it (before that, the
    # critic head in the actor's records moved by updates the actor did not make: update_ratio).
    found = stepdump.check(run)
    assert [f for f in found if f.severity >= Severity.WARNING] == []
    assert [f.rule for f in found] == ["loss_not_decreasing"]  # INFO: value_loss is not declared an objective


def test_param_in_two_optimizers_is_refused(tmp_path: Path) -> None:
    m = ActorCritic()
    opt_a = torch.optim.Adam([*m.trunk.parameters(), *m.actor.parameters()])
    opt_c = torch.optim.Adam([*m.trunk.parameters(), *m.critic.parameters()])
    with pytest.raises(ConfigError, match="in the optimizers of both 'actor' and 'critic'"):
        stepdump.Recorder(tmp_path / "x", models={"actor": m, "critic": m}, optimizers={"actor": opt_a, "critic": opt_c})
    assert not (tmp_path / "x").exists()


def wgan_iteration(i: int, g: Any, d: Any, opt_g: Any, opt_d: Any, shape: str) -> None:
    """``critic_first``: D steps twice, then G (WGAN); ``g_every_other``: G steps every other iteration."""
    def d_step() -> None:
        d.zero_grad()
        (d(g(torch.randn(B, 3)).detach()).mean() - d(torch.randn(B, 1, 8)).mean()).backward()
        opt_d.step()

    def g_step() -> None:
        g.zero_grad()
        (-d(g(torch.randn(B, 3))).mean()).backward()
        opt_g.step()

    if shape == "critic_first":
        d_step()
        d_step()
        g_step()
    elif shape == "critic_after":
        g_step()
        d_step()
        d_step()
    else:
        d_step()
        if i % 2 == 0:
            g_step()


@pytest.mark.parametrize("shape,says", [("critic_first", "optimizer 'D' stepped again in iteration 0 before 'G'"),
                                        ("critic_after", r"optimizer 'D' stepped where 'G' was due \(iteration 1"),
                                        ("g_every_other", "optimizer 'D' stepped where 'G' was due")])
@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_unequal_updates_are_refused(tmp_path: Path, shape: str, says: str, on_error: str,
                                     caplog: pytest.LogCaptureFixture) -> None:
    g, d, opt_g, opt_d = gan_objects(0)
    rec = stepdump.Recorder(tmp_path / "w", models={"G": g, "D": d}, optimizers={"G": opt_g, "D": opt_d},
                            on_error=on_error)
    with caplog.at_level(logging.WARNING), rec:
        if on_error == "raise":
            with pytest.raises(ConfigError, match=says):
                for i in range(4):
                    wgan_iteration(i, g, d, opt_g, opt_d, shape)
        else:  # do no harm: training goes on, bitwise as without recording; the run says why it stopped
            for i in range(4):
                wgan_iteration(i, g, d, opt_g, opt_d, shape)
            g0, d0, og0, od0 = gan_objects(0)
            for i in range(4):
                wgan_iteration(i, g0, d0, og0, od0, shape)
            assert_same_tree(end_state(g0, d0, og0, od0), end_state(g, d, opt_g, opt_d), "unrecorded")
    if on_error == "warn":
        assert re.search(says, caplog.text)
        run = stepdump.open(tmp_path / "w")
        assert all(re.search(says, r.meta["recording_stopped"]["error"]) for _, r in run.pair_stores())


def test_bad_spellings(tmp_path: Path) -> None:
    g, d, opt_g, opt_d = gan_objects(0)
    with pytest.raises(ConfigError, match="differ"):
        stepdump.Recorder(tmp_path / "a", models={"G": g, "D": d}, optimizers={"G": opt_g})
    with pytest.raises(ConfigError, match="not both"):
        stepdump.Recorder(tmp_path / "b", g, opt_g, models={"D": d}, optimizers={"D": opt_d})
    with pytest.raises(ConfigError, match="pair name"):
        stepdump.Recorder(tmp_path / "c", models={"a/b": g}, optimizers={"a/b": opt_g})
    with pytest.raises(ConfigError, match="schedulers= names"):
        stepdump.Recorder(tmp_path / "d", models={"G": g}, optimizers={"G": opt_g}, schedulers={"X": None})
    with pytest.raises(ConfigError, match="needs the model"):
        stepdump.Recorder(tmp_path / "e")


@pytest.mark.parametrize("bad", ["D_optimizer_class", "D_model_shape", "models_missing", "unknown_pair"])
def test_joint_restore_checks_every_pair_first(tmp_path: Path, bad: str) -> None:
    """A pair that fails its checks leaves every pair's objects (and the RNG) as they were."""
    record_gan(tmp_path / "j", "DG")
    run = stepdump.open(tmp_path / "j")
    g1, d1, og1, od1 = gan_objects(1)
    models: dict[str, Any] = {"G": g1, "D": d1}
    optimizers: dict[str, Any] = {"G": og1, "D": od1}
    if bad == "D_optimizer_class":
        optimizers["D"] = torch.optim.SGD(d1.parameters(), lr=0.1)
    elif bad == "D_model_shape":
        models["D"] = nn.Linear(2, 2)
    elif bad == "models_missing":
        del models["D"]
    else:
        models["X"] = d1
    for o in (g1, d1):  # states with content, so "unchanged" can fail
        o(torch.randn(B, 3) if o is g1 else torch.randn(B, 1, 8)).sum().backward()
    og1.step()
    before = snapshot(g1, d1, og1, optimizers["D"])
    rng = torch.get_rng_state()
    with pytest.raises(StepdumpError):
        run.restore(4, models=models, optimizers=optimizers)
    assert_same_tree(snapshot(g1, d1, og1, optimizers["D"]), before, "nothing restored")
    assert torch.equal(torch.get_rng_state(), rng)
