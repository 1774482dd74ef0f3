"""The fidelity matrix: every optimizer and scheduler torch ships, and the model shapes people train.

For each case (see fidelity_cases.py for how they are generated from torch):

1. recording does not change the training: params and buffers after N steps are
   bitwise those of the same run without stepdump;
2. every record equals a hand capture taken at the same moment, bitwise and with
   container types: params, grads, optimizer tensors, ``optimizer_state_dict``,
   scheduler and GradScaler ``state_dict``;
3. ``restore`` at the first, a middle and the last step into freshly built objects
   (another seed, so nothing matches by accident) continues bit-identically: params,
   buffers, every param group hyperparameter, optimizer, scheduler and scaler state.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from fidelity_cases import (
    Case,
    Setup,
    _make,
    build_scheduler,
    optimizer_case,
    optimizer_classes,
    optimizer_variants,
    plain_iteration,
    scheduler_classes,
    shape_cases,
    Small,
    Warmup,
)
from helpers import assert_same, snapshot
from torch.optim import lr_scheduler

import stepdump

# -- generating the cases -----------------------------------------------------------

EXCLUDED: dict[str, str] = {}  # case id -> torch's own reason for refusing it here


def _optimizer_cases() -> list[Case]:
    out = []
    for name, cls in optimizer_classes().items():
        for variant, kwargs in optimizer_variants(cls):
            try:
                out.append(optimizer_case(name, cls, variant, kwargs))
            except Exception as e:  # noqa: BLE001 - torch refuses this variant on this machine
                EXCLUDED[f"{name}-{variant}"] = f"{type(e).__name__}: {e}"
    return out


def _scheduler_cases() -> list[Case]:
    def case(cid: str, cls: type, overrides: dict[str, Any] | None = None) -> Case:
        def make(seed: int) -> Setup:
            setup = _make(Small, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))(seed)
            setup.sched = build_scheduler(cls, setup.opt, overrides)
            return setup

        return Case(cid, make, plain_iteration, steps=6)

    out = [case(name, cls) for name, cls in scheduler_classes().items()]
    out.append(case("LambdaLR-callable-object", lr_scheduler.LambdaLR, {"lr_lambda": Warmup(4)}))
    out.append(case("MultiplicativeLR-callable-object", lr_scheduler.MultiplicativeLR, {"lr_lambda": Warmup(4)}))
    return out


OPTIMIZER_CASES = _optimizer_cases()
SCHEDULER_CASES = _scheduler_cases()
SHAPE_CASES = shape_cases()


def test_discovery_finds_what_torch_ships():
    opts, scheds = optimizer_classes(), scheduler_classes()
    for name in ("SGD", "Adam", "AdamW", "LBFGS", "SparseAdam", "RMSprop", "Rprop", "Adagrad"):
        assert name in opts, name
    for name in ("LambdaLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau", "OneCycleLR", "CyclicLR",
                 "SWALR", "MultiStepLR"):
        assert name in scheds, name
    covered = {c.id.split("-")[0] for c in OPTIMIZER_CASES}
    assert covered == set(opts), f"optimizers with no case at all: {set(opts) - covered}; {EXCLUDED}"
    assert {c.id for c in SCHEDULER_CASES} >= set(scheds)
    # a variant is left out only when torch itself refuses it here, never stepdump
    assert all("stepdump" not in why for why in EXCLUDED.values()), EXCLUDED
    print("left out (torch refuses them on this machine):", EXCLUDED)


# -- checking one case --------------------------------------------------------------


def same_tree(a: Any, b: Any, what: str) -> None:
    """Equal values, bitwise tensors, and the same container types (a Counter stays a Counter)."""
    if isinstance(b, torch.Tensor):
        assert_same(a, b.detach().cpu() if a.device.type == "cpu" else b, what)
        return
    assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__} ({a!r} vs {b!r})"
    if isinstance(b, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{what}: keys {list(a)} != {list(b)}"
        for k in b:
            same_tree(a[k], b[k], f"{what}/{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_tree(x, y, f"{what}/{i}")
    elif isinstance(b, float) and b != b:
        assert a != a, f"{what}: {a!r} is not nan"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _side_state(setup: Setup) -> dict[str, Any]:
    return {
        "optimizer": copy.deepcopy(setup.opt.state_dict()),
        "scheduler": copy.deepcopy(setup.sched.state_dict()) if setup.sched is not None else None,
        "scaler": copy.deepcopy(setup.scaler.state_dict()) if setup.scaler is not None else None,
    }


def _final(setup: Setup) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in setup.model.state_dict().items()},
            "outside": {k: v.detach().clone() for k, v in setup.extra.items() if isinstance(v, torch.Tensor)},
            **_side_state(setup)}


def _train(case: Case, setup: Setup, steps: range, captures: list | None = None) -> None:
    for t in steps:
        def capture() -> None:
            if captures is not None:
                captures.append({"tensors": snapshot(setup.model, setup.opt), **_side_state(setup)})

        case.iterate(setup, t, capture)


def check_case(case: Case, tmp_path) -> None:
    n = case.steps
    plain = case.make(0)
    _train(case, plain, range(n))
    setup = case.make(0)
    captures: list = []
    with stepdump.Recorder(tmp_path / "run", setup.model, setup.opt, setup.sched, setup.scaler, on_error="raise"):
        _train(case, setup, range(n), captures)
    want = _final(setup)
    same_tree(want["model"], _final(plain)["model"], f"{case.id}: training changed by recording")
    same_tree(want["outside"], _final(plain)["outside"], f"{case.id}: training changed by recording")
    assert len(captures) == n
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == list(range(n)) and run.steps == list(range(n))
        for t, cap in enumerate(captures):
            for kind, tensors in cap["tensors"].items():
                got = run.tensors(t, kind)
                assert sorted(got) == sorted(tensors), f"{case.id} step {t} {kind}: {sorted(got)} != {sorted(tensors)}"
                for name, w in tensors.items():
                    assert_same(got[name], w.to_dense() if w.is_sparse else w, f"{case.id} step {t} {kind} {name}")
            got_osd = run.optimizer_state_dict(t)
            want_osd = cap["optimizer"]
            want_osd = {"state": {i: {k: v.to_dense() if isinstance(v, torch.Tensor) and v.is_sparse else v
                                      for k, v in s.items()} for i, s in want_osd["state"].items()},
                        "param_groups": want_osd["param_groups"]}
            same_tree(got_osd, want_osd, f"{case.id} step {t} optimizer_state_dict")
            if setup.sched is not None:
                same_tree(run.scheduler_state_dict(t), cap["scheduler"], f"{case.id} step {t} scheduler")
            if setup.scaler is not None:
                same_tree(run.scaler_state_dict(t), cap["scaler"], f"{case.id} step {t} scaler")
        for at in sorted({0, n // 2, n - 1}):
            fresh = case.make(1)
            run.restore(at, fresh.model, fresh.opt, fresh.sched, fresh.scaler)
            _train(case, fresh, range(at, n))
            got = _final(fresh)
            for part in ("model", "outside", "optimizer", "scheduler", "scaler"):
                same_tree(got[part], want[part], f"{case.id}: restored at {at} and continued, {part}")


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=lambda c: c.id)
def test_optimizer(case, tmp_path):
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", SCHEDULER_CASES, ids=lambda c: c.id)
def test_scheduler(case, tmp_path):
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", SHAPE_CASES, ids=lambda c: c.id)
def test_model_shape(case, tmp_path):
    check_case(case, tmp_path)
