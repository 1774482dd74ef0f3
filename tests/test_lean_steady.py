"""A steady lean step's short path (assemble.Assembler._lean_again, lean.LeanCapture.steady).

A stats-only step of a small model whose params and grads are laid out as at the last step the
lean path took whole is copied at once, without listing the step's entries and finding their
plan again. What must hold: the record is the one the general path makes, row for row and bit for
bit, and it is the live tensors' (fingerprints of the bytes the update read); the short path is
taken on the steady steps (so this test exercises it); and any step whose tensors differ from the
plan's (a param without a grad, a param given another dtype or shape, the optimizer state read,
a new layout) takes the general path.
"""

from __future__ import annotations

import torch
from helpers import snapshot
from torch import nn

import stepdump
from stepdump.capture import assemble, lean
from stepdump.core.hashing import fingerprint

STEPS = 25


class _Net(nn.Module):
    """Two linear layers, a LayerNorm, a ``scale`` any dtype and shape of which the forward takes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.fc2 = nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.ones(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x))) * self.scale.reshape(-1).to(x.dtype)
        return self.fc2(h)


def _model() -> nn.Module:
    return _Net()


def _train(path, monkeypatch, short: bool, change=None):
    """Record STEPS lean steps (read whole at the pre-hook); the steps whose short path was taken,
    and the live params' and grads' snapshots at each record."""
    taken: list[int] = []
    real = lean.LeanCapture.steady

    def counting(self, msg, layout, tensors):
        got = real(self, msg, layout, tensors)
        if got:
            taken.append(msg.step)
        return got

    monkeypatch.setattr(lean.LeanCapture, "steady", counting)
    if not short:
        monkeypatch.setattr(assemble.Assembler, "_lean_again", lambda self, msg: False)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    caps = []
    with stepdump.Recorder(path, model, opt, on_error="raise", every=None, stats_every=1):
        for t in range(STEPS):
            if change is not None:
                change(t, model, opt)
            opt.zero_grad()
            model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
            caps.append(snapshot(model, opt))
            opt.step()
    monkeypatch.undo()
    return taken, caps


def _recorded(run, t: int) -> dict[tuple[str, str], int]:
    """The params' and grads' fingerprints recorded at step ``t``."""
    return {(k, n): fp for k, n, fp in run.catalog.fingerprints(t) if k in ("params", "grads")}


def _live(cap) -> dict[tuple[str, str], int]:
    """The fingerprints of the live params and grads as they were at the record."""
    return {(k, n): fingerprint(x) for k in ("params", "grads") for n, x in cap[k].items()}


def _rows(path) -> dict[int, list[str]]:
    run = stepdump.open(path)
    return {t: sorted(repr(tuple(r)) for r in run.catalog.step_rows(t)) for t in range(STEPS)}


def test_steady_steps_take_the_short_path_and_record_what_the_general_path_records(tmp_path, monkeypatch) -> None:
    taken, caps = _train(tmp_path / "short", monkeypatch, short=True)
    never, _ = _train(tmp_path / "general", monkeypatch, short=False)
    assert never == []
    # Every step but those that read the optimizer state (the general path's: 0, 10, 20) and step 1
    # (the first of params and grads alone: it makes the plan); the step after a read finds it again.
    reads = {t for t in range(STEPS) if t % lean.OPTIMIZER_EVERY == 0}
    assert set(taken) == set(range(2, STEPS)) - reads, taken
    assert _rows(tmp_path / "short") == _rows(tmp_path / "general")
    run = stepdump.open(tmp_path / "short")
    for t in taken:
        assert _recorded(run, t) == _live(caps[t]), t


def _grad_gone(t, model, opt):  # the last layer's bias frozen from step 12 on: its grad is None
    if t == 12:
        model.fc2.bias.requires_grad_(False)
        model.fc2.bias.grad = None


def _retyped(t, model, opt):  # ``scale`` given float64 memory at step 12 (the same object)
    if t == 12:
        opt.state.pop(model.scale, None)
        with torch.no_grad():
            model.scale.data = model.scale.data.double()


def _reshaped(t, model, opt):  # the same numel in another shape at step 12
    if t == 12:
        opt.state.pop(model.scale, None)
        with torch.no_grad():
            model.scale.data = model.scale.data.reshape(3, 4).clone()


def test_a_step_whose_tensors_differ_from_the_plan_takes_the_general_path(tmp_path, monkeypatch) -> None:
    for i, change in enumerate((_grad_gone, _retyped, _reshaped)):
        path = tmp_path / str(i)
        taken, caps = _train(path, monkeypatch, short=True, change=change)
        if change is _grad_gone:  # a param without a grad: every step from then on takes the general path
            assert 11 in taken and not [t for t in taken if t >= 12], taken
        else:  # a new plan at 12, found again at 13
            assert 11 in taken and 12 not in taken and 13 in taken, (change.__name__, taken)
        run = stepdump.open(path)
        for t in range(STEPS):
            assert _recorded(run, t) == _live(caps[t]), (change.__name__, t)
