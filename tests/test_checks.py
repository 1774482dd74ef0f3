"""stepdump.check: every rule finds the trouble planted in a real recorded run, and is quiet otherwise.

Each test trains a tiny MLP (8 -> 16 -> 1, 161 parameters) on synthetic
regression data for a few dozen steps with a Recorder attached, plants one
problem (a NaN, a frozen parameter, an lr blow-up, ...) and checks that the
right rule names the right step and tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import record_run
from torch import nn

import stepdump
from stepdump.analysis.checks import resolve_rules
from stepdump.checks import (
    DEFAULT_RULES,
    ExplodingGradient,
    Finding,
    LossSpike,
    NanInf,
    Rule,
    Severity,
    UpdateRatio,
    register_rule,
    rule_names,
)
from stepdump.errors import ConfigError

Hook = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def train(
    path: Path,
    *,
    steps: int = 40,
    opt: str = "adam",
    lr: float = 1e-2,
    seed: int = 0,
    before_step: Hook | None = None,
    after_step: Hook | None = None,
    loss_fn: Callable[[int, nn.Module, torch.Tensor], torch.Tensor] | None = None,
    log: Callable[[int, torch.Tensor], dict[str, Any]] | None = None,
    groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
    scaler: Any = None,
    dtype: torch.dtype = torch.float32,
    capture: tuple[str, ...] = ("params", "grads", "optimizer"),
    **opt_kwargs: Any,
) -> stepdump.types.Run:
    """Record a small regression run (``record_run``); the hooks plant problems at chosen steps.
    ``backward()`` sees ``loss_fn(t, model, mse)``, and ``rec.log`` gets ``log(t, mse)`` (default:
    ``loss=mse``), the plain MSE."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    params: Any = groups(model) if groups is not None else model.parameters()
    if opt == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, **opt_kwargs)
    else:
        optimizer = torch.optim.SGD(params, lr=lr, **opt_kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    w_true = torch.randn(8, 1, generator=gen, dtype=dtype)
    mse: dict[int, torch.Tensor] = {}

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=gen, dtype=dtype)
        return x, x @ w_true + 0.1 * torch.randn(32, 1, generator=gen, dtype=dtype)

    def total_loss(t: int, model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mse[t] = nn.functional.mse_loss(model(b[0]), b[1])
        return loss_fn(t, model, mse[t]) if loss_fn is not None else mse[t]

    record_run(path, steps=steps, model=model, opt=optimizer, scaler=scaler, batch=batch, loss_fn=total_loss,
               before_step=before_step, after_step=after_step, capture=capture,
               log=lambda t, _: log(t, mse[t]) if log is not None else {"loss": mse[t]})
    return stepdump.open(path)


def of(findings: list[Finding], rule: str, at_least: Severity = Severity.INFO) -> list[Finding]:
    return [f for f in findings if f.rule == rule and f.severity >= at_least]


def serious(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity >= Severity.WARNING]


# -- healthy runs ---------------------------------------------------------------


@pytest.mark.parametrize("opt,lr,kw", [("adam", 1e-2, {}), ("sgd", 2e-2, {"momentum": 0.9})])
def test_healthy_run_has_no_warnings(tmp_path: Path, opt: str, lr: float, kw: dict[str, Any]) -> None:
    run = train(tmp_path / "run", steps=60, opt=opt, lr=lr, **kw)
    findings = stepdump.check(run)
    assert serious(findings) == [], [f.message for f in serious(findings)]
    assert findings == []  # not even info: nothing was skipped
    loss = run.scalars()["loss"]
    assert loss.iloc[-5:].mean() < loss.iloc[:5].mean() / 4  # it did learn


# -- nan_inf --------------------------------------------------------------------


def test_nan_in_a_grad_names_its_step_and_tensor(tmp_path: Path) -> None:
    k = 17

    def poison(t: int, model: nn.Module, _: Any) -> None:
        if t == k:
            model[0].weight.grad[3, 2] = float("nan")

    run = train(tmp_path / "run", steps=30, opt="sgd", before_step=poison)
    findings = stepdump.check(run)
    nan = of(findings, "nan_inf")
    assert len(nan) == 1
    f = nan[0]
    assert (f.step, f.kind, f.tensor, f.severity) == (k, "grads", "0.weight", Severity.ERROR)
    assert f.value == 1
    # Sorted by step: nothing at warning or above comes before the origin.
    assert serious(findings)[0] == f


def test_nan_in_a_weight_points_at_the_weight_not_at_the_grads_it_spoils(tmp_path: Path) -> None:
    # Set outside the optimizer after update k-1: record k holds the NaN param,
    # and every grad of step k is NaN because of it. The origin is the param.
    k = 12

    def poison(t: int, model: nn.Module, _: Any) -> None:
        if t == k - 1:
            with torch.no_grad():
                model[2].weight[0, 5] = float("nan")

    run = train(tmp_path / "run", steps=20, opt="sgd", after_step=poison)
    assert run.stats("grads", name="0.weight", steps=k)["nan"].iloc[0] > 0  # the grads are spoiled too
    f = of(stepdump.check(run, rules=["nan_inf"]), "nan_inf")[0]
    assert (f.step, f.kind, f.tensor) == (k, "params", "2.weight")
    assert "update 11" in f.message


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_scalar(tmp_path: Path, bad: float) -> None:
    k = 9
    run = train(tmp_path / "run", steps=15, log=lambda t, loss: {"loss": bad if t == k else loss})
    nan = of(stepdump.check(run, rules="nan_inf"), "nan_inf")
    assert [(f.step, f.kind, f.tensor, f.severity) for f in nan] == [(k, None, "loss", Severity.ERROR)]


def test_non_finite_grads_at_a_skipped_amp_step_are_info(tmp_path: Path) -> None:
    k = 6

    def overflow(t: int, model: nn.Module, _: Any) -> None:
        if t == k:
            model[0].bias.grad[0] = float("inf")

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    run = train(tmp_path / "run", steps=15, before_step=overflow, scaler=scaler)
    assert run.skipped_steps == [k]
    nan = of(stepdump.check(run), "nan_inf")
    assert [(f.step, f.kind, f.tensor, f.severity) for f in nan] == [(k, "grads", "0.bias", Severity.INFO)]


# -- gradients ------------------------------------------------------------------


def test_lr_times_1000_at_step_k(tmp_path: Path) -> None:
    k = 25

    def blow(t: int, _: nn.Module, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (1000 if t == k else 1)

    run = train(tmp_path / "run", steps=40, opt="sgd", lr=1e-2, before_step=blow)
    findings = stepdump.check(run)
    # The cause, named with its step and factor; an error, since the loss then explodes.
    jump = of(findings, "lr_jump")
    assert [(f.step, f.tensor, f.severity) for f in jump] == [(k, "lr", Severity.ERROR)]
    assert jump[0].value == pytest.approx(1000.0)
    assert f"lr at step {k} is 1000x its neighbours" in jump[0].message
    spike = of(findings, "loss_spike", Severity.WARNING)
    assert spike and spike[0].step == k + 1  # the loss after the bad update
    assert spike[0].tensor == "loss" and spike[0].severity == Severity.ERROR
    assert f"lr spike at step {k}" in spike[0].message  # the symptom points at the cause
    exploding = of(findings, "exploding_gradient", Severity.WARNING)
    assert len(exploding) == 1 and exploding[0].step == k + 1  # one finding for the whole blow-up
    assert exploding[0].kind == "grads" and exploding[0].tensor in run.names("grads")
    # One finding for the update that hit both weights, not one per weight.
    ratio = of(findings, "update_ratio", Severity.WARNING)
    assert len(ratio) == 1
    assert set(ratio[0].tensors) == {"0.weight", "2.weight"} and ratio[0].tensor in ratio[0].tensors
    assert ratio[0].step == k and ratio[0].value > 1  # the update itself
    # Nothing flagged before the planted step.
    assert min(f.step for f in serious(findings) if f.step is not None) == k


def test_update_ratio_reads_only_max_pairs_and_still_finds_the_blow_up(tmp_path: Path) -> None:
    k = 25

    def blow(t: int, _: nn.Module, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (1000 if t == k else 1)

    run = train(tmp_path / "run", steps=40, opt="sgd", lr=1e-2, before_step=blow)
    reads: list[int] = []
    real = run.tensor

    def counting(name: str, step: int, kind: str = "params") -> torch.Tensor:
        reads.append(step)
        return real(name, step, kind)

    run.tensor = counting  # type: ignore[method-assign]
    findings = stepdump.check(run, rules=[UpdateRatio(max_pairs=4)])
    assert {f.step for f in findings} == {k}
    assert len(set(reads)) <= 8  # 4 pairs of steps, not 40


def test_exploding_gradient_absolute_limit_is_an_error(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=20)
    gmax = run.stats("grads").groupby("step")["norm"].apply(lambda n: math.sqrt((n**2).sum())).max()
    findings = stepdump.check(run, rules=[ExplodingGradient(max_norm=gmax / 2)])
    assert findings and findings[0].severity == Severity.ERROR
    assert findings[0].threshold == pytest.approx(gmax / 2)


def test_vanishing_gradient_from_a_loss_scaled_down(tmp_path: Path) -> None:
    k = 10
    run = train(tmp_path / "run", steps=30, opt="sgd", loss_fn=lambda t, m, loss: loss * (1e-12 if t >= k else 1.0))
    vanish = of(stepdump.check(run), "vanishing_gradient")
    assert [(f.step, f.kind, f.severity) for f in vanish] == [(k, "grads", Severity.WARNING)]
    assert vanish[0].value < 1e-8


def test_dead_relu_units(tmp_path: Path) -> None:
    def kill(model: nn.Module) -> list[dict[str, Any]]:
        with torch.no_grad():
            model[0].bias.fill_(-100.0)  # no input gets the ReLUs above zero
        return [{"params": list(model.parameters())}]

    run = train(tmp_path / "run", steps=20, groups=kill)
    dead = of(stepdump.check(run), "dead_units")
    # One cause, one finding (issue 27): the dead layer leads, every tensor it starved is listed.
    assert [(f.kind, f.tensor, set(f.tensors)) for f in dead] == [
        ("grads", "0.weight", {"0.weight", "0.bias", "2.weight"})]
    assert all(f.step == 0 and f.value == 1.0 for f in dead)
    assert all(f.severity == Severity.WARNING for f in dead)
    assert "the last layer whose every tensor is dead is '0'" in dead[0].message


def test_dead_relu_units_seen_in_activations(tmp_path: Path) -> None:
    def kill(model: nn.Module) -> list[dict[str, Any]]:
        with torch.no_grad():
            model[0].bias.fill_(-100.0)
        return [{"params": list(model.parameters())}]

    run = train(tmp_path / "run", steps=15, groups=kill, capture=("params", "grads", "activations"))
    assert "1" in run.names("activations")  # the ReLU's output
    dead = {(f.kind, f.tensor) for f in of(stepdump.check(run, rules=["dead_units"]), "dead_units")}
    assert ("activations", "1") in dead
    assert ("activations", "0") not in dead  # the Linear's output is negative, not zero


# -- parameters -----------------------------------------------------------------


def test_unchanged_tensor_lr_zero_group_and_zeroed_grad(tmp_path: Path) -> None:
    def split(model: nn.Module) -> list[dict[str, Any]]:
        frozen = model[2].bias
        return [{"params": [p for p in model.parameters() if p is not frozen]}, {"params": [frozen], "lr": 0.0}]

    def zero(t: int, model: nn.Module, _: Any) -> None:
        model[0].bias.grad.zero_()  # a grad wiped by mistake before every step

    run = train(tmp_path / "run", steps=20, opt="sgd", groups=split, before_step=zero)
    found = {f.tensor: f for f in of(stepdump.check(run), "unchanged_tensor")}
    assert set(found) == {"2.bias", "0.bias"}
    assert "lr=0" in found["2.bias"].message
    assert "always zero" in found["0.bias"].message
    assert all(f.kind == "params" and f.step == 0 and f.severity == Severity.WARNING for f in found.values())


def test_param_without_grad_but_in_the_optimizer_is_unchanged(tmp_path: Path) -> None:
    def freeze(model: nn.Module) -> list[dict[str, Any]]:
        model[0].weight.requires_grad_(False)
        return [{"params": list(model.parameters())}]

    run = train(tmp_path / "run", steps=12, groups=freeze)
    found = of(stepdump.check(run), "unchanged_tensor")
    assert [f.tensor for f in found] == ["0.weight"]
    # A freeze inside the optimizer is how peft builds a LoRA run: the cause is named, as INFO (issue 27).
    assert "never had a gradient" in found[0].message and found[0].severity == Severity.INFO


def test_weight_norm_growth(tmp_path: Path) -> None:
    # A loss term that rewards large first-layer weights: Adam grows each of
    # them by ~lr per step, well past 10x their initial norm.
    run = train(tmp_path / "run", steps=60, lr=0.05,
                loss_fn=lambda t, m, loss: loss - 0.1 * (m[0].weight ** 2).sum())
    growth = of(stepdump.check(run), "weight_norm_growth")
    assert [f.tensor for f in growth] == ["0.weight"]
    f = growth[0]
    norms = run.stats("params", name="0.weight").set_index("step")["norm"]
    assert f.step == int((norms / norms.iloc[0] > 10).idxmax())
    assert f.value > 10 and f.threshold == 10


def test_update_ratio_too_small_on_a_float64_model(tmp_path: Path) -> None:
    # float64 keeps updates of ~1e-9 relative size (float32 would round them away).
    run = train(tmp_path / "run", steps=12, opt="sgd", lr=1e-8, dtype=torch.float64)
    small = of(stepdump.check(run, rules=["update_ratio"]), "update_ratio")
    assert len(small) == 1 and set(small[0].tensors) == {"0.weight", "2.weight"}
    assert small[0].value < 1e-7 and small[0].threshold == 1e-7


def test_update_ratio_hi_is_tunable(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=12)
    assert stepdump.check(run, rules=["update_ratio"]) == []
    tight = stepdump.check(run, rules=["update_ratio"], config={"update_ratio": {"hi": 1e-4}})
    assert len(tight) == 1 and set(tight[0].tensors) == {"0.weight", "2.weight"}
    assert tight[0].threshold == 1e-4 and tight[0].value > 1e-4


# -- optimizer state ------------------------------------------------------------


def test_adam_eps_swamps_the_second_moment(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=15, eps=100.0)  # eps read from the run's param groups
    found = of(stepdump.check(run), "optimizer_state")
    assert {f.tensor for f in found} == {f"{p}.exp_avg_sq" for p in ("0.weight", "0.bias", "2.weight", "2.bias")}
    assert all(f.kind == "optimizer" and f.step == 1 and f.threshold == pytest.approx(10.0) for f in found)


def test_adam_with_a_loss_scaled_down_has_eps_dominated_state(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=12, loss_fn=lambda t, m, loss: loss * 1e-12)
    findings = stepdump.check(run)
    state = of(findings, "optimizer_state")
    assert "0.weight.exp_avg_sq" in {f.tensor for f in state}
    assert all(f.step == 1 and f.threshold == pytest.approx(1e-9) for f in state)
    assert of(findings, "vanishing_gradient")[0].step == 0


# -- loss -------------------------------------------------------------------------


def test_loss_not_decreasing_when_training_goes_uphill(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=30, opt="sgd", lr=1e-2, maximize=True)
    f = of(stepdump.check(run), "loss_not_decreasing")
    assert len(f) == 1
    assert f[0].step is None and f[0].tensor == "loss" and f[0].value >= f[0].threshold
    assert stepdump.check(run)[-1].step is None  # whole-run findings sort last


def test_loss_rules_need_enough_history(tmp_path: Path) -> None:
    run = train(tmp_path / "run", steps=8, opt="sgd", lr=1e-2, maximize=True)
    assert of(stepdump.check(run), "loss_not_decreasing") == []  # 8 < min_steps=20
    assert of(stepdump.check(run, config={"loss_not_decreasing": {"min_steps": 5}}), "loss_not_decreasing")


# -- the check() API ----------------------------------------------------------------


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory: pytest.TempPathFactory) -> stepdump.types.Run:
    """A healthy run whose logged loss is 1000x too high at step 30 (the tensors are untouched)."""
    path = tmp_path_factory.mktemp("spiky") / "run"
    return train(path, steps=40, log=lambda t, loss: {"loss": loss * (1000 if t == 30 else 1)})


def test_rules_by_name_instance_and_config(spiky_run: stepdump.types.Run) -> None:
    assert [f.step for f in stepdump.check(spiky_run, rules=["loss_spike"])] == [30]
    assert stepdump.check(spiky_run, rules=[LossSpike(z=1e6)]) == []
    assert stepdump.check(spiky_run, rules=["loss_spike"], config={"loss_spike": {"z": 1e6}}) == []
    assert stepdump.check(spiky_run, config={"loss_spike": {"z": 1e6}}) == []
    # config also replaces fields of an instance with that name
    assert stepdump.check(spiky_run, rules=[LossSpike(z=1e6)], config={"loss_spike": {"z": 6}}) != []
    # a rule class works too, and a path instead of a Run
    assert [f.rule for f in stepdump.check(spiky_run.path, rules=[LossSpike])] == ["loss_spike"]


def test_findings_sorted_by_step_then_severity(spiky_run: stepdump.types.Run) -> None:
    def many(run: Any) -> list[Finding]:
        mk = lambda sev, step: Finding("many", sev, step, None, None, None, None, "x")  # noqa: E731
        return [mk(Severity.INFO, 3), mk(Severity.ERROR, None), mk(Severity.WARNING, 3), mk(Severity.ERROR, 3),
                mk(Severity.INFO, 1)]

    many.name = "many"  # type: ignore[attr-defined]
    got = [(f.step, f.severity) for f in stepdump.check(spiky_run, rules=[many])]
    assert got == [(1, Severity.INFO), (3, Severity.ERROR), (3, Severity.WARNING), (3, Severity.INFO),
                   (None, Severity.ERROR)]


def test_unknown_rule_and_bad_options_raise_config_error(spiky_run: stepdump.types.Run) -> None:
    with pytest.raises(ConfigError, match="unknown rule 'loss_spik'.*loss_spike"):
        stepdump.check(spiky_run, rules=["loss_spik"])
    with pytest.raises(ConfigError, match="no option 'zz'.*z, window"):
        stepdump.check(spiky_run, config={"loss_spike": {"zz": 3}})
    with pytest.raises(ConfigError, match="z must be > 0"):
        LossSpike(z=-1)
    with pytest.raises(ConfigError, match="window must be an integer"):
        LossSpike(window=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lo < hi"):
        UpdateRatio(lo=1.0, hi=0.1)
    with pytest.raises(ConfigError, match="not among the rules run"):
        stepdump.check(spiky_run, rules=["nan_inf"], config={"loss_spike": {"z": 3}})
    with pytest.raises(TypeError):
        LossSpike(6.0)  # type: ignore[misc]  # keyword-only
    assert issubclass(ConfigError, stepdump.StepdumpError)


def test_default_rules_and_names() -> None:
    names = rule_names()
    assert names[: len(DEFAULT_RULES)] == [
        "nan_inf", "exploding_gradient", "vanishing_gradient", "loss_spike", "loss_not_decreasing", "lr_jump",
        "update_ratio", "unchanged_tensor", "dead_units", "weight_norm_growth", "optimizer_state", "recording_stopped",
        "reexecution", "model_changed",
    ]
    rules = resolve_rules()
    assert [r.name for r in rules] == names[: len(DEFAULT_RULES)]
    assert all(isinstance(r, Rule) for r in rules)
    assert NanInf().options() == {"scalars": ("*",)}


def test_custom_rules(spiky_run: stepdump.types.Run) -> None:
    # 1. any callable with a name
    def last_loss_high(run: Any) -> list[Finding]:
        loss = run.scalars()["loss"]
        return [Finding("last_loss_high", Severity.WARNING, int(loss.index[-1]), None, "loss",
                        float(loss.iloc[-1]), 0.0, "the loss is still above 0")]

    last_loss_high.name = "last_loss_high"  # type: ignore[attr-defined]

    # 2. a registered Rule subclass, selectable and configurable by name
    @register_rule
    @dataclass(frozen=True, kw_only=True)
    class GradNormAbove(Rule):
        name: ClassVar[str] = "test_grad_norm_above"
        limit: float = 1e-3

        def __call__(self, run: Any) -> list[Finding]:
            g = run.stats("grads")
            hit = g[g["norm"] > self.limit]
            if hit.empty:
                return []
            r = hit.iloc[0]
            return [self.finding(Severity.INFO, r.step, f"{r['name']} above {self.limit}", kind="grads",
                                 tensor=r["name"], value=r.norm, threshold=self.limit)]

    assert "test_grad_norm_above" in rule_names()
    findings = stepdump.check(spiky_run, rules=[last_loss_high, "test_grad_norm_above", "loss_spike"])
    assert {f.rule for f in findings} == {"last_loss_high", "test_grad_norm_above", "loss_spike"}
    ours = of(findings, "test_grad_norm_above")[0]
    assert (ours.step, ours.kind, ours.threshold) == (0, "grads", 1e-3)
    assert stepdump.check(spiky_run, rules=["test_grad_norm_above"], config={"test_grad_norm_above": {"limit": 1e9}}) == []

    # 3. a rule that returns something else is a ConfigError naming it
    def broken(run: Any) -> list[str]:
        return ["not a finding"]

    with pytest.raises(ConfigError, match="'broken' returned str"):
        stepdump.check(spiky_run, rules=[broken])
