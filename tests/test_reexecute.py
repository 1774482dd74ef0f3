"""Re-execution of recorded steps (issue 24, docs/reexecute.md), on real loops, bitwise.

A nanoGPT-style loop (dropout, AdamW, accumulation 2, clipping, hand-set lr) is recorded in each
mode; every step re-executes as *reproduces*; one flipped bit in one recorded grad is *differs
from the record* at that step and tensor only; an op fed from an OS-seeded generator is
*nondeterministic* and named; a NaN planted in one module's forward is traced to its op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reexec_loops as L
import stepdump
from helpers import assert_same
from stepdump.errors import BatchMismatchError, StepNotFoundError
from stepdump.reexec.engine import batch_fingerprints, check_batch, recorded, recorded_inputs, stored_batch

STEPS = 5


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reexec")
    return {mode: L.record_gpt(root / mode, mode, steps=STEPS) for mode in ("full", "lean", "keyframe", "gradlog")}


# -- item 1: the batch is always identified -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "lean", "keyframe", "gradlog", "every2"])
def test_batch_fingerprinted_at_every_step_stored_where_replay_needs_it(tmp_path: Path, mode: str) -> None:
    run = stepdump.open(L.record_gpt(tmp_path / mode, mode, steps=4))
    batches = L.token_batches(4)
    for t in range(4):
        assert recorded_inputs(run, t) == batch_fingerprints(batches[t], calls=2), f"step {t}"
        stores_all = mode in ("full", "keyframe", "gradlog")
        if stores_all or (mode == "every2" and t % 2 == 0):
            got = stored_batch(run, t, run.step_state(t))
            assert len(got) == 2
            for (x, y), (gx, gy) in zip(batches[t], got):
                assert_same(gx, x, f"step {t} x")
                assert_same(gy, y, f"step {t} y")
        else:
            with pytest.raises(stepdump.ConfigError, match="only the fingerprint"):
                stored_batch(run, t, run.step_state(t) if run.catalog.has_state(t) else {})
    check_batch(run, 2, batches[2])
    with pytest.raises(BatchMismatchError, match="this is not the batch of step 2"):
        check_batch(run, 2, batches[3])
    with pytest.raises(BatchMismatchError, match="list of 2 batches"):
        check_batch(run, 2, batches[2][0][0])


# -- item 2: verdicts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "keyframe", "gradlog"])
def test_every_step_reproduces(gpt_runs: dict[str, Path], mode: str) -> None:
    run = stepdump.open(gpt_runs[mode])
    for t in range(STEPS):
        model, opt, train_step = L.gpt_factory()
        r = stepdump.reexecute(run, t, model, opt, train_step, repeat=2)
        assert r.verdict == "reproduces", r.summary()
        # Everything the record holds was compared: the loss, every grad, every param after the update
        # (and the optimizer state after it where that step holds it: not at a keyframe run's stats steps).
        assert r.compared == len(recorded(run, t, "loss")) >= 1 + 2 * len(dict(model.named_parameters())), r
        assert not r.notes, r.notes


def test_lean_run_step_zero_from_fresh_objects_and_given_batch(gpt_runs: dict[str, Path]) -> None:
    run = stepdump.open(gpt_runs["lean"])
    batches = L.token_batches(STEPS)
    model, opt, train_step = L.gpt_factory()
    r = stepdump.reexecute(run, 0, model, opt, train_step, batch=batches[0])
    assert r.verdict == "reproduces", r.summary()
    assert "already hold" in r.how
    model, opt, train_step = L.gpt_factory()
    with pytest.raises(StepNotFoundError, match="cannot be rebuilt"):
        stepdump.reexecute(run, 2, model, opt, train_step, batch=batches[2])
    model, opt, train_step = L.gpt_factory()
    with pytest.raises(BatchMismatchError):
        stepdump.reexecute(run, 0, model, opt, train_step, batch=batches[1])


FLIP_AT = 2


@pytest.mark.parametrize("mode", ["full", "gradlog"])
def test_flipped_bit_in_one_recorded_grad_is_named_there_and_nowhere_else(tmp_path: Path, mode: str) -> None:
    run = stepdump.open(L.record_gpt(tmp_path / mode, mode, steps=STEPS, flip_at=FLIP_AT))
    for t in range(STEPS):
        model, opt, train_step = L.gpt_factory()
        r = stepdump.reexecute(run, t, model, opt, train_step, repeat=2)
        if t != FLIP_AT:
            assert r.verdict == "reproduces", r.summary()
            continue
        assert r.verdict == "differs from the record", r.summary()
        assert r.first == ("grads", L.FLIPPED)
        assert r.cause == "suspected corruption at record time"
        # The update applied the flipped grad: only that tensor's param and AdamW state may follow
        # (where the one-ulp change survives Adam's rounding; here it does not, on every host alike).
        assert {n for _, n in r.differing} <= {L.FLIPPED, f"{L.FLIPPED}.exp_avg", f"{L.FLIPPED}.exp_avg_sq"}
        assert "suspected silent data corruption" in r.summary()


def test_other_host_is_named_instead_of_corruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = stepdump.open(L.record_gpt(tmp_path / "r", "full", steps=3, flip_at=1))
    monkeypatch.setitem(run.meta, "cpu_capability", "AVX512_SOMEWHERE_ELSE")
    model, opt, train_step = L.gpt_factory()
    r = stepdump.reexecute(run, 1, model, opt, train_step)
    assert (r.verdict, r.cause) == ("differs from the record", "environment")
    assert r.environment == [f"CPU capability AVX512_SOMEWHERE_ELSE when recorded, "
                             f"{torch.backends.cpu.get_cpu_capability()} here"]


def test_unseeded_generator_is_nondeterministic_and_its_op_named(tmp_path: Path) -> None:
    run = stepdump.open(L.record_gpt(tmp_path / "noisy", "full", steps=2, noisy=True))
    model, opt, train_step = L.gpt_factory(noisy=True)
    r = stepdump.reexecute(run, 1, model, opt, train_step, repeat=2)
    assert r.verdict == "nondeterministic", r.summary()
    assert r.op is not None, r.summary()
    assert (r.op.op, r.op.module, r.op.phase) == ("aten.randn.generator", "transformer.h.0.mlp.noise", "forward")
    assert r.op.source.startswith("reexec_loops.py:")
    assert r.op_reason == "same inputs, different output"


# -- item 3: where did the NaN come from -------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "bad"), [("lean", 0), ("keyframe", 4), ("gradlog", 2)])
def test_find_nan_names_module_and_op(tmp_path: Path, mode: str, bad: int) -> None:
    run = stepdump.open(L.record_nan(tmp_path / mode, mode, bad_step=bad))
    model, opt, train_step = L.nan_factory()
    kw: dict[str, Any] = {"batch": L.nan_batch(bad, bad)} if mode == "lean" else {}
    r = stepdump.reexecute(run, bad, model, opt, train_step, find_nan=True, **kw)
    assert r.verdict == "reproduces", r.summary()  # the NaN is the loop's own, re-executed as recorded
    assert r.nan_op is not None
    assert (r.nan_op.op, r.nan_op.module, r.nan_op.phase) == ("aten.sqrt.default", "prep", "forward")
    assert r.nan_op.input_stats[0]["min"] == -0.5 and r.nan_op.input_stats[0]["nan"] == 0
    if bad:  # a step before the bad batch: no NaN anywhere
        model, opt, train_step = L.nan_factory()
        r = stepdump.reexecute(run, bad - 1, model, opt, train_step, find_nan=True)
        assert r.nan_op is None and r.verdict == "reproduces", r.summary()


# -- the CLI ----------------------------------------------------------------------------------------------
def gpt_entry() -> tuple:
    """``--entry test_reexecute:gpt_entry``."""
    return L.gpt_factory()


def nan_entry() -> dict[str, Any]:
    model, opt, train_step = L.nan_factory()
    return {"model": model, "optimizer": opt, "train_step": train_step}


@pytest.mark.parametrize(("flip", "code", "words"), [(None, 0, "step 1: reproduces"),
                                                     (1, 1, "differs from the record while re-execution is stable")])
def test_cli_reexec_prints_the_verdict_and_exits_0_or_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, flip: int | None,
                                                        code: int, words: str) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run = L.record_gpt(tmp_path / "r", "gradlog", steps=3, flip_at=flip)
    assert main(["reexecute", str(run), "--step", "1", "--entry", "test_reexecute:gpt_entry"]) == code
    out = capsys.readouterr().out
    assert words in out
    if flip is not None:
        assert f"grads '{L.FLIPPED}'" in out and "suspected silent data corruption" in out


def test_cli_reexec_find_nan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run = L.record_nan(tmp_path / "n", "keyframe", bad_step=4)
    assert main(["reexecute", str(run), "--step", "4", "--entry", "test_reexecute:nan_entry", "--find-nan",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["verdict"] == "reproduces" and got["nan_op"].startswith("aten.sqrt.default in module 'prep' at ")
    assert got["nan_inputs"][0]["min"] == -0.5


@pytest.mark.parametrize(("entry", "message"), [("nowhere", "pkg.module:factory"),
                                                ("test_reexecute:missing", "cannot load it"),
                                                ("test_reexecute:STEPS", "not a function")])
def test_cli_reexec_bad_entry_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, entry: str, message: str) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run = L.record_nan(tmp_path / "n", "full", bad_step=9, steps=2)
    assert main(["reexecute", str(run), "--step", "0", "--entry", entry]) == 5
    assert message in capsys.readouterr().err


# -- item 4: op-level localize ---------------------------------------------------------------------------
def test_op_level_localize_names_the_one_op_a_port_changed(gpt_runs: dict[str, Path]) -> None:
    from stepdump.reexec.ops import localize_ops

    run = stepdump.open(gpt_runs["gradlog"])
    reference = L.gpt_factory()
    port = L.gpt_factory()
    port[0].transformer.h[1].mlp.gelu = torch.nn.GELU(approximate="tanh")  # the port's one change
    found = localize_ops(run, 2, reference, port)
    assert found.op is not None, found.summary()
    assert (found.op.op, found.op.module, found.op.phase) == ("aten.gelu.default", "transformer.h.1.mlp.gelu",
                                                              "forward")
    assert found.reason == "same inputs, different output"
    same = localize_ops(run, 2, L.gpt_factory(), L.gpt_factory())
    assert same.op is None and same.ops_compared > 100, same.summary()
