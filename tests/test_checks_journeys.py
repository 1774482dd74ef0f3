"""stepdump.check on the journeys users come with: an lr spike, a NaN born in the forward pass,
a run recorded lean. Each records a real run (tiny MLP, a Recorder attached) and reads what
``check`` says: the cause named with its step and factor, a severity that follows the damage,
the next thing to do, and nothing said about what was not measured."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import record_run
from test_checks import of, serious, train
from torch import nn

import stepdump
from stepdump.checks import LrJump, Severity
from stepdump.errors import ConfigError


def _lr_at(schedule: dict[int, float], base: float) -> Any:
    """A ``before_step`` hook that sets every group's lr to ``schedule.get(t, base)``."""

    def hook(t: int, _: nn.Module, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            g["lr"] = schedule.get(t, base)

    return hook


# -- lr_jump ------------------------------------------------------------------------


def test_harmless_lr_spike_is_a_warning_and_a_damaging_one_an_error(tmp_path: Path) -> None:
    k = 12
    # x20 on a tiny lr: the loss does not notice. The rule still names the step and the factor.
    mild = train(tmp_path / "mild", steps=20, opt="sgd", lr=1e-4, before_step=_lr_at({k: 2e-3}, 1e-4))
    found = of(stepdump.check(mild), "lr_jump")
    assert [(f.step, f.severity, f.tensor) for f in found] == [(k, Severity.WARNING, "lr")]
    assert found[0].value == pytest.approx(20.0) and found[0].threshold == 10.0
    assert f"lr at step {k} is 20x its neighbours" in found[0].message
    assert "Find what set the lr at step 12" in found[0].message
    # x300 on a working lr: the loss rises by orders of magnitude but stays finite: an error saying so.
    bad = train(tmp_path / "bad", steps=16, opt="sgd", lr=1e-2, before_step=_lr_at({k: 3.0}, 1e-2))
    loss = bad.scalars()["loss"].loc[:15]  # step 16 is the final record: no iteration, no loss
    assert loss.loc[k + 1:].max() > 10 * loss.loc[:k - 1].median() and loss.notna().all()  # the planted damage
    found = of(stepdump.check(bad), "lr_jump")
    assert [(f.step, f.severity) for f in found] == [(k, Severity.ERROR)]
    assert found[0].value == pytest.approx(300.0)
    assert "the loss then went from" in found[0].message


def test_lr_jump_that_stays_is_named_and_schedules_are_not(tmp_path: Path) -> None:
    # Warmup from 0, a step decay, warm restarts back to the peak: what schedules do on purpose.
    sched = {t: 1e-2 * min(1.0, t / 5) * (0.1 if t % 10 >= 7 else 1.0) for t in range(30)}
    healthy = train(tmp_path / "healthy", steps=30, opt="sgd", lr=0.0, before_step=_lr_at(sched, 1e-2))
    assert healthy.scalars()["lr"].iloc[0] == 0 and healthy.scalars()["lr"].max() == 1e-2
    assert stepdump.check(healthy, rules=["lr_jump"]) == []
    # x50 from step 15 on, above anything the run had before: a jump, with how long it stays.
    jumped = train(tmp_path / "jump", steps=20, opt="sgd", lr=1e-4,
                   before_step=_lr_at({t: 5e-3 for t in range(15, 20)}, 1e-4))
    found = stepdump.check(jumped, rules=["lr_jump"])
    assert [(f.step, f.value) for f in found] == [(15, pytest.approx(50.0))]
    assert "lr jumps 50x at step 15" in found[0].message and "stays there for 5 recorded step(s)" in found[0].message
    assert stepdump.check(jumped, rules=[LrJump(factor=100)]) == []
    with pytest.raises(ConfigError, match="factor must be > 1"):
        LrJump(factor=0.5)


def test_lr_jump_in_two_param_groups_is_one_finding(tmp_path: Path) -> None:
    def two(model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]

    run = train(tmp_path / "run", steps=15, opt="sgd", lr=1e-4, groups=two, before_step=_lr_at({8: 1e-1}, 1e-4))
    found = of(stepdump.check(run), "lr_jump")
    assert len(found) == 1
    assert (found[0].step, found[0].tensors) == (8, ("lr", "lr/1"))
    assert stepdump.check(run, rules=[LrJump(scalars=("lr/1",))])[0].tensors == ()  # one group: no list


# -- NaN born in the forward pass -----------------------------------------------------


class Sqrt(nn.Module):
    """sqrt of its input; at step ``bad`` the input is shifted below 0, so the output is NaN."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad, self.t = bad, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - (10.0 if self.t == self.bad else 0.0))


def _nan_run(path: Path, k: int, capture: tuple[str, ...]) -> stepdump.types.Run:
    torch.manual_seed(0)
    sqrt = Sqrt(k)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), sqrt, nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        sqrt.t = t
        x = torch.randn(16, 8, generator=gen)
        return x, x.sum(1, keepdim=True)

    record_run(path, steps=k + 3, model=model, opt=opt, batch=batch, capture=capture)
    return stepdump.open(path)


def test_nan_first_seen_in_the_loss_says_record_activations_which_then_names_the_module(tmp_path: Path) -> None:
    k = 6
    run = _nan_run(tmp_path / "plain", k, ("params", "grads", "optimizer"))
    found = of(stepdump.check(run), "nan_inf")
    assert [(f.step, f.kind, f.tensor, f.severity) for f in found] == [(k, None, "loss", Severity.ERROR)]
    assert "the forward pass produced it" in found[0].message
    assert 'record activations (capture=("params", "grads", "optimizer", "activations")' in found[0].message
    # Following the advice: the same run with activations names the module exactly.
    run = _nan_run(tmp_path / "acts", k, ("params", "grads", "optimizer", "activations"))
    found = of(stepdump.check(run), "nan_inf")
    assert [(f.step, f.kind, f.tensor) for f in found] == [(k, "activations", "2")]  # the Sqrt
    assert "record activations" not in found[0].message


# -- the lean path: NULL stats are "not measured" -------------------------------------------


def test_lean_run_nulls_are_not_measured_not_findings(tmp_path: Path) -> None:
    # 64x80 = 5120 elements: over the 4096 above which lean steps leave mean/std/zero_frac NULL.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 80, generator=gen)
        return x, x[:, :1]

    record_run(tmp_path / "run", steps=40, model=model, opt=opt, batch=batch, every=10, stats_every=1)
    run = stepdump.open(tmp_path / "run")
    grads = run.stats("grads", name="0.weight").set_index("step")
    assert grads["zero_frac"].isna().any() and grads["zero_frac"].notna().any()  # lean and full steps both here
    assert grads["norm"].notna().all()
    opt_steps = set(run.stats("optimizer")["step"])
    assert opt_steps and opt_steps != set(run.stats_steps)  # optimizer state only at some steps
    findings = stepdump.check(run)
    assert serious(findings) == [], [f.message for f in serious(findings)]
    # Dead ReLUs under the same recording: zero_frac of 0.weight is measured at the full steps 0 and 10
    # only; the stretch counts those (a NULL between them does not break it).
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    record_run(tmp_path / "dead", steps=15, model=model, opt=opt, batch=batch, every=10, stats_every=1)
    dead = of(stepdump.check(stepdump.open(tmp_path / "dead"), config={"dead_units": {"patience": 2}}), "dead_units")
    assert ("grads", "0.weight") in {(f.kind, f.tensor) for f in dead}


# -- the command line -------------------------------------------------------------


def test_cli_check_shows_the_cause_and_the_grouped_tensors(cli: Any, tmp_path: Path) -> None:
    k = 12
    run = train(tmp_path / "run", steps=16, opt="sgd", lr=1e-2, before_step=_lr_at({k: 3.0}, 1e-2))
    found = json.loads(cli("check", run.path, "--json", ok=1).stdout)
    jump = [f for f in found if f["rule"] == "lr_jump"]
    assert [(f["step"], f["severity"], f["tensor"], f["tensors"]) for f in jump] == [(k, "error", "lr", [])]
    ratio = [f for f in found if f["rule"] == "update_ratio"]
    assert len(ratio) == 1 and sorted(ratio[0]["tensors"]) == ["0.weight", "2.weight"]
    table = cli("check", run.path, "--rules", "lr_jump,update_ratio", "--fail-on", "error", "--table", ok=1).stdout
    assert "lr_jump" in table and "300x" in table  # rich wraps the message at spaces, never inside a word
    assert "(+1)" in table  # update_ratio: the lead weight and one more
    # in a pipe (and with --csv): one line per finding, every tensor of a grouped one listed
    rows = list(csv.DictReader(io.StringIO(cli("check", run.path, "--rules", "lr_jump,update_ratio", "--csv",
                                                ok=1).stdout)))
    assert sorted(r["rule"] for r in rows) == ["lr_jump", "update_ratio"]
    assert sorted(next(r for r in rows if r["rule"] == "update_ratio")["tensor"].split(";")) == ["0.weight", "2.weight"]
    tsv = cli("check", run.path, "--rules", "lr_jump", ok=1).stdout.splitlines()
    assert tsv[0].split("\t") == ["severity", "rule", "step", "kind", "tensor", "message"] and len(tsv) == 2
