"""A failure inside the recorder never reaches the training (issue 12, "never break the training").

A failure is injected at each point where stepdump's code runs inside the user's
training: the optimizer's step pre-hook (staging, state), its post-hook, forward
hooks, gradient hooks, the model's input hook, the batch, the writer thread and
close(). With the default policy the training's params must be bitwise those of
the same run without stepdump, one warning must name the cause, and the run must
be marked with the first step it could not record. ``on_error="raise"`` lets the
same failure through.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import MLP, assert_same, regression_batch
from torch import nn

import stepdump
from stepdump.capture import activations, assemble, lean, packed, recorder, staging, user_log, writer

FAIL_AT = 2
N_STEPS = 6


class Injected(RuntimeError):
    """The planted failure."""


def _train(model, opt, scaler, rec=None):
    for t in range(N_STEPS):
        x, y = regression_batch(t, d_in=8, d_out=4)
        if rec is not None:
            rec.log_batch((x, y))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if t == 4:
            loss = loss * float("inf")  # a step the GradScaler skips
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if rec is not None:
            rec.log(loss=loss)


def _build():
    torch.manual_seed(0)
    model = MLP(8, 16, 4, dropout=0.2)  # dropout: the torch RNG must not be touched
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**8)


def _plain_params():
    model, opt, scaler = _build()
    _train(model, opt, scaler)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _failing(original, armed, when=lambda *args: True):
    """Wrap ``original`` to raise while ``armed()`` and ``when(*args)``."""

    def wrapped(*args, **kwargs):
        if armed() and when(*args):
            raise Injected("planted failure")
        return original(*args, **kwargs)

    return wrapped


def _grads_only(capture, kind, *rest):
    return kind == "activation_grads"


def _writing_step(writer_, cat, step, *rest):
    # the writer runs behind the training thread: fail on the step's own message
    return step is not None and step >= FAIL_AT


# name: (owner, attribute, only-when, where the mark says it failed, first step not recorded)
POINTS = {
    "pre-hook staging": (staging.Stager, "stage", None, "pre-hook", FAIL_AT),
    "pre-hook state": (assemble, "full_state", None, "pre-hook", FAIL_AT),
    # the post-hook of update t takes what record t+1 starts from
    "post-hook": (recorder.Recorder, "_begin_iteration", None, "post-hook", FAIL_AT + 1),
    "forward hooks": (activations, "flatten", None, "hook", FAIL_AT),
    "gradient hook": (activations.ModuleCapture, "_keep", _grads_only, "gradient hook", FAIL_AT),
    "writer thread": (writer.Writer, "_item_row", _writing_step, "writing the run", FAIL_AT),
    "batch": (activations.ModuleCapture, "log_batch", None, "log_batch()", FAIL_AT),
}
# The lean path of stats-only steps (capture/lean.py), run with every=3: step FAIL_AT is stats-only.
LEAN_POINTS = {
    "lean worker": (lean, "lean_rows", None, "pre-hook", FAIL_AT),
    "lean forward hook": (lean.LeanCapture, "forward_started", None, "forward pre-hook", FAIL_AT),
    "lean post-hook": (lean.LeanCapture, "finish", lambda capture: capture._pending is not None, "post-hook", FAIL_AT),
    # a small record read whole at the pre-hook (lean.INLINE_BYTES): its copy, which every path there takes
    # (a steady step's too: LeanCapture.steady); the points above use the worker
    "lean inline": (packed._Batch, "copy", None, "pre-hook", FAIL_AT),
}


@pytest.mark.parametrize("point", list(POINTS) + list(LEAN_POINTS))
def test_a_failure_inside_the_recorder_leaves_training_bitwise_unchanged(tmp_path, point, monkeypatch, caplog):
    want = _plain_params()
    owner, attr, when, where, first_lost = POINTS.get(point) or LEAN_POINTS[point]
    schedule = {"every": 3, "stats_every": 1} if point in LEAN_POINTS else {}
    if point in LEAN_POINTS:
        monkeypatch.setattr(lean, "INLINE_BYTES", 1 << 40 if point == "lean inline" else 0)
    model, opt, scaler = _build()
    step = [0]
    armed = (lambda: True) if when is _writing_step else (lambda: step[0] >= FAIL_AT)
    monkeypatch.setattr(owner, attr, _failing(getattr(owner, attr), armed, when or (lambda *a: True)))
    caplog.set_level(logging.WARNING, logger="stepdump")
    rec = stepdump.Recorder(tmp_path / "run", model, opt, scaler=scaler,
                            capture=("params", "grads", "optimizer", "activations", "activation_grads", "inputs"),
                            **schedule)
    for t in range(N_STEPS):  # _train, with the recorder's step exposed to the injection
        step[0] = rec.step
        x, y = regression_batch(t, d_in=8, d_out=4)
        rec.log_batch((x, y))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if t == 4:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        rec.log(loss=loss)
    rec.close()
    for n, p in model.named_parameters():
        assert_same(p.detach(), want[n], f"{point}: param {n} after training")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "stopped at step" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "Injected: planted failure" in warnings[0].getMessage()
    if point == "writer thread":  # issue 16 #11: it names the last step really committed, not the one before
        assert f"steps up to {first_lost - 1} are intact" in warnings[0].getMessage(), warnings[0].getMessage()
    with stepdump.open(tmp_path / "run") as run:
        mark = run.meta["recording_stopped"]
        assert mark["step"] == first_lost, mark
        assert where in mark["where"], mark
        assert mark["error"] == "Injected: planted failure"
        assert mark["last_committed"] == max(run.all_steps) == first_lost - 1
        assert run.all_steps == list(range(first_lost))  # everything before it, nothing after
        assert_same(run.tensor("fc1.weight", 0), _build()[0].fc1.weight.detach(), "step 0 still readable")


def test_failure_in_the_closure_path_and_close(tmp_path, monkeypatch, caplog):
    """LBFGS records inside the closure; a failure there (and one in close()) is contained too."""

    def build():
        torch.manual_seed(3)
        m = nn.Linear(4, 1)
        return m, torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3)

    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 1)

    def train(m, o, before_step=lambda: None):
        for _ in range(4):
            before_step()

            def closure():
                o.zero_grad()
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
                return loss
            o.step(closure)

    plain, popt = build()
    train(plain, popt)
    model, opt = build()
    step, closing = [0], [False]
    monkeypatch.setattr(staging.Stager, "stage", _failing(staging.Stager.stage, lambda: step[0] >= FAIL_AT))
    monkeypatch.setattr(user_log, "scalar_rows", _failing(user_log.scalar_rows, lambda: closing[0]))
    caplog.set_level(logging.WARNING, logger="stepdump")
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        train(model, opt, before_step=lambda: step.__setitem__(0, rec.step))
        closing[0] = True  # close() fails too: still no exception, the first failure stays the mark
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_same(p.detach(), q.detach(), "LBFGS params")
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["recording_stopped"]["step"] == FAIL_AT
        assert run.all_steps == [0, 1]
    assert len([r for r in caplog.records if "stopped at step" in r.getMessage()]) == 1


@pytest.mark.parametrize("point", ["pre-hook staging", "post-hook", "forward hooks", "writer thread"])
def test_on_error_raise_lets_the_failure_through(tmp_path, point, monkeypatch):
    owner, attr, *_ = POINTS[point]
    model, opt, scaler = _build()
    armed = [False]
    monkeypatch.setattr(owner, attr, _failing(getattr(owner, attr), lambda: armed[0]))
    rec = stepdump.Recorder(tmp_path / "run", model, opt, scaler=scaler, on_error="raise", capture=(
        "params", "grads", "optimizer", "activations"))
    armed[0] = True
    with pytest.raises((Injected, stepdump.WriterError)):
        _train(model, opt, scaler, rec)
        rec.close()
    try:
        rec.close()
    except (Injected, stepdump.WriterError):
        pass
