"""restore is atomic (issue 28 item 5): every part is checked (or loaded into a copy) before
anything the caller holds changes; on failure a RestoreMismatchError names the part and the
fix, and the model, optimizer, scheduler and scaler are bitwise as they were.

Each row records a run, builds fresh objects that differ from the recorded ones in one part,
calls restore and compares every live object with a snapshot taken before the call.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, optimizer_state_clone, record_run, tiny_model
from torch import nn

import stepdump


class Warmup:
    """A callable-object lr lambda: LambdaLR stores its ``__dict__`` in the state_dict."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps

    def __call__(self, t: int) -> float:
        return min(1.0, (t + 1) / self.steps)


class Shadow:
    """A torch-ema-style shadow of the params: ``state_dict`` / ``load_state_dict`` of its own."""

    def __init__(self, params: Any, decay: float = 0.9) -> None:
        self.decay = decay
        self.num_updates = 0
        self.shadow_params = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: Any) -> None:
        self.num_updates += 1
        for s, p in zip(self.shadow_params, params, strict=True):
            s.lerp_(p.detach(), 1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow_params": self.shadow_params}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if len(sd["shadow_params"]) != len(self.shadow_params):
            raise ValueError("wrong number of shadow params")
        self.decay = sd["decay"]
        self.num_updates = sd["num_updates"]
        for s, v in zip(self.shadow_params, sd["shadow_params"], strict=True):
            s.copy_(v)  # a shape mismatch fails half-way, after the first ones were written


def _record_lambda_run(path: Any) -> Any:
    """Adam with one group and a LambdaLR of one callable lambda; at step 2 a second group is added
    (unfreezing) and the scheduler gets a lambda and a base lr for it."""
    model = tiny_model()
    for p in model[2].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [Warmup()])

    def unfreeze(t: int, m: nn.Module, o: torch.optim.Optimizer) -> None:
        if t == 2:
            for p in m[2].parameters():
                p.requires_grad_(True)
            o.add_param_group({"params": list(m[2].parameters()), "lr": 5e-3})
            sched.lr_lambdas.append(Warmup(2))
            sched.base_lrs.append(5e-3)

    return record_run(path, steps=5, model=model, opt=opt, scheduler=sched, after_step=unfreeze, on_error="raise")


def _fresh_lambda(seed: int = 7) -> dict[str, Any]:
    model = tiny_model(seed)
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, [Warmup()])}


def _record_plain(path: Any, **kwargs: Any) -> Any:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return record_run(path, steps=4, model=model, opt=opt, scheduler=sched, on_error="raise", **kwargs)


def _fresh_plain(seed: int = 7, model: nn.Module | None = None, groups: int = 1) -> dict[str, Any]:
    model = model if model is not None else tiny_model(seed)
    params = list(model.parameters())
    if groups == 1:
        opt = torch.optim.Adam(params, lr=1e-2)
    else:
        opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:3]}, {"params": params[3:]}], lr=1e-2)
    return {"model": model, "optimizer": opt,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def _scheduler_load_fails(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    # The case: the recorded LambdaLR had two lambdas after add_param_group; the rebuilt one
    # has one. LambdaLR.load_state_dict raises IndexError half-way.
    return _record_lambda_run(tmp_path / "run"), 4, _fresh_lambda()


def _scaler_recorded_disabled(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    # A disabled GradScaler's state_dict is {}; an enabled one refuses to load it (RuntimeError).
    path = _record_plain(tmp_path / "run", scaler=torch.amp.GradScaler("cpu", enabled=False))
    return path, 2, {**_fresh_plain(), "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8)}


def _scaler_given_disabled(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    # An enabled scaler's state restored into a disabled one: torch's load_state_dict is a no-op.
    path = _record_plain(tmp_path / "run", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    return path, 2, {**_fresh_plain(), "scaler": torch.amp.GradScaler("cpu", enabled=False)}


def _optimizer_groups_differ(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    return _record_plain(tmp_path / "run"), 2, _fresh_plain(groups=3)


def _model_shape_differs(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    torch.manual_seed(3)
    wide = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    return _record_plain(tmp_path / "run"), 2, _fresh_plain(model=wide)


def _record_with_shadow(path: Any) -> Any:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    shadow = Shadow(model.parameters())
    return record_run(path, steps=4, model=model, opt=opt, scheduler=sched, on_error="raise",
                      after_step=lambda t, m, o: shadow.update(m.parameters()), extra_state={"shadow": shadow})


def _extra_state_shape_differs(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    fresh = _fresh_plain()
    shadow = Shadow(fresh["model"].parameters())
    shadow.shadow_params[3] = torch.zeros(7)  # the last one differs: a load fails after three were written
    return _record_with_shadow(tmp_path / "run"), 2, {**fresh, "extra_state": {"shadow": shadow}}


def _extra_state_module_differs(tmp_path: Any) -> tuple[Any, int, dict[str, Any]]:
    fresh = _fresh_plain()
    wrong = nn.Linear(8, 5)
    return _record_with_ema(tmp_path / "run"), 2, {**fresh, "extra_state": {"ema": wrong}}


def _record_with_ema(path: Any) -> Any:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return record_run(path, steps=4, model=model, opt=opt, scheduler=sched, on_error="raise",
                      after_step=lambda t, m, o: ema.update_parameters(m), extra_state={"ema": ema})


# (case, the part the error must name)
CASES = [
    (_scheduler_load_fails, "scheduler"),
    (_scaler_recorded_disabled, "GradScaler"),
    (_scaler_given_disabled, "GradScaler"),
    (_optimizer_groups_differ, "param groups"),
    (_model_shape_differs, "architecture"),
    (_extra_state_shape_differs, "'shadow'"),
    (_extra_state_module_differs, "'ema'"),
]


def _state_of(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return {k: v.detach().clone() for k, v in obj.state_dict().items()}
    if isinstance(obj, torch.optim.Optimizer):
        return optimizer_state_clone(obj)
    if isinstance(obj, Shadow):
        return {"decay": obj.decay, "num_updates": obj.num_updates,
                "shadow_params": [p.clone() for p in obj.shadow_params]}
    return copy.deepcopy(obj.state_dict())


def _snapshot(objs: dict[str, Any]) -> dict[str, Any]:
    snap = {k: _state_of(v) for k, v in objs.items() if k != "extra_state"}
    snap["extra_state"] = {k: _state_of(v) for k, v in objs.get("extra_state", {}).items()}
    snap["params"] = [p.detach().clone() for p in objs["model"].parameters()]
    snap["rng"] = torch.get_rng_state()
    return snap


@pytest.mark.parametrize("case,part", CASES, ids=[c.__name__.strip("_") for c, _ in CASES])
def test_a_failing_part_changes_nothing(tmp_path, case, part):
    path, step, objs = case(tmp_path)
    run = stepdump.open(path)
    before = _snapshot(objs)
    with pytest.raises(stepdump.RestoreMismatchError) as err:
        run.restore(step, **objs)
    assert part in str(err.value), f"the error does not name the {part}: {err.value}"
    after = _snapshot(objs)
    assert len(after["params"]) == len(before["params"])
    for a, b in zip(after["params"], before["params"], strict=True):
        assert_same(a, b, "a model parameter")
    assert_same_tree(after, before, "live objects after the failed restore")
    assert len(objs["optimizer"].param_groups) == len(before["optimizer"]["param_groups"])


def test_restore_succeeds_once_the_part_is_fixed(tmp_path):
    """The same run restores (no error) into objects built as recorded: the scheduler with two
    lambdas after the group was added (the checks do not refuse a good restore)."""
    path = _record_lambda_run(tmp_path / "run")
    objs = _fresh_lambda()
    objs["scheduler"].lr_lambdas.append(Warmup(2))
    objs["scheduler"].base_lrs.append(5e-3)
    run = stepdump.open(path)
    run.restore(4, **objs)
    assert len(objs["optimizer"].param_groups) == 2
    assert objs["scheduler"].state_dict()["lr_lambdas"] == [{"steps": 3}, {"steps": 2}]
    for name, value in run.state_dict(4).items():
        assert_same(objs["model"].state_dict()[name], value, name)
