"""Optimizers wrapped by other libraries or by the loop, given to a plain Recorder (issue 37).

Each test trains a loop shape nobody here wrote (accelerate's prepared optimizer, a SAM-style
two-step optimizer, transformers' Adafactor, a Lookahead-style wrapper) and checks that the run is
the training, bit for bit, or that what cannot be recorded is said, and that a Recorder that
cannot be built leaves nothing behind (lock, threads, files).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_run_matches, assert_same, snapshot, tiny_batch, tiny_model
from torch import nn
from wrapper_shapes import SAM, Lookahead, SGDWithShadow

import stepdump
from stepdump.errors import ConfigError


def _stepdump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stepdump")]


# -- accelerate's prepared optimizer -------------------------------------------------------


def _accelerate_loop(path: Path | None, steps: int = 4, accumulate: int = 2) -> tuple[nn.Module, Any, list[Any]]:
    """accelerate's gradient accumulation: the prepared optimizer's step() runs every micro-batch and
    steps the inner AdamW every ``accumulate``; ``snaps``: the state before each real update."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, inner, sched)
    snaps: list[Any] = []
    rec = stepdump.Recorder(path, model, opt, sched) if path is not None else None
    for t in range(steps * accumulate):
        with acc.accumulate(model):
            x, y = tiny_batch(t)
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                snaps.append(snapshot(model, inner))
            opt.step()
            sched.step()
            opt.zero_grad()
        if rec is not None:
            rec.log(loss=loss)
    if rec is not None:
        rec.close()
    return model, inner, snaps


def test_accelerate_prepared_optimizer_is_recorded(tmp_path: Path) -> None:
    model, inner, snaps = _accelerate_loop(tmp_path / "r")
    plain, _, _ = _accelerate_loop(None)
    for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_same(a, b, f"training changed by recording: {n}")
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [0, 1, 2, 3, 4], "one record per update of the inner AdamW, and the final record"
    assert run.meta["optimizer_class"] == "AdamW"
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)
    assert_run_matches(run, 4, snapshot(model, inner), kinds=("params", "optimizer"))
    assert run.step_state(4)["scheduler"]["last_epoch"] == 4


def test_accelerate_restore_into_prepared_objects(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    _, _, snaps = _accelerate_loop(tmp_path / "r")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = tiny_model(seed=5)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = Accelerator(cpu=True).prepare(model, inner)
    stepdump.open(tmp_path / "r").restore(2, model, opt, rng=False)
    assert_run_matches(stepdump.open(tmp_path / "r"), 2, snapshot(model, inner) | {"grads": snaps[2]["grads"]})


class _HooklessWrapper(torch.optim.Optimizer):
    """A wrapper that skips ``Optimizer.__init__`` (as timm's Lookahead did before it added the hook
    dicts by hand): it has no step hooks for a Recorder to attach to."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.base.step(closure)


def test_failed_construction_releases_everything(tmp_path: Path) -> None:
    """A Recorder that fails while being built (here: attaching to an optimizer with no step hooks)
    raises a stepdump error, stops its threads, releases the run and leaves the directory as it was."""
    model = tiny_model()
    wrapped = _HooklessWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    before = set(_stepdump_threads())
    with pytest.raises(ConfigError, match="step hooks"):
        stepdump.Recorder(tmp_path / "r", model, wrapped)
    left = [t for t in _stepdump_threads() if t not in before and t.is_alive()]
    assert left == [], f"threads still running: {left}"
    # The same directory takes a Recorder again, as if nothing had been tried.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "r", model, opt) as rec:
        x, y = tiny_batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        rec.log(loss=1.0)
    assert stepdump.open(tmp_path / "r").steps == [0, 1]


# -- a SAM-style two-step optimizer --------------------------------------------------------


def _sam_loop(path: Path, give: str = "sam", steps: int = 5, salt: float = 0.0) -> tuple[list[float], list[Any]]:
    """davda54/sam's README loop; ``give``: which optimizer the Recorder gets (``"sam"`` or
    ``"base"``). Returns the losses logged and, per step, the state right before the base update."""
    model = tiny_model()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    losses: list[float] = []
    snaps: list[Any] = []
    with stepdump.Recorder(path, model, opt if give == "sam" else opt.base_optimizer) as rec:
        for t in range(steps):
            x, y = tiny_batch(t)
            loss = nn.functional.mse_loss(model(x), y) + salt
            loss.backward()
            opt.first_step(zero_grad=True)
            nn.functional.mse_loss(model(x), y).backward()
            snap = snapshot(model, opt.base_optimizer)  # the params are w + e(w) now; the update starts from w
            snap["params"] = {n: opt.state[p]["old_p"].clone() for n, p in model.named_parameters()}
            snaps.append(snap)
            opt.second_step(zero_grad=True)
            rec.log(loss=loss)
            losses.append(float(loss))
    return losses, snaps


def test_sam_run_says_it_holds_no_step(tmp_path: Path, caplog: Any) -> None:
    """Given SAM, whose step() the loop never calls: nothing can be recorded; the warning names
    the optimizer that did step, every logged loss is kept, check says the run holds no step,
    and a diff of two such runs blames nothing it cannot see."""
    from stepdump.cli.main import main

    with caplog.at_level("WARNING"):
        losses, _ = _sam_loop(tmp_path / "a")
    warned = [r.getMessage() for r in caplog.records if "no step of the optimizer given" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "SAM.base_optimizer" in warned[0] and "SGD" in warned[0], warned[0]
    run = stepdump.open(tmp_path / "a")
    assert run.steps == []
    assert list(run.scalars()["loss"]) == losses, "every logged loss is kept, one row per iteration"
    found = [f for f in stepdump.check(run) if "holds no step" in f.message]
    assert len(found) == 1 and "SAM" in found[0].message, [f.message for f in stepdump.check(run)]
    assert main(["check", str(tmp_path / "a")]) != 0
    _sam_loop(tmp_path / "b", salt=1.0)
    res = stepdump.diff(stepdump.open(tmp_path / "a"), stepdump.open(tmp_path / "b"))
    assert "batch or the RNG" not in res.reading, res.reading
    assert "no step" in res.reading, res.reading


def test_sam_base_optimizer_given_is_recorded(tmp_path: Path) -> None:
    """What the warning advises: the Recorder given SAM.base_optimizer records each update at w with
    SAM's gradients (those taken at w + e(w)) and the base optimizer's momentum."""
    _, snaps = _sam_loop(tmp_path / "r", give="base")
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [0, 1, 2, 3, 4, 5]
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)


# -- classes named by module and qualified name: transformers' Adafactor -------------------


def _adafactor_run(path: Path, steps: int = 6, **options: Any) -> tuple[nn.Module, Any]:
    from transformers.optimization import Adafactor

    model = tiny_model()
    opt = Adafactor(model.parameters(), lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False)
    with stepdump.Recorder(path, model, opt, **options):
        for t in range(steps):
            x, y = tiny_batch(t)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def test_transformers_adafactor_gradient_log_is_not_rebuilt_with_torchs(tmp_path: Path, caplog: Any) -> None:
    """torch.optim has an Adafactor too: a gradient log of transformers' must not be re-applied with
    torch's (it was, by bare name: KeyError 'd'). The recording says at once that it cannot be
    rebuilt, and a read between keyframes is refused naming the class by module."""
    from stepdump.errors import RebuildError

    with caplog.at_level("WARNING"):
        _adafactor_run(tmp_path / "r", gradient_log=4)
    run = stepdump.open(tmp_path / "r")
    assert run.meta["classes"]["optimizer"] == "transformers.optimization:Adafactor"
    warned = [r.getMessage() for r in caplog.records if "transformers.optimization.Adafactor" in r.getMessage()]
    assert len(warned) == 1 and "gradient_log" in warned[0], warned
    with pytest.raises(RebuildError, match=r"transformers\.optimization\.Adafactor.*not a torch\.optim class"):
        run.tensor("0.weight", 2)
    assert run.tensor("0.weight", 4).shape == (16, 8)  # a keyframe reads as recorded


def test_restore_checks_the_class_by_module(tmp_path: Path) -> None:
    """A run of transformers' Adafactor restores into transformers' Adafactor, bitwise, and is
    refused for torch.optim.Adafactor (same bare name), naming both classes."""
    from transformers.optimization import Adafactor

    from stepdump.errors import RestoreMismatchError

    model, opt = _adafactor_run(tmp_path / "r", steps=3)
    run = stepdump.open(tmp_path / "r")
    fresh = tiny_model(seed=3)
    with pytest.raises(RestoreMismatchError, match=r"transformers\.optimization\.Adafactor.*torch\.optim"):
        run.restore(3, fresh, torch.optim.Adafactor(fresh.parameters(), lr=1e-2), rng=False)
    again = Adafactor(fresh.parameters(), lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False)
    run.restore(3, fresh, again, rng=False)
    assert_run_matches(run, 3, snapshot(fresh, again), kinds=("params", "optimizer"))
    assert_run_matches(run, 3, snapshot(model, opt), kinds=("params", "optimizer"))


def test_runs_that_name_classes_bare_still_read_and_restore(tmp_path: Path) -> None:
    """A run recorded before classes were named by module (meta without ``classes``): its gradient
    log is rebuilt with the torch.optim class of that name, and restore checks the bare name."""
    from helpers import catalog_sql

    from stepdump.errors import RestoreMismatchError

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snaps = []
    with stepdump.Recorder(tmp_path / "r", model, opt, gradient_log=4):
        for t in range(5):
            x, y = tiny_batch(t)
            nn.functional.mse_loss(model(x), y).backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            opt.zero_grad()
    assert catalog_sql(tmp_path / "r", "DELETE FROM meta WHERE key = 'classes' RETURNING key") == [("classes",)]
    run = stepdump.open(tmp_path / "r")
    assert "classes" not in run.meta
    assert_run_matches(run, 2, snaps[2])
    fresh = tiny_model(seed=3)
    with pytest.raises(RestoreMismatchError, match="AdamW"):
        run.restore(2, fresh, torch.optim.AdamW(fresh.parameters()), rng=False)
    run.restore(2, fresh, torch.optim.Adam(fresh.parameters()), rng=False)


# -- a wrapper whose state is not in its own .state: timm's Lookahead ----------------------


def _lookahead(model: nn.Module) -> Lookahead:
    return Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2), k=2)


def _lookahead_train(model: nn.Module, opt: Lookahead, steps: range, rec: Any = None,
                     snaps: list[Any] | None = None) -> None:
    for t in steps:  # zero_grad after the step: Lookahead.step is unhooked until torch patches it
        x, y = tiny_batch(t)
        nn.functional.mse_loss(model(x), y).backward()
        if snaps is not None:
            snaps.append(snapshot(model, opt._base_optimizer))
        opt.step()
        opt.zero_grad()
        if rec is not None:
            rec.log(t=t)


def test_lookahead_state_from_state_dict_is_recorded_and_restored(tmp_path: Path, caplog: Any) -> None:
    """The optimizer state is what ``state_dict()`` holds: the base Adam's moments and the slow
    weights, recorded at every step; restore + continue is bitwise the original run."""
    model = tiny_model()
    opt = _lookahead(model)
    snaps: list[Any] = []
    with caplog.at_level("WARNING"), stepdump.Recorder(tmp_path / "r", model, opt) as rec:
        _lookahead_train(model, opt, range(6), rec, snaps)
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]
    plain = tiny_model()
    plain_opt = _lookahead(plain)
    _lookahead_train(plain, plain_opt, range(6))
    for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_same(a, b, f"training changed by recording: {n}")
    run = stepdump.open(tmp_path / "r")
    assert run.steps == list(range(7))
    assert "0.weight.lookahead_slow_buff" in run.names("optimizer")
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)
    fresh = tiny_model(seed=4)
    again = _lookahead(fresh)
    run.restore(3, fresh, again, rng=False)
    _lookahead_train(fresh, again, range(3, 6))
    for (n, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert_same(a, b, f"restore(3) + continue: {n}")


def test_state_dict_entries_the_record_misses_are_said_at_once(tmp_path: Path, caplog: Any) -> None:
    """State that ``state_dict()`` holds and the record does not take is named at the first step,
    once, not found at restore time."""
    model = tiny_model()
    opt = SGDWithShadow(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING"), stepdump.Recorder(tmp_path / "r", model, opt) as rec:
        for t in range(3):
            x, y = tiny_batch(t)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            rec.log(t=t)
    warned = [r.getMessage() for r in caplog.records if "does not record" in r.getMessage()]
    assert len(warned) == 1 and "'shadow'" in warned[0] and "SGDWithShadow" in warned[0], warned


# -- gradient logs that can never be rebuilt: said when recording starts, or at the first step --


def test_schedulefree_gradient_log_is_said_at_start(tmp_path: Path, caplog: Any) -> None:
    """schedulefree's AdamW (the real package) under gradient_log: one warning when recording starts
    that only the keyframes will be readable, with what to use instead; a step between keyframes is
    refused, not returned."""
    import schedulefree

    from stepdump.errors import RebuildError

    model = tiny_model()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=2)
    opt.train()
    with caplog.at_level("WARNING"), stepdump.Recorder(tmp_path / "r", model, opt, gradient_log=4) as rec:
        assert [r.getMessage() for r in caplog.records if "keyframes" in r.getMessage()], "not said at start"
        for t in range(5):
            x, y = tiny_batch(t)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            rec.log(t=t)
    warned = [r.getMessage() for r in caplog.records if "keyframes" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "schedulefree.adamw_schedulefree.AdamWScheduleFree" in warned[0] and "keyframe_every" in warned[0]
    with pytest.raises(RebuildError, match="not a torch.optim class"):
        stepdump.open(tmp_path / "r").tensor("0.weight", 2)


def test_optimizer_state_gaining_a_key_outside_step_is_said(tmp_path: Path, caplog: Any) -> None:
    """Adam given to a gradient-log Recorder while a Lookahead around it writes the slow weights into
    Adam's state outside Adam.step(): the first step that shows it names the key, once."""
    model = tiny_model()
    opt = _lookahead(model)
    with caplog.at_level("WARNING"), \
            stepdump.Recorder(tmp_path / "r", model, opt._base_optimizer, gradient_log=4) as rec:
        _lookahead_train(model, opt, range(5), rec)
    warned = [r.getMessage() for r in caplog.records if "outside" in r.getMessage() and "step()" in r.getMessage()
              and "lookahead_slow_buff" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "step 2" in warned[0], warned[0]
