"""The read side of the gradient log (docs/gradient-log.md): params and optimizer state at
every step, rebuilt from keyframes by re-applying the recorded updates, and verified.

The oracle is the truth of the training itself: snapshots of the live tensors taken at the
moment each record is taken, and a run recorded in full. A full run becomes a gradient log
here the way the capture side writes one (``as_gradient_log``): the params and optimizer
values of non-keyframe steps dropped (stats and fingerprints kept; grads, module buffers and
the state with its RNG kept, as at every step of a gradient log), the step marked stats-only
and the meta saying ``gradient_log``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fidelity_cases import (
    Setup,
    optimizer_case,
    optimizer_classes,
    optimizer_variants,
    scheduler_cases,
)
from fidelity_shapes import ADD_AT, shape_cases
from helpers import (
    assert_same,
    assert_same_tree,
    catalog_sql,
    record_run,
    set_tensor_row,
    snapshot,
    tensor_row,
    tiny_batch,
    tiny_model,
)

import stepdump
from stepdump.errors import RebuildError
from stepdump.read.gradlog import GradientLog

K = 4
STEPS = 13


def as_gradient_log(src: Path, dst: Path, every: int) -> Path:
    """A copy of the full run ``src`` laid out as a gradient log with keyframes every ``every`` steps."""
    shutil.copytree(src, dst)
    steps = [s for (s,) in catalog_sql(dst, "SELECT step FROM steps WHERE level = 2")]
    for s in steps:
        if s % every == 0:
            continue
        catalog_sql(dst, "UPDATE tensors SET blob = NULL WHERE step = ? AND series IN "
                         "(SELECT id FROM series WHERE kind IN ('params', 'optimizer'))", (s,))
        catalog_sql(dst, "UPDATE steps SET level = 1 WHERE step = ?", (s,))
    catalog_sql(dst, "INSERT OR REPLACE INTO meta(key, value) VALUES ('gradient_log', ?)", (json.dumps(every),))
    return dst


def _train_on(model: torch.nn.Module, opt: Any, sched: Any, start: int) -> None:
    """The iterations ``start`` .. STEPS-1 of the recorded training, without a Recorder."""
    for t in range(start, STEPS):
        x, y = tiny_batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _objects(seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    """The tiny model with Adam and a StepLR, as ``record_run`` builds them by default."""
    model = tiny_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def _train(path: Path, **kw: Any) -> tuple[list[dict[str, dict[str, torch.Tensor]]], Any]:
    """A full run of ``_objects()``: the live snapshot of each record, and the objects at the end."""
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    model, opt, sched = _objects()
    record_run(path, steps=STEPS, model=model, opt=opt, scheduler=sched,
               before_step=lambda t, m, o: snaps.append(snapshot(m, o)), **kw)
    return snaps, (model, opt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Any], Any]:
    base = tmp_path_factory.mktemp("gradlog")
    snaps, end = _train(base / "full")
    return base / "full", as_gradient_log(base / "full", base / "log", K), snaps, end


def test_rebuilt_params_and_optimizer_state_equal_the_live_tensors_at_every_step(runs: Any) -> None:
    full_path, log_path, snaps, _ = runs
    with stepdump.open(log_path) as run, stepdump.open(full_path) as full:
        assert run.steps == full.steps == list(range(STEPS + 1))  # every step reads in full; STEPS: the final record
        for s in range(STEPS):
            for kind in ("params", "optimizer", "grads"):
                got, want = run.tensors(s, kind), snaps[s][kind]
                assert sorted(got) == sorted(want), (s, kind)
                for name, t in want.items():
                    assert torch.equal(got[name], t), (s, kind, name)
                    assert_same(run.tensor(name, s, kind), t, f"step {s} {kind} {name}")
            assert run.stored_names(s, "params") == full.stored_names(s, "params")
            assert_same_tree(dict(run.state_dict(s)), dict(full.state_dict(s)), f"state_dict {s}")
            assert_same_tree(run.optimizer_state_dict(s), full.optimizer_state_dict(s), f"optimizer {s}")
            assert_same_tree(run.scheduler_state_dict(s), full.scheduler_state_dict(s), f"scheduler {s}")


def test_sequential_reads_re_apply_one_update_per_step_and_a_read_at_most_k_minus_1(runs: Any) -> None:
    _, log_path, _, _ = runs
    with stepdump.open(log_path) as run:
        engine = run._gradlog
        assert engine is not None
        run.tensors(K - 1, "params")  # from keyframe 0: K-1 updates
        assert engine.updates_applied == K - 1
        run.tensor("0.weight", K - 1, "params")
        run.optimizer_state_dict(K - 1)  # the same step again: cached, nothing re-run
        assert engine.updates_applied == K - 1
        for s in range(K + 1, 2 * K):  # in order: one update each from the keyframe K
            run.tensors(s, "params")
        assert engine.updates_applied == (K - 1) + (K - 1)
        run.tensors(K, "params")  # a keyframe: read as stored
        assert engine.updates_applied == 2 * (K - 1)


def test_engine_on_a_full_run_treats_chosen_steps_as_keyframes_and_matches_stored_truth(runs: Any) -> None:
    full_path, _, snaps, _ = runs
    with stepdump.open(full_path) as run:
        engine = GradientLog(run, run._blobs, keyframe=lambda s: s % 5 == 0)
        for s in range(STEPS):
            assert engine.rebuilds(s, "params") == (s % 5 != 0)
            for kind in ("params", "optimizer"):
                got = engine.tensors(s, kind)
                assert sorted(got) == sorted(run.tensors(s, kind))
                for name, t in got.items():
                    assert_same(t, run.tensor(name, s, kind), f"step {s} {kind} {name}")
                    assert_same(t, snaps[s][kind][name], f"step {s} {kind} {name} (live)")


def test_a_tampered_gradient_makes_the_read_raise_instead_of_returning_values(runs: Any, tmp_path: Path) -> None:
    _, log_path, snaps, _ = runs
    path = tmp_path / "tampered"
    shutil.copytree(log_path, path)
    # A consistent swap (blob and its fingerprint): reading the grad itself passes its checks.
    set_tensor_row(path, 5, "grads", "0.weight", *tensor_row(path, 6, "grads", "0.weight"))
    with stepdump.open(path) as run:
        assert_same(run.tensor("0.weight", 5, "params"), snaps[5]["params"]["0.weight"])  # before the damage
        with pytest.raises(RebuildError, match=r"step 6 .*cannot be rebuilt.*differs from its recorded fingerprint") as e:
            run.tensor("0.weight", 6, "params")
        assert (e.value.step, e.value.kind) == (6, "params")
        with pytest.raises(RebuildError, match="step 7 .*step 6"):  # later steps of the segment too
            run.state_dict(7)
        with pytest.raises(RebuildError):
            run.optimizer_state_dict(7)
        assert_same(run.tensor("0.weight", 8, "params"), snaps[8]["params"]["0.weight"])  # the next keyframe


def test_a_changed_hyperparameter_makes_the_read_raise(runs: Any, tmp_path: Path) -> None:
    _, log_path, snaps, _ = runs
    path = tmp_path / "hyper"
    shutil.copytree(log_path, path)
    (text,) = catalog_sql(path, "SELECT state FROM steps WHERE step = 2")[0]
    state = json.loads(text)
    state["groups"][0]["hyper"]["lr"] *= 1.5
    catalog_sql(path, "UPDATE steps SET state = ? WHERE step = 2", (json.dumps(state),))
    with stepdump.open(path) as run:
        assert_same(run.tensor("2.bias", 2, "params"), snaps[2]["params"]["2.bias"])
        with pytest.raises(RebuildError, match="step 3 "):
            run.tensors(3, "params")


def test_a_missing_gradient_blob_is_refused(runs: Any, tmp_path: Path) -> None:
    _, log_path, _, _ = runs
    path = tmp_path / "nograd"
    shutil.copytree(log_path, path)
    _, fp = tensor_row(path, 1, "grads", "2.weight")
    set_tensor_row(path, 1, "grads", "2.weight", None, fp)
    with stepdump.open(path) as run, pytest.raises(RebuildError, match="gradient of '2.weight' at step 1 has stats"):
        run.tensor("2.weight", 2, "params")


def test_skipped_steps_are_not_re_applied(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def poison(t: int, m: torch.nn.Module, o: Any) -> None:
        if t in (2, 5):  # the GradScaler finds inf and skips update t
            m[0].weight.grad[0, 0] = float("inf")

    snaps: list[Any] = []
    record_run(tmp_path / "full", steps=9, model=model, opt=opt, scaler=scaler,
               before_step=lambda t, m, o: (poison(t, m, o), snaps.append(snapshot(m, o))))
    path = as_gradient_log(tmp_path / "full", tmp_path / "log", K)
    with stepdump.open(path) as run:
        assert run.skipped_steps == [2, 5]
        for s in range(9):
            for kind in ("params", "optimizer"):
                for name, t in snaps[s][kind].items():
                    assert_same(run.tensor(name, s, kind), t, f"step {s} {kind} {name}")
            assert run.scaler_state_dict(s) is not None


def test_a_closure_optimizer_gives_the_clear_error_and_keyframes_stay_readable(tmp_path: Path) -> None:
    model = tiny_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    with stepdump.Recorder(tmp_path / "full", model, opt) as rec:
        for t in range(6):
            x, y = tiny_batch(t)

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            rec.log(loss=opt.step(closure))
    path = as_gradient_log(tmp_path / "full", tmp_path / "log", K)
    with stepdump.open(path) as run, stepdump.open(tmp_path / "full") as full:
        assert run.steps == [0, 4]  # keyframes only: nothing else can be rebuilt
        assert_same(run.tensor("0.weight", 4, "params"), full.tensor("0.weight", 4, "params"))
        with pytest.raises(RebuildError, match="LBFGS, which re-evaluates the loss inside step"):
            run.tensor("0.weight", 1, "params")
        with pytest.raises(RebuildError, match="closure"):
            run.state_dict(5)


def test_restore_at_a_non_keyframe_step_then_training_on_is_bitwise_the_original(runs: Any) -> None:
    _, log_path, _, (end_model, end_opt) = runs
    at = K + 2
    model, opt, sched = _objects(seed=7)  # another seed: nothing matches by accident
    with stepdump.open(log_path) as run:
        run.restore(at, model, opt, sched)
    _train_on(model, opt, sched, at)
    assert_same_tree(dict(model.state_dict()), dict(end_model.state_dict()), "params after training on")
    assert_same_tree(opt.state_dict(), end_opt.state_dict(), "optimizer after training on")


def test_export_diff_and_check_work_at_rebuilt_steps(runs: Any, tmp_path: Path) -> None:
    full_path, log_path, _, _ = runs
    with stepdump.open(log_path) as run, stepdump.open(full_path) as full:
        a = torch.load(run.export(K + 1, tmp_path / "a.pt"), weights_only=True)
        b = torch.load(full.export(K + 1, tmp_path / "b.pt"), weights_only=True)
        assert_same_tree(a, b, "exported checkpoint")
        run.export(K + 1, tmp_path / "a.safetensors", format="safetensors", grads=True)
        assert stepdump.diff(run, full).identical
        assert [(f.rule, f.step) for f in stepdump.check(run)] == [(f.rule, f.step) for f in stepdump.check(full)]


def test_a_diff_between_two_gradient_logs_reads_rebuilt_values(tmp_path: Path) -> None:
    _train(tmp_path / "a")
    _train(tmp_path / "b", after_step=lambda t, m, o: o.param_groups[0].update(lr=o.param_groups[0]["lr"] * 0.5)
           if t == 4 else None)  # update 5 uses another lr: record 6 is the first whose tensors differ
    la = as_gradient_log(tmp_path / "a", tmp_path / "la", K)
    lb = as_gradient_log(tmp_path / "b", tmp_path / "lb", K)
    with stepdump.open(la) as a, stepdump.open(lb) as b:
        d = stepdump.diff(a, b)
        assert (d.first_step, d.differences[0].what) == (5, "lr")  # the cause: the lr of record 5
        assert d.first_tensor_step == 6  # params of record 6 are rebuilt in both
        params = [t for t in d.tensors if t.kind == "params"]
        assert params and all(t.reason == "values" and t.max_abs is not None and t.max_abs > 0 for t in params)


def test_a_param_changed_outside_the_optimizer_is_caught_not_rebuilt(tmp_path: Path) -> None:
    _train(tmp_path / "clean")
    _train(tmp_path / "full", after_step=lambda t, m, o: m[0].bias.data.add_(1e-3) if t == 5 else None)
    with stepdump.open(as_gradient_log(tmp_path / "full", tmp_path / "log", K)) as run, \
            stepdump.open(tmp_path / "clean") as clean:
        run.tensors(5, "params")
        with pytest.raises(RebuildError, match="'0.bias' at step 6 that differs from its recorded fingerprint"):
            run.tensors(6, "params")
        d = stepdump.diff(run, clean)  # bytes differ, values cannot be given: said so, not made up
        assert d.first_step == 6
        assert {(t.kind, t.name, t.reason) for t in d.tensors if t.kind == "params"} == {
            ("params", "0.bias", "fingerprint")}


def test_params_left_out_of_the_record_cannot_be_rebuilt(tmp_path: Path) -> None:
    snaps: list[Any] = []
    record_run(tmp_path / "full", steps=6, include="0.*",
               before_step=lambda t, m, o: snaps.append(snapshot(m, o)))
    path = as_gradient_log(tmp_path / "full", tmp_path / "log", K)
    with stepdump.open(path) as run:
        assert_same(run.tensor("0.weight", 3, "params"), snaps[3]["params"]["0.weight"])
        assert_same(run.tensor("0.bias.exp_avg", 3, "optimizer"), snaps[3]["optimizer"]["0.bias.exp_avg"])
        assert sorted(run.tensors(3, "params")) == ["0.bias", "0.weight"]
        with pytest.raises(stepdump.TensorNotFoundError):
            run.tensor("2.weight", 3, "params")
        with pytest.raises(stepdump.StepNotFoundError, match="no params '2.weight'"):
            run.state_dict(3)


# -- runs recorded with Recorder(..., gradient_log=K) -----------------------------------------


def test_a_recorded_gradient_log_reads_every_step_as_the_live_tensors(tmp_path: Path) -> None:
    snaps, _ = _train(tmp_path / "run", gradient_log=K)
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["gradient_log"] == K and run.steps == list(range(STEPS + 1))  # + the final record
        for s in range(STEPS):
            for kind in ("params", "optimizer", "grads"):
                got = run.tensors(s, kind)
                assert sorted(got) == sorted(snaps[s][kind]), (s, kind)
                for name, t in snaps[s][kind].items():
                    assert_same(got[name], t, f"step {s} {kind} {name}")
        assert run._gradlog is not None and run._gradlog.updates_applied == STEPS - 1 - STEPS // K


def test_a_recorded_gradient_log_restores_at_a_non_keyframe_and_trains_on_bitwise(tmp_path: Path) -> None:
    _, (end_model, end_opt) = _train(tmp_path / "run", gradient_log=K)
    model, opt, sched = _objects(seed=3)
    with stepdump.open(tmp_path / "run") as run:
        # The data is seeded by step and the model has no dropout: no RNG state needed.
        run.restore(K + 1, model, opt, sched, rng="rng" in run.step_state(K + 1))
    _train_on(model, opt, sched, K + 1)
    assert_same_tree(dict(model.state_dict()), dict(end_model.state_dict()), "params after training on")
    assert_same_tree(opt.state_dict(), end_opt.state_dict(), "optimizer after training on")


# -- every optimizer of the fidelity matrix -------------------------------------------------


def _optimizer_cases() -> list[Any]:
    out = []
    for name, cls in optimizer_classes().items():
        for variant, kwargs in optimizer_variants(cls):
            try:
                out.append(optimizer_case(name, cls, variant, kwargs))
            except Exception:  # noqa: BLE001, S112 - torch refuses the variant here (the matrix says why)
                continue
    return out


CASES = _optimizer_cases()
# Optimizers the gradient log cannot re-run, and the words of the error that says why.
NOT_REPLAYABLE = {"LBFGS": "closure"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_optimizer_of_the_matrix_is_rebuilt_bitwise_or_refused_clearly(case: Any, tmp_path: Path) -> None:
    setup: Setup = case.make(0)
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    steps = 7
    with stepdump.Recorder(tmp_path / "run", setup.model, setup.opt, on_error="raise") as rec:
        for t in range(steps):
            case.iterate(setup, t, lambda: snaps.append(snapshot(setup.model, setup.opt)))
            rec.log(loss=setup.loss)
    cls_name = case.id.split("-")[0]
    with stepdump.open(tmp_path / "run") as run:
        engine = GradientLog(run, run._blobs, keyframe=lambda s: s % 3 == 0)
        if cls_name in NOT_REPLAYABLE:
            with pytest.raises(RebuildError, match=NOT_REPLAYABLE[cls_name]):
                engine.tensors(1, "params")
            return
        for s in range(steps):
            for kind in ("params", "optimizer"):
                got, want = engine.tensors(s, kind), snaps[s][kind]
                assert sorted(got) == sorted(want), (case.id, s, kind)
                for name, t in want.items():
                    assert_same(got[name], t.to_dense() if t.is_sparse else t, f"{case.id} step {s} {kind} {name}")
            assert_same_tree(engine.optimizer_state_dict(s) if engine.rebuilds(s, None) else run.optimizer_state_dict(s),
                             run.optimizer_state_dict(s), f"{case.id} optimizer_state_dict {s}")


# -- the model shapes and schedulers of the matrix ---------------------------------------------

SHAPES = shape_cases()
# Shapes a gradient log cannot rebuild between keyframes, and the words of the error saying why:
# LBFGS re-evaluates the loss inside step(). (Sparse gradients are stored as they are, so the
# sparse shapes are rebuilt bitwise: tests/test_sparse_grads.py.)
SHAPE_REFUSED = {
    "closure-lbfgs-strong-wolfe": "closure",
}


@pytest.mark.parametrize("case", [*SHAPES, *scheduler_cases()], ids=lambda c: c.id)
def test_every_shape_and_scheduler_of_the_matrix_is_rebuilt_bitwise_or_refused_clearly(case: Any,
                                                                                       tmp_path: Path) -> None:
    setup: Setup = case.make(0)
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    with stepdump.Recorder(tmp_path / "run", setup.model, setup.opt, setup.sched, setup.scaler,
                           on_error="raise") as rec:
        for t in range(case.steps):
            case.iterate(setup, t, lambda: snaps.append(snapshot(setup.model, setup.opt)))
            if setup.loss is not None:
                rec.log(loss=setup.loss)
    with stepdump.open(tmp_path / "run") as run:
        # ADD_AT is a keyframe with K=3; with K=5 the groups change inside a segment.
        for every in ((3, 5) if case.id == "params-added-mid-run" else (3,)):
            engine = GradientLog(run, run._blobs, keyframe=lambda s, e=every: s % e == 0)
            for s in range(case.steps):
                if not engine.rebuilds(s, None):
                    continue
                refused = SHAPE_REFUSED.get(case.id) or ("param groups" if every == 5 and s > ADD_AT else None)
                if refused:
                    with pytest.raises(RebuildError, match=refused):
                        engine.tensors(s, "params")
                    continue
                for kind in ("params", "optimizer"):
                    got, want = engine.tensors(s, kind), snaps[s][kind]
                    assert sorted(got) == sorted(want), (case.id, s, kind)
                    for name, t in want.items():  # a sparse momentum buffer's series is dense
                        assert_same(got[name], t.to_dense() if t.is_sparse else t, f"{case.id} step {s} {kind} {name}")

