"""Every step of a gradient log (docs/gradient-log.md) keeps its RNG state and module buffers,
so ``state_dict`` and ``restore`` work at every step, BatchNorm and dropout included; and
``stepdump verify`` re-applies every segment's updates, so a gradient replaced together with
its checksum and fingerprint (every blob check passes) is still found.

Runs recorded with ``Recorder(..., gradient_log=K)``; the oracle is the training itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers import assert_same, assert_same_tree, catalog_sql, delete_tensor_rows, record_run, set_tensor_row, tensor_row, tiny_batch

import stepdump
from stepdump.analysis.verify import verify

K = 4
STEPS = 13


def _train_on(model: torch.nn.Module, opt: Any, sched: Any, steps: range) -> None:
    """``record_run``'s iteration, without a recorder."""
    for t in steps:
        x, y = tiny_batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _dropout_objects(seed: int) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def test_restore_with_rng_at_a_non_keyframe_step_then_training_on_with_dropout_is_bitwise_the_original(
        tmp_path: Path) -> None:
    model, opt, sched = _dropout_objects(0)
    record_run(tmp_path / "run", steps=STEPS, model=model, opt=opt, scheduler=sched, gradient_log=K)
    at = K + 2  # not a keyframe: params rebuilt, RNG state as recorded at that step
    with stepdump.open(tmp_path / "run") as run:
        assert run._gradlog is not None and run._gradlog.rebuilds(at, None)
        assert "rng" in run.step_state(at)
        fresh, fresh_opt, fresh_sched = _dropout_objects(7)  # another seed: nothing matches by accident
        torch.manual_seed(123)  # and another RNG state: only the restored one gives the same dropout masks
        run.restore(at, fresh, fresh_opt, fresh_sched)  # rng restored by default
        _train_on(fresh, fresh_opt, fresh_sched, range(at, STEPS))
        assert_same_tree(dict(fresh.state_dict()), dict(model.state_dict()), "params after training on")
        assert_same_tree(fresh_opt.state_dict(), opt.state_dict(), "optimizer after training on")
        # The RNG is what made it equal: without it the dropout masks, and so the params, differ.
        other, other_opt, other_sched = _dropout_objects(7)
        torch.manual_seed(123)
        run.restore(at, other, other_opt, other_sched, rng=False)
        _train_on(other, other_opt, other_sched, range(at, STEPS))
        assert not torch.equal(other[0].weight, model[0].weight)


def test_a_model_with_batchnorm_reads_its_state_dict_bitwise_at_every_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def copy() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    starts = [copy()]  # model.state_dict() at the start of each iteration (buffers before its forward)
    record_run(tmp_path / "run", steps=STEPS, model=model, opt=opt, gradient_log=K,
               after_step=lambda t, m, o: starts.append(copy()))
    with stepdump.open(tmp_path / "run") as run:
        assert run._gradlog is not None
        assert [s for s in range(STEPS) if run._gradlog.rebuilds(s, None)] == [s for s in range(STEPS) if s % K]
        for s in range(STEPS):
            got = run.state_dict(s)
            assert list(got) == list(starts[s]), s
            for key, want in starts[s].items():
                assert_same(got[key], want, f"step {s} {key}")
            assert_same(run.tensor("1.running_var", s, "buffers"), starts[s]["1.running_var"], f"buffer {s}")
        # The running stats do change every step: a buffer read from the wrong step would show.
        assert not torch.equal(starts[1]["1.running_mean"], starts[2]["1.running_mean"])


def test_verify_re_applies_every_segment_of_a_gradient_log(tmp_path: Path) -> None:
    record_run(tmp_path / "run", steps=STEPS, gradient_log=K)
    with stepdump.open(tmp_path / "run") as run:
        report = verify(run)
    assert report.ok, report.problems
    assert report.segments_checked == len(range(0, STEPS, K)) + 1  # keyframes 0, 4, 8, 12 and the final record STEPS


def test_verify_reports_a_tampered_gradient_whose_blob_checks_pass(tmp_path: Path) -> None:
    path = record_run(tmp_path / "run", steps=STEPS, gradient_log=K)
    # Step 5's grad now names step 6's blob and fingerprint: every blob is intact and matches its row.
    set_tensor_row(path, 5, "grads", "0.weight", *tensor_row(path, 6, "grads", "0.weight"))
    with stepdump.open(path) as run:
        report = verify(run)
    assert not report.ok
    assert [p.where for p in report.problems] == ["gradient log, step 6"]  # the first record update 5 made
    assert "'0.weight'" in report.problems[0].detail and "fingerprint" in report.problems[0].detail
    assert report.segments_checked == len(range(0, STEPS, K))  # the other segments reproduce (final record included)


def test_a_step_without_optimizer_fingerprints_is_verified_by_the_next_step_that_has_them(tmp_path: Path) -> None:
    snaps: list[dict[str, torch.Tensor]] = []
    path = record_run(tmp_path / "run", steps=STEPS, gradient_log=K,
                      before_step=lambda t, m, o: snaps.append(
                          {f"{n}.{k}": v.clone() for n, p in m.named_parameters() for k, v in o.state[p].items()}))
    # A stats-only step may record the params' fingerprints but not the optimizer's (lean capture).
    assert delete_tensor_rows(path, "step IN (5, 6) AND series IN (SELECT id FROM series WHERE kind = 'optimizer')")
    with stepdump.open(path) as run:
        engine = run._gradlog
        assert engine is not None
        run.state_dict(5)  # params: checked at step 5 itself
        assert engine.updates_applied == 1
        got = run.tensors(5, "optimizer")  # optimizer state: runs on to step 7, which has it
        assert engine.updates_applied == 3
        assert sorted(got) == sorted(snaps[5])
        for name, want in snaps[5].items():
            assert_same(got[name], want, f"step 5 {name}")
