"""stepdump.diff names the earliest cause, reads it, measures errors sanely and says what it compared.

Issue 15's user reports: an lr-only difference headlined as "grads 0.weight"; "identical" about
runs with no tensor in common; ``max rel 2.63e+304``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers import MLP, record_run, tiny_model

import stepdump
from stepdump.analysis.diff import compare_tensors


def _sgd_run(path, lr: float = 0.1, momentum: float = 0.0, steps: int = 4, **kw):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return stepdump.open(record_run(path, steps=steps, model=model, opt=opt, **kw))


def test_runs_differing_only_in_lr_are_headlined_by_lr_at_step_0(tmp_path):
    a, b = _sgd_run(tmp_path / "a", lr=0.1), _sgd_run(tmp_path / "b", lr=0.2)
    res = stepdump.diff(a, b)
    assert not res.identical and res.first_step == 0
    cause = res.differences[0]
    assert (cause.stage, cause.what, cause.a, cause.b) == ("hyperparameters", "lr", 0.1, 0.2)
    assert [d.what for d in res.differences] == ["lr"]  # the state's lr and the lr scalar, said once
    assert res.summary().splitlines()[0] == "runs diverge at step 0, first at lr (A 0.1, B 0.2)"
    assert res.reading == "lr differs at step 0 → the schedule/hyperparameters differ"
    # Update 0 used another lr: the params of record 1 are the first tensors to differ.
    assert res.first_tensor_step == 1 and res.first_tensor.kind == "params"


def test_an_lr_change_mid_run_is_found_at_its_step_between_full_steps(tmp_path):
    def halve(t, model, opt):  # after update 5: update 6 uses half the lr
        if t == 5:
            opt.param_groups[0]["lr"] *= 0.5
    a = _sgd_run(tmp_path / "a", steps=10, every=4)
    b = _sgd_run(tmp_path / "b", steps=10, every=4, after_step=halve)
    res = stepdump.diff(a, b)
    assert 6 not in a.steps  # step 6 is stats-only: only the lr scalar tells
    assert (res.first_step, res.cause.what, res.cause.a, res.cause.b) == (6, "lr", 0.1, 0.05)
    assert res.reading.startswith("lr differs at step 6 →") and res.first_tensor_step == 7
    assert res.coverage.state_missing > 0 and "without a recorded state" in res.summary()


def test_a_hyperparameter_only_the_state_holds_is_compared(tmp_path):
    a, b = _sgd_run(tmp_path / "a", momentum=0.9), _sgd_run(tmp_path / "b", momentum=0.8)
    res = stepdump.diff(a, b)
    assert (res.first_step, res.cause.what, res.cause.a, res.cause.b) == (0, "momentum", 0.9, 0.8)
    assert res.reading == "momentum differs at step 0 → the schedule/hyperparameters differ"


def test_a_scheduler_setting_is_a_hyperparameter(tmp_path):
    def sched(gamma):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=gamma)
    ma, oa, sa = sched(0.5)
    mb, ob, sb = sched(0.25)
    a = stepdump.open(record_run(tmp_path / "a", steps=4, model=ma, opt=oa, scheduler=sa))
    b = stepdump.open(record_run(tmp_path / "b", steps=4, model=mb, opt=ob, scheduler=sb))
    res = stepdump.diff(a, b)
    assert (res.first_step, res.cause.what, res.cause.a, res.cause.b) == (0, "scheduler gamma", 0.5, 0.25)


def test_a_different_seed_reads_as_the_rng(tmp_path):
    def run(path, seed):
        torch.manual_seed(0)
        model = MLP(d_in=8, d_out=4, dropout=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(seed)  # the same weights; another dropout stream
        return stepdump.open(record_run(path, steps=3, model=model, opt=opt))
    res = stepdump.diff(run(tmp_path / "a", 1), run(tmp_path / "b", 2))
    # The verdict is what dropout computed differently (the loss); the RNG is read as its cause.
    assert res.first_step == 0 and (res.cause.stage, res.cause.what) == ("forward", "loss")
    assert "the torch RNG differs at the start of step 0 (the likely cause" in res.reading
    assert [t.kind for t in res.tensors][:1] == ["grads"]  # params equal, dropout changed the grads


def _double_grads_at(k):
    def hook(t, model, opt):
        if t == k:
            for p in model.parameters():
                p.grad.mul_(2)
    return hook


def test_params_equal_grads_differ_is_read_as_batch_or_rng(tmp_path):
    # A lean run records neither the RNG nor the batch: the reading names both as suspects.
    lean = {"every": None, "stats_every": 1}
    a = stepdump.open(record_run(tmp_path / "a", steps=5, **lean))
    b = stepdump.open(record_run(tmp_path / "b", steps=5, before_step=_double_grads_at(2), **lean))
    res = stepdump.diff(a, b)
    assert res.first_step == 2 and [d.stage for d in res.differences] == ["grads"] * 4
    assert res.reading == ("params equal, grads differ at step 2 → the batch or the RNG differs, or the model's "
                           "code (neither was recorded to tell)")
    # Recorded in full, the RNG is compared and equal: that suspect is cleared.
    c = stepdump.open(record_run(tmp_path / "c", steps=5))
    d = stepdump.open(record_run(tmp_path / "d", steps=5, before_step=_double_grads_at(2)))
    res = stepdump.diff(c, d)
    assert res.first_step == 2 and res.differences[0].what.startswith("grads ")
    assert res.reading.startswith("params equal, grads differ at step 2 → the batch or the model's code differs "
                                  "(the RNG is equal")


def test_relative_error_is_guarded_against_zeros():
    a = torch.tensor([0.0, 1.0, 2.0, 1e-30])
    b = torch.tensor([0.5, 1.0, 2.0, 0.0])
    d = compare_tensors("params", "w", a, b)
    assert d is not None and d.n_diff == 2 and d.max_abs == 0.5
    assert d.max_rel == 1.0 and d.at == (0,) and (d.a_at, d.b_at) == (0.0, 0.5)  # not 1e-30 / tiny
    assert "A was 0" in d.describe() and "e+" not in d.describe()
    # far below the tensor's scale: measured against the scale, not against itself
    d = compare_tensors("params", "w", torch.tensor([1.0, 1e-30]), torch.tensor([1.0, 0.0]))
    assert d is not None and d.max_rel < 1e-20
    # a sign flip is at most 2; NaN in one run only is counted, not turned into a number
    d = compare_tensors("grads", "g", torch.tensor([1.0, float("nan")]), torch.tensor([-1.0, float("nan")]))
    assert d is not None and d.n_diff == 1 and d.max_rel == 2.0 and "sign flipped" in d.describe()
    d = compare_tensors("grads", "g", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 3.0]))
    assert d is not None and d.n_nonfinite == 1 and d.max_abs == float("inf") and "NaN/Inf" in d.describe()


def test_a_weight_zeroed_in_one_run_says_so(tmp_path):
    def zero(t, model, opt):
        if t == 2:
            with torch.no_grad():
                model[0].bias[3] = 0.0
    a = stepdump.open(record_run(tmp_path / "a", steps=3))
    b = stepdump.open(record_run(tmp_path / "b", steps=3, before_step=zero))
    res = stepdump.diff(a, b)
    first = res.first_tensor
    assert (res.first_step, first.kind, first.name, first.at) == (2, "params", "0.bias", (3,))
    assert first.max_rel == 1.0 and first.b_at == 0.0 and "B was 0" in first.describe()
    assert res.reading.startswith("params differ at step 2 while everything compared at step 1 was equal")


def test_gradient_log_and_lean_runs_diff_at_every_step(tmp_path):
    for mode, kw in (("log", {"gradient_log": 4}), ("lean", {"every": None, "stats_every": 1})):
        a = stepdump.open(record_run(tmp_path / f"{mode}a", steps=8, **kw))
        same = stepdump.open(record_run(tmp_path / f"{mode}s", steps=8, **kw))
        b = stepdump.open(record_run(tmp_path / f"{mode}b", steps=8, before_step=_double_grads_at(5), **kw))
        assert stepdump.diff(a, same).identical, mode
        res = stepdump.diff(a, b)
        assert res.first_step == 5 and res.first_tensor_step == 5, mode
        assert {t.kind for t in res.tensors} == {"grads"}, mode
        reasons = {t.reason for t in res.tensors}
        # the gradient log stores every step's grads; the lean run only their fingerprints
        assert reasons == ({"values"} if mode == "log" else {"fingerprint"}), mode
        assert res.coverage.tensor_checks >= 5 * len(a.names("grads")), mode


def _gpt_like_and_mlp(tmp_path):
    """Two runs with no tensor name in common (a Sequential's ``0.weight`` vs an MLP's ``fc1.weight``)."""
    a = record_run(tmp_path / "seq", steps=3)
    torch.manual_seed(0)
    model = MLP(d_in=8, d_out=4)
    b = record_run(tmp_path / "mlp", steps=3, model=model, opt=torch.optim.Adam(model.parameters(), lr=1e-2))
    return a, b


def test_runs_with_no_common_names_are_not_identical(tmp_path, cli):
    a, b = _gpt_like_and_mlp(tmp_path)
    res = stepdump.diff(stepdump.open(a), stepdump.open(b))
    assert not res.identical and not res.comparable and res.coverage.tensor_checks == 0
    assert res.summary().startswith("nothing to compare: the runs have no tensor names in common")
    out = cli("diff", a, b, ok=6).stdout
    assert "nothing to compare" in out and "identical over" not in out
    js = json.loads(cli("diff", a, b, "--json", ok=6).stdout)
    assert js["identical"] is False and js["comparable"] is False
    # --kinds naming a kind neither run recorded: nothing compared either
    assert "nothing to compare" in cli("diff", a, a, "--kinds", "activations", ok=6).stdout


def test_diff_into_a_pipe_exits_nonzero_when_nothing_compares(tmp_path):
    a, b = _gpt_like_and_mlp(tmp_path)
    exe = Path(sys.executable).with_name("stepdump")
    proc = subprocess.run(["bash", "-c", f"'{exe}' diff '{a}' '{b}' | cat; exit ${{PIPESTATUS[0]}}"],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert proc.stdout.startswith("nothing to compare: the runs have no tensor names in common")
    assert "Traceback" not in proc.stderr


def test_cli_diff_prints_cause_reading_and_coverage(tmp_path, cli):
    a, b = _sgd_run(tmp_path / "a", lr=0.1), _sgd_run(tmp_path / "b", lr=0.2)
    out = cli("diff", a.path, b.path, ok=1).stdout.splitlines()
    assert out[0] == "runs diverge at step 0, first at lr (A 0.1, B 0.2)"
    assert out[1] == "reading: lr differs at step 0 → the schedule/hyperparameters differ"
    assert any(line.startswith("compared: ") for line in out)
    js = json.loads(cli("diff", a.path, b.path, "--json", ok=1).stdout)
    assert js["differences"][0] == {"step": 0, "stage": "hyperparameters", "what": "lr", "a": 0.1, "b": 0.2,
                                    "description": "lr: A 0.1, B 0.2"}
    assert js["first_tensor_step"] == 1 and js["coverage"]["tensor_checks"] > 0
