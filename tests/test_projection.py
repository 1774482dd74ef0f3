"""The size projection: what a run will write, logged at start and checked against the free disk."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import stepdump
from stepdump.capture import projection
from stepdump.capture.projection import HORIZON, ROW_BYTES, Pace, full_step_bytes, project, report, state_factor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 3))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _take_a_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 10)).sum().backward()
    opt.step()


@pytest.mark.parametrize("make,factor", [
    (lambda ps: torch.optim.AdamW(ps), 2),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.RMSprop(ps), 1),
])
def test_state_factor_counts_the_state_the_first_step_creates(make, factor):
    model = _model()
    opt = make(model.parameters())
    assert state_factor(opt) == factor
    _take_a_step(model, opt)
    sized = [v for p in model.parameters() for v in opt.state[p].values()
             if isinstance(v, torch.Tensor) and v.shape == p.shape]
    assert len(sized) == factor * len(list(model.parameters()))


def test_the_estimate_at_step_0_is_the_record_after_the_first_step():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers()}
    kinds = ("params", "grads", "optimizer")
    before, _ = full_step_bytes(params, buffers, opt, kinds, lambda n: True)
    _take_a_step(model, opt)
    after, tensors = full_step_bytes(params, buffers, opt, kinds, lambda n: True)
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    step_tensors = sum(opt.state[p]["step"].numel() * opt.state[p]["step"].element_size() for p in params.values())
    # params + grads + exp_avg + exp_avg_sq (+ buffers); the step counters exist only after the step
    assert before == 4 * _param_bytes(model) + buffer_bytes
    assert after == before + step_tensors
    assert tensors == 5 * len(params) + len(buffers)  # params, grads, exp_avg, exp_avg_sq, step


def test_include_and_kinds_narrow_the_estimate():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    got, n = full_step_bytes(params, {}, opt, ("grads",), lambda name: name.startswith("0."))
    assert got == sum(p.numel() * 4 for name, p in params.items() if name.startswith("0.")) and n == 2


def test_project_counts_full_and_stats_steps_at_the_schedule():
    proj = project(1000, 10, lambda t: t % 100 == 0, lambda t: True, start=0)
    assert proj.full_step == 1000 + 10 * ROW_BYTES and proj.stats_step == 10 * ROW_BYTES
    assert proj.per_1000 == 10 * proj.full_step + 990 * proj.stats_step
    assert proj.horizon == HORIZON // 100 * proj.full_step + (HORIZON - HORIZON // 100) * proj.stats_step
    # Resumed at step 50, with stats every 10 steps only: steps 100..1000 step 100 in full.
    proj = project(1000, 10, lambda t: t % 100 == 0, lambda t: t % 10 == 0, start=50)
    assert proj.per_1000 == 10 * proj.full_step + 90 * proj.stats_step


def test_a_schedule_decided_at_run_time_is_not_projected():
    calls = []
    proj = project(1000, 10, lambda t: calls.append(t) or False, lambda t: True, start=0, dynamic=True)
    assert proj.per_1000 is None and proj.horizon is None
    assert not calls  # the user's callable is not run ahead of time


def test_report_logs_and_warns_only_when_the_disk_is_too_small(tmp_path, caplog):
    proj = project(1 << 20, 4, lambda t: True, lambda t: True, start=0)
    with caplog.at_level(logging.INFO, logger="stepdump"):
        report(proj, free=proj.horizon + 1, path=tmp_path)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "per full step" in caplog.records[0].getMessage() and "per 1000 steps" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stepdump"):
        report(proj, free=proj.horizon - 1, path=tmp_path)
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and f"next {HORIZON} steps" in warning[0].getMessage()


def test_a_ring_reports_the_memory_it_holds(tmp_path, caplog):
    proj = project(1 << 20, 4, lambda t: False, lambda t: True, start=0)
    with caplog.at_level(logging.INFO, logger="stepdump"):
        report(proj, free=None, path=tmp_path, ring=3)
    assert "keeps 3 full steps in memory" in caplog.records[0].getMessage()


def _recorder_logs(tmp_path, monkeypatch, caplog, free: int, **kwargs):
    monkeypatch.setattr(projection, "free_bytes", lambda path: free)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.INFO, logger="stepdump.capture.projection"):
        stepdump.Recorder(tmp_path / "run", model, opt, **kwargs).close()
    return [r for r in caplog.records if r.name == "stepdump.capture.projection"]


def test_the_recorder_logs_its_projection_at_start(tmp_path, monkeypatch, caplog):
    logs = _recorder_logs(tmp_path, monkeypatch, caplog, free=1 << 40, every=100, stats_every=1)
    assert [r.levelno for r in logs] == [logging.INFO]
    assert "per full step" in logs[0].getMessage()


def test_the_recorder_warns_when_the_projection_exceeds_the_free_disk(tmp_path, monkeypatch, caplog):
    logs = _recorder_logs(tmp_path, monkeypatch, caplog, free=1 << 20)
    assert [r.levelno for r in logs] == [logging.INFO, logging.WARNING]
    assert "only 1.0 MiB is free" in logs[1].getMessage()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pace_logs_the_measured_rate_once_and_warns_when_an_hour_does_not_fit(tmp_path, caplog):
    clock = _Clock()
    pace = Pace(tmp_path, after=60, clock=clock, free=lambda path: 100 << 20)
    with caplog.at_level(logging.INFO, logger="stepdump"):
        pace.observe(5 << 20)  # the first step: where the measurement starts
        clock.now = 30
        pace.observe(10 << 20)
        assert not caplog.records  # not a minute yet
        clock.now = 60
        pace.observe(10 << 20)  # 5 MiB a minute: 300 MiB an hour, on a disk with 100 MiB free
        clock.now = 120
        pace.observe(20 << 20)  # once only
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert "300.0 MiB per hour" in caplog.records[0].getMessage()


def test_pace_is_quiet_when_the_disk_has_room(tmp_path, caplog):
    clock = _Clock()
    pace = Pace(tmp_path, after=60, clock=clock, free=lambda path: 1 << 40)
    with caplog.at_level(logging.INFO, logger="stepdump"):
        pace.observe(0)
        clock.now = 61
        pace.observe(1 << 20)
    assert [r.levelno for r in caplog.records] == [logging.INFO] and pace.done
