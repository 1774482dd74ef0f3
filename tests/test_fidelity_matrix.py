"""The fidelity matrix: every optimizer and scheduler torch ships, and the model shapes people train.

Three axes, not their product (fidelity_cases.py / fidelity_shapes.py generate them):
every optimizer with each option its signature has (one tiny model); every scheduler
(SGD + momentum); the model shapes (mostly AdamW). Each case trains once without
stepdump, once recorded with a hand capture at every step, and restores three times:

1. recording does not change the training: params, buffers, optimizer, scheduler,
   scaler and RNG state after N steps are bitwise those of the run without stepdump;
2. every record equals the hand capture taken at the same moment, bitwise and with
   container types (a Counter stays a Counter, a tuple a tuple, an int an int): params,
   grads, optimizer tensors and ``optimizer_state_dict``, scheduler and GradScaler
   ``state_dict``, buffers and torch RNG at the start of the iteration, the skipped flag,
   the logged loss and the automatic ``lr`` / ``grad_scale`` scalars;
3. ``restore`` at the first, a middle and the last step into freshly built objects
   (another seed, so nothing matches by accident) hands ``load_state_dict`` exactly the
   captured state, leaves every object (RNG included) as it was at the start of that
   iteration, and training continued from there ends bit-identical.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from fidelity_cases import (
    CLOSURE,
    Case,
    Setup,
    needs_closure,
    optimizer_case,
    optimizer_classes,
    optimizer_variants,
    scheduler_cases,
    scheduler_classes,
)
from fidelity_shapes import shape_cases
from helpers import assert_same, snapshot

import stepdump

# -- generating the cases -----------------------------------------------------------

EXCLUDED: dict[str, str] = {}  # case id -> torch's own reason for refusing it here


def _optimizer_cases() -> list[Case]:
    out = []
    for name, cls in optimizer_classes().items():
        variants = optimizer_variants(cls)
        if not needs_closure(cls):  # also driven through step(closure), with its defaults
            variants.append((CLOSURE, variants[0][1]))
        for variant, kwargs in variants:
            try:
                out.append(optimizer_case(name, cls, variant, kwargs))
            except Exception as e:  # noqa: BLE001 - torch refuses this variant on this machine
                EXCLUDED[f"{name}-{variant}"] = f"{type(e).__name__}: {e}"
    return out


OPTIMIZER_CASES = _optimizer_cases()
SCHEDULER_CASES = scheduler_cases()
SHAPE_CASES = shape_cases()
if EXCLUDED:  # shown at collection (pytest -s / -rA): what torch refuses here, in its own words
    print("fidelity matrix: left out, torch refuses them on this machine:")
    for cid, why in EXCLUDED.items():
        print(f"  {cid}: {why}")


def test_discovery_finds_what_torch_ships() -> None:
    opts, scheds = optimizer_classes(), scheduler_classes()
    for name in ("SGD", "Adam", "AdamW", "LBFGS", "SparseAdam", "RMSprop", "Rprop", "Adagrad", "Adadelta",
                 "Adamax", "ASGD", "NAdam", "RAdam"):
        assert name in opts, name
    for name in ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
                 "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau", "OneCycleLR", "CyclicLR", "SWALR",
                 "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts"):
        assert name in scheds, name
    ids = {c.id for c in OPTIMIZER_CASES}
    # every optimizer is in the matrix with its defaults; torch refuses only option variants
    missing = {n for n in opts if f"{n}-default" not in ids}
    assert not missing, f"optimizers with no default case: {missing}; {EXCLUDED}"
    assert {"SGD-nesterov", "SGD-foreach", "Adam-amsgrad", "Adam-maximize", "AdamW-foreach",
            "RMSprop-centered", "Adam-decoupled_weight_decay", "LBFGS-line_search_fn"} <= ids
    assert {c.id for c in SCHEDULER_CASES} >= set(scheds) | {"LambdaLR-callable-object", "CyclicLR-callable-object"}
    assert len(ids | {c.id for c in SCHEDULER_CASES} | {c.id for c in SHAPE_CASES}) == \
        len(OPTIMIZER_CASES) + len(SCHEDULER_CASES) + len(SHAPE_CASES), "case ids must be unique"
    print(f"{len(OPTIMIZER_CASES)} optimizer, {len(SCHEDULER_CASES)} scheduler, {len(SHAPE_CASES)} shape cases; "
          f"left out because torch refuses them here: {EXCLUDED}")


# -- comparing ------------------------------------------------------------------------


def same_tree(a: Any, b: Any, what: str) -> None:
    """Equal values, bitwise tensors, and the same container types (a Counter stays a Counter)."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), f"{what}: {type(a).__name__} {a!r} is not a tensor"
        assert a.layout == b.layout, f"{what}: layout {a.layout} != {b.layout}"
        if b.layout == torch.sparse_coo:  # as it was: duplicates and their order decide the next update's rounding
            assert a.is_coalesced() == b.is_coalesced() and a.shape == b.shape, f"{what}: sparse structure"
            assert_same(a._indices(), b._indices(), f"{what} indices")
            assert_same(a._values(), b._values(), f"{what} values")
            return
        assert_same(a, b, what)
        return
    assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__} ({a!r} vs {b!r})"
    if isinstance(b, dict):
        assert set(a) == set(b), f"{what}: keys {list(a)} != {list(b)}"
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


def rng_now() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def same_rng(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    same_tree(a["torch"], b["torch"], f"{what} torch RNG")
    na, nb = a["numpy"], b["numpy"]
    assert na[0] == nb[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:], f"{what}: numpy RNG differs"
    assert a["python"] == b["python"], f"{what}: Python RNG differs"


def _model_state(setup: Setup) -> dict[str, Any]:
    return {"model": OrderedDict((k, v.detach().clone()) for k, v in setup.model.state_dict().items()),
            "outside": {k: v.detach().clone() for k, v in setup.outside.items()}}


def _side_state(setup: Setup) -> dict[str, Any]:
    return {
        "optimizer": copy.deepcopy(setup.opt.state_dict()),
        "scheduler": copy.deepcopy(setup.sched.state_dict()) if setup.sched is not None else None,
        "scaler": copy.deepcopy(setup.scaler.state_dict()) if setup.scaler is not None else None,
    }


def _final(setup: Setup) -> dict[str, Any]:
    return {**_model_state(setup), **_side_state(setup), "rng": rng_now()}


def same_final(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for part in ("model", "outside", "optimizer", "scheduler", "scaler"):
        same_tree(got[part], want[part], f"{what}, {part}")
    same_rng(got["rng"], want["rng"], what)


# -- training with a hand capture --------------------------------------------------------


def _train(case: Case, setup: Setup, steps: range, rec: Any = None, trace: list[dict[str, Any]] | None = None) -> None:
    """Run iterations ``steps``; with ``trace``, append what the record of each step must hold."""
    for t in steps:
        entry: dict[str, Any] = {}
        if trace is not None:  # the start of iteration t: buffers, outside params, RNG
            entry["start"] = {**_model_state(setup), "rng": rng_now()}
        scale = setup.scaler.get_scale() if setup.scaler is not None else None

        def capture() -> None:  # the pre-step moment: grads final, nothing updated
            if trace is not None:
                entry["tensors"] = snapshot(setup.model, setup.opt)
                entry.update(_side_state(setup))
                if "optimizer_before_step" in setup.flags:  # a closure: taken right before optimizer.step()
                    entry["optimizer"] = setup.flags.pop("optimizer_before_step")
                entry["lr"] = [float(g["lr"]) for g in setup.opt.param_groups]
                entry["grad_scale"] = scale

        setup.loss = None
        case.iterate(setup, t, capture)
        if rec is not None and setup.loss is not None:
            rec.log(loss=setup.loss)
        if trace is not None:
            assert "tensors" in entry, f"{case.id}: the iteration never reached its capture point"
            # the scaler backs off (halves its scale) exactly when it skipped the update
            entry["skipped"] = scale is not None and setup.scaler.get_scale() < scale
            entry["loss"] = setup.loss
            trace.append(entry)


def _record(case: Case, setup: Setup, path: Any) -> list[dict[str, Any]]:
    trace: list[dict[str, Any]] = []
    with stepdump.Recorder(path, setup.model, setup.opt, setup.sched, setup.scaler, on_error="raise") as rec:
        _train(case, setup, range(case.steps), rec, trace)
    return trace


def _same_scalar(got: Any, want: float, what: str) -> None:
    assert float(got) == want or (want != want and got != got), f"{what}: {got!r} != {want!r}"


def check_record(run: Any, case: Case, t: int, cap: dict[str, Any], columns: Any) -> None:
    """Record t against the hand capture of iteration t."""
    what = f"{case.id} step {t}"
    for kind, tensors in cap["tensors"].items():
        got = run.tensors(t, kind)
        assert sorted(got) == sorted(tensors), f"{what} {kind}: {sorted(got)} != {sorted(tensors)}"
        for name, w in tensors.items():
            if w.is_sparse and kind == "grads":  # stored as the optimizer saw it: indices, order, coalesced flag
                same_tree(got[name], w, f"{what} {kind} {name}")
            else:  # sparse optimizer state: its series is dense (optimizer_state_dict has it exact)
                assert_same(got[name], w.to_dense() if w.is_sparse else w, f"{what} {kind} {name}")
    same_tree(run.optimizer_state_dict(t), cap["optimizer"], f"{what} optimizer_state_dict")
    same_tree(run.scheduler_state_dict(t), cap["scheduler"], f"{what} scheduler state_dict")
    same_tree(run.scaler_state_dict(t), cap["scaler"], f"{what} scaler state_dict")
    same_tree(dict(run.state_dict(t)), dict(cap["start"]["model"]), f"{what} state_dict (params + buffers)")
    same_tree(run.rng_state(t)["torch"], cap["start"]["rng"]["torch"], f"{what} torch RNG at the iteration start")
    row = columns.loc[t]
    assert bool(row["skipped"]) == cap["skipped"], f"{what}: skipped {row['skipped']} != {cap['skipped']}"
    if cap["loss"] is not None:
        _same_scalar(row["loss"], cap["loss"], f"{what} scalar loss")
    for i, lr in enumerate(cap["lr"]):
        _same_scalar(row["lr" if i == 0 else f"lr/{i}"], lr, f"{what} scalar lr of group {i}")
    if cap["grad_scale"] is not None:
        _same_scalar(row["grad_scale"], cap["grad_scale"], f"{what} scalar grad_scale")


def restore_intercepted(run: Any, at: int, setup: Setup) -> dict[str, Any]:
    """run.restore into ``setup``; returns what it handed each object's load_state_dict
    (a deep copy: CyclicLR's pops keys from what it is given)."""
    handed: dict[str, Any] = {}
    objs = [(k, o) for k, o in (("model", setup.model), ("optimizer", setup.opt), ("scheduler", setup.sched),
                                ("scaler", setup.scaler)) if o is not None]
    for key, obj in objs:
        def load(sd: Any, *args: Any, _orig: Any = obj.load_state_dict, _key: str = key, **kw: Any) -> Any:
            handed[_key] = copy.deepcopy(sd)
            return _orig(sd, *args, **kw)

        object.__setattr__(obj, "load_state_dict", load)  # an instance attribute shadows the method
    try:
        run.restore(at, setup.model, setup.opt, setup.sched, setup.scaler)
    finally:  # gone again before anyone reads a state_dict (a scheduler's is its __dict__)
        for _, obj in objs:
            object.__delattr__(obj, "load_state_dict")
    return handed


def check_restore(run: Any, case: Case, at: int, cap: dict[str, Any], want: dict[str, Any]) -> None:
    what = f"{case.id}: restored at {at}"
    fresh = case.make(1)  # another seed: nothing matches by accident
    handed = restore_intercepted(run, at, fresh)
    same_tree(dict(handed["model"]), dict(cap["start"]["model"]), f"{what}, handed to model.load_state_dict")
    same_tree(handed["optimizer"], cap["optimizer"], f"{what}, handed to optimizer.load_state_dict")
    for part in ("scheduler", "scaler"):
        if cap[part] is not None:
            same_tree(handed.get(part), cap[part], f"{what}, handed to {part}.load_state_dict")
    # right after restore, every object is where the original was at the start of iteration `at`
    now = _final(fresh)
    same_tree(dict(now["model"]), dict(cap["start"]["model"]), f"{what}, model")
    same_tree(now["outside"], cap["start"]["outside"], f"{what}, params outside the model")
    same_tree(now["optimizer"], cap["optimizer"], f"{what}, optimizer state_dict")
    same_tree(now["scheduler"], cap["scheduler"], f"{what}, scheduler state_dict")
    same_tree(now["scaler"], cap["scaler"], f"{what}, scaler state_dict")
    same_rng(now["rng"], cap["start"]["rng"], f"{what}, RNG")
    _train(case, fresh, range(at, case.steps))
    same_final(_final(fresh), want, f"{what} and continued")


def check_case(case: Case, tmp_path: Any) -> None:
    n = case.steps
    plain = case.make(0)
    _train(case, plain, range(n))
    setup = case.make(0)
    trace = _record(case, setup, tmp_path / "run")
    want = _final(setup)
    same_final(want, _final(plain), f"{case.id}: training changed by recording")
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == list(range(n + 1)), run.all_steps  # n: the final record close() writes
        assert run.steps == list(range(n + 1)), run.steps
        assert run.skipped_steps == [t for t, c in enumerate(trace) if c["skipped"]]
        columns = run.scalars()
        for t, cap in enumerate(trace):
            check_record(run, case, t, cap, columns)
        for at in sorted({0, n // 2, n - 1}):
            check_restore(run, case, at, trace[at], want)


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=lambda c: c.id)
def test_optimizer(case: Case, tmp_path: Any) -> None:
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", SCHEDULER_CASES, ids=lambda c: c.id)
def test_scheduler(case: Case, tmp_path: Any) -> None:
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", SHAPE_CASES, ids=lambda c: c.id)
def test_model_shape(case: Case, tmp_path: Any) -> None:
    check_case(case, tmp_path)
