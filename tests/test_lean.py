"""Lean capture: stats-only steps read the live tensors on a worker thread, with no copy.

What must hold (capture/lean.py): every stats-only row describes the tensor exactly as
it was at the moment the record is of (fingerprints equal the hand capture's, bitwise),
also when user code changes a tensor in place, replaces it, or the optimizer evaluates a
closure; training is unchanged; a failure on the worker is the usual one warning.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from fidelity_cases import Case
from helpers import lean_model, snapshot
from test_fidelity_matrix import OPTIMIZER_CASES, SCHEDULER_CASES, _final, _train, same_final
from torch import nn

import stepdump
from stepdump.capture import lean, packed
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import compute_stats

LEAN = {"every": None, "stats_every": 1}


# Every test here runs both ways a lean step is read: by the worker from the forward on (a
# model over lean.INLINE_BYTES), and whole at the pre-hook on the training thread (a small one).
@pytest.fixture(autouse=True, params=["worker", "inline"])
def lean_path(request, monkeypatch) -> str:
    monkeypatch.setattr(lean, "INLINE_BYTES", 0 if request.param == "worker" else 1 << 40)
    return request.param


def _fps(snap: dict[str, dict[str, torch.Tensor]]) -> dict[tuple[str, str], int]:
    # A sparse grad is recorded as it is, sparse optimizer state dense (FORMAT.md, "Sparse tensors").
    return {(kind, name): fingerprint(t.to_dense() if t.is_sparse and kind != "grads" else t)
            for kind, tensors in snap.items() for name, t in tensors.items()}


def _recorded_fps(run: stepdump.types.Run, step: int) -> dict[tuple[str, str], int]:
    return {k: v for k, v in run.fingerprints(step).items() if k[0] in ("params", "grads", "optimizer")}


def _lean_fps(snap: dict[str, dict[str, torch.Tensor]], step: int) -> dict[tuple[str, str], int]:
    """What a lean step records: optimizer state only every OPTIMIZER_EVERY steps."""
    return {k: v for k, v in _fps(snap).items() if k[0] != "optimizer" or step % lean.OPTIMIZER_EVERY == 0}


def _lean_matrix_case(case: Case, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lean, "OPTIMIZER_EVERY", 2)  # steps 0, 2, 4 read the optimizer state too
    plain = case.make(0)
    _train(case, plain, range(case.steps))
    want = _final(plain)
    setup = case.make(0)
    trace: list[dict] = []
    with stepdump.Recorder(tmp_path / "run", setup.model, setup.opt, setup.sched, setup.scaler,
                           on_error="raise", **LEAN) as rec:
        _train(case, setup, range(case.steps), rec, trace)
    same_final(_final(setup), want, f"{case.id} recorded lean")  # training unchanged, bitwise
    run = stepdump.open(tmp_path / "run")
    # nothing stored in full but the final record close() writes (the trained model)
    assert run.steps == [case.steps] and run.stats_steps == list(range(case.steps + 1))
    for t, cap in enumerate(trace):
        assert _recorded_fps(run, t) == _lean_fps(cap["tensors"], t), f"{case.id} step {t}: fingerprints"


@pytest.mark.parametrize("case", OPTIMIZER_CASES + SCHEDULER_CASES[:3], ids=lambda c: c.id)
def test_lean_records_every_optimizer_exactly(case: Case, tmp_path, monkeypatch) -> None:
    _lean_matrix_case(case, tmp_path, monkeypatch)


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 80, generator=g), torch.randn(16, 70, generator=g)


def _loop(path, steps: int, between=None, before_step=None, opt_cls=torch.optim.Adam, **kw):
    """Train; return the hand capture at each pre-step moment (after ``before_step``)."""
    model = lean_model()
    opt = opt_cls(model.parameters(), lr=1e-2)
    caps = []
    with stepdump.Recorder(path, model, opt, on_error="raise", **{**LEAN, **kw}) as rec:
        for t in range(steps):
            if between is not None:
                between(t, model, opt)
            x, y = _batch(t)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if before_step is not None:
                before_step(t, model, opt)
            caps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    return stepdump.open(path), caps


def test_stats_at_a_lean_step_describe_the_live_tensor(tmp_path) -> None:
    run, caps = _loop(tmp_path / "r", 4)
    frame = run.stats()
    for t, cap in enumerate(caps):
        for kind, tensors in cap.items():
            if kind == "optimizer" and t % lean.OPTIMIZER_EVERY:
                continue
            for name, live in tensors.items():
                row = frame[(frame.step == t) & (frame.kind == kind) & (frame.name == name)].iloc[0]
                want = compute_stats(live)
                assert row["numel"] == want[0] and (row["nan"], row["posinf"], row["neginf"]) == (0, 0, 0)
                assert (row["min"], row["max"]) == (want[4], want[5]), f"{kind} {name} step {t}"
                assert math.isclose(row["norm"], want[8], rel_tol=1e-4), (kind, name, t)
                large = live.numel() > 4096  # the fused path: mean, std, zero fraction not measured
                for col, i in (("mean", 6), ("std", 7)):
                    if large:
                        assert math.isnan(row[col]), (col, kind, name, t)
                    else:
                        assert math.isclose(row[col], want[i], rel_tol=1e-4, abs_tol=1e-7), (col, kind, name, t)
                if not large or want[4] > 0 or want[5] < 0:
                    assert row["zero_frac"] == want[9], f"zero_frac {kind} {name}"
                else:
                    assert math.isnan(row["zero_frac"])
                assert not bool(row["stored"])


def test_weights_changed_after_the_step_are_recorded_as_changed(tmp_path) -> None:
    # WGAN-style clamping through .data (no version bump) between step and forward,
    # and an in-place scale under no_grad after the backward (a version bump).
    def clamp(t, model, opt):
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)

    def scale(t, model, opt):
        with torch.no_grad():
            model[0].weight.mul_(0.5)

    run, caps = _loop(tmp_path / "r", 5, between=clamp, before_step=scale)
    for t, cap in enumerate(caps):
        assert _recorded_fps(run, t) == _lean_fps(cap, t), f"step {t}"


def test_optimizer_state_replaced_between_steps_is_read_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lean, "OPTIMIZER_EVERY", 1)
    saved = {}

    def reload(t, model, opt):
        if t == 2:
            saved["sd"] = opt.state_dict()
        if t == 3:  # new state tensors, under the same names
            opt.load_state_dict(saved["sd"])

    run, caps = _loop(tmp_path / "r", 5, between=reload)
    for t, cap in enumerate(caps):
        assert _recorded_fps(run, t) == _lean_fps(cap, t), f"step {t}"


class _GradScalingSGD(torch.optim.SGD):
    """An optimizer that writes into the grads it is given (no torch optimizer does)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.0)
        return out


def test_grads_changed_during_the_step_are_left_out_with_a_warning_then_read_before(tmp_path, caplog,
                                                                                   lean_path) -> None:
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        run, caps = _loop(tmp_path / "r", 4, opt_cls=_GradScalingSGD)
    warned = [r for r in caplog.records if "changed in place during optimizer.step()" in r.getMessage()]
    if lean_path == "inline":  # read at the pre-hook from the start: every step's grads, nothing to say
        assert not warned
        for t in range(4):
            assert _recorded_fps(run, t) == _lean_fps(caps[t], t), f"step {t}"
        return
    assert len(warned) == 1
    first = _recorded_fps(run, 0)
    assert not any(k[0] == "grads" for k in first), "grads read after they were changed must not be recorded"
    assert {k: v for k, v in first.items() if k[0] != "grads"} == {k: v for k, v in _lean_fps(caps[0], 0).items()
                                                                   if k[0] != "grads"}
    for t in range(1, 4):
        assert _recorded_fps(run, t) == _lean_fps(caps[t], t), f"step {t}"


def test_lean_keyframes_and_gradient_log_take_the_lean_path_for_what_is_not_stored(tmp_path) -> None:
    for kw in ({"keyframe_every": 3}, {"gradient_log": 3}):
        path = tmp_path / next(iter(kw))
        model = lean_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        caps = []
        with stepdump.Recorder(path, model, opt, on_error="raise", **kw) as rec:
            for t in range(7):
                x, y = _batch(t)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                caps.append(snapshot(model, opt))
                opt.step()
                rec.log(loss=loss)
        run = stepdump.open(path)
        for t, cap in enumerate(caps):
            full = t % 3 == 0 or "gradient_log" in kw  # a gradient log reads the optimizer state every step
            assert _recorded_fps(run, t) == (_fps(cap) if full else _lean_fps(cap, t)), f"{kw} step {t}"
            if "gradient_log" in kw:  # grads in full at every step, bitwise
                for name, g in cap["grads"].items():
                    assert torch.equal(run.tensor(name, t, "grads"), g)


def test_a_failure_on_the_worker_is_one_warning_and_training_goes_on(tmp_path, monkeypatch, caplog,
                                                                    lean_path) -> None:
    calls = {"n": 0}
    if lean_path == "worker":
        real = lean.lean_rows

        def broken(entries, warned, private=False, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("worker broke")
            return real(entries, warned, private, **kw)

        monkeypatch.setattr(lean, "lean_rows", broken)
    else:  # read whole at the pre-hook: its copy, on every path a step takes there (the steady one too)
        real_copy = packed._Batch.copy

        def broken_copy(self, tensors):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("worker broke")
            return real_copy(self, tensors)

        monkeypatch.setattr(packed._Batch, "copy", broken_copy)
    model = lean_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref = lean_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        with stepdump.Recorder(tmp_path / "r", model, opt, **LEAN):
            for t in range(5):
                for m, o in ((model, opt), (ref, ref_opt)):
                    x, y = _batch(t)
                    o.zero_grad()
                    nn.functional.mse_loss(m(x), y).backward()
                    o.step()
    assert calls["n"] >= 3
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert sum("worker broke" in r.getMessage() for r in caplog.records) == 1
    run = stepdump.open(tmp_path / "r")
    assert run.meta.get("recording_stopped")


class _Wrapping(torch.optim.AdamW):
    """A subclass whose step() calls super().step(): torch runs the hooks once per class in the chain."""

    def step(self, closure=None):  # type: ignore[override]
        return super().step(closure)


@pytest.mark.parametrize("kw", [{"every": 1}, LEAN])
def test_a_subclass_calling_super_step_records_one_step_per_update(tmp_path, kw) -> None:
    torch.optim.AdamW(lean_model().parameters())  # the parent class's step() is wrapped by torch as well
    run, caps = _loop(tmp_path / "r", 4, opt_cls=_Wrapping, **kw)
    assert run.all_steps == [0, 1, 2, 3, 4]  # 4: the final record close() writes
    for t, cap in enumerate(caps):
        assert _recorded_fps(run, t) == (_fps(cap) if kw == {"every": 1} else _lean_fps(cap, t)), f"step {t}"


def test_gradient_log_grads_written_during_the_update_fall_back_to_copies_if_the_update_changes_them(
        tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        run, caps = _loop(tmp_path / "r", 6, opt_cls=_GradScalingSGD, every=None, stats_every=None,
                          gradient_log=100, staging_bytes=40_000)  # the weight grads go live
    warned = [r for r in caplog.records if "changed" in r.getMessage() and "while stepdump was writing" in r.getMessage()]
    assert len(warned) == 1
    # from the step after the warning on, grads are copied before the update: exact
    for t in range(2, 6):
        for name, g in caps[t]["grads"].items():
            assert torch.equal(run.tensor(name, t, "grads"), g), f"step {t} {name}"


@pytest.mark.parametrize("staging_bytes", [0, 20_000, 64 << 20])  # live, some of each, copies
def test_gradient_log_grads_are_exact_live_or_copied(tmp_path, staging_bytes) -> None:
    run, caps = _loop(tmp_path / "r", 5, every=None, stats_every=None, gradient_log=100,
                      staging_bytes=staging_bytes)
    for t, cap in enumerate(caps):
        for name, g in cap["grads"].items():
            assert torch.equal(run.tensor(name, t, "grads"), g), f"step {t} {name}"
        assert _recorded_fps(run, t) == _fps(cap)  # a gradient log: the optimizer state every step
