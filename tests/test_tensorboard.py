"""TensorBoard export: event files read back with TensorBoard's own reader equal the run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import record_run, training_scalars
from torch import nn

import stepdump
from stepdump.cli.main import main
from stepdump.render.tensorboard import export_tensorboard

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Six SGD steps, full tensors every 2nd step, a NaN in one gradient at step 4 (so
    params and loss are NaN at step 5), a scalar logged only at step 1, as NaN."""
    def nan_grad_at_4(t, model, opt):
        if t == 4:
            model[2].weight.grad[0, 1] = float("nan")

    def scalars(t, loss):
        return {"loss": loss, "acc": t / 10, **({"odd": float("nan")} if t == 1 else {})}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    return record_run(tmp_path_factory.mktemp("tb") / "run", steps=STEPS, model=model, opt=opt,
                      batch=lambda t: (x, y), before_step=nan_grad_at_4, log=scalars, every=2)


def _events(logdir):
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


def _series(ea, tag):
    return {e.step: e.value for e in ea.Scalars(tag)}


def _same(got: dict, want: dict) -> bool:
    """Equal as float32 (TensorBoard's scalar type), NaN equal to NaN."""
    return got.keys() == want.keys() and all(
        np.float32(got[k]) == np.float32(v) or (np.isnan(got[k]) and np.isnan(v)) for k, v in want.items())


def test_scalars_and_stats_read_back_equal(run_dir, tmp_path):
    out = export_tensorboard(run_dir, tmp_path / "tb", histograms=None)
    ea = _events(tmp_path / "tb")
    tags = set(ea.Tags()["scalars"])
    with stepdump.open(run_dir) as run:
        sc = training_scalars(run)  # the final record STEPS logs nothing: no point there
        for name in ("loss", "acc", "lr"):
            assert _same(_series(ea, name), dict(sc[name].items())), name
        assert "skipped" not in tags  # no skipped steps in this run
        stats = run.stats()
        assert set(stats["step"]) == set(range(STEPS + 1))  # and the final record's stats
        n = 0
        for row in stats.itertuples():
            for stat in ("norm", "mean", "std", "min", "max", "nan"):
                tag = f"{row.kind}/{row.name}/{stat}"
                assert tag in tags
                value = getattr(row, stat)
                if value is None or np.isnan(value):  # no finite element (all NaN): no point
                    assert row.step not in _series(ea, tag)
                    continue
                assert _series(ea, tag)[row.step] == np.float32(value), (tag, row.step)
                n += 1
            assert _series(ea, f"{row.kind}/{row.name}/inf")[row.step] == row.posinf + row.neginf
            n += 1
        assert out.stats == n
        # loss went NaN after the NaN gradient: exported as NaN, not dropped
        assert np.isnan(_series(ea, "loss")[5]) and np.isnan(sc.loc[5, "loss"])
        assert out.scalars == 3 * STEPS + 1
    # the NaN shows up as a count at step 4 on the grad that had it
    assert _series(ea, "grads/2.weight/nan")[4] == 1
    assert _series(ea, "grads/2.weight/nan")[3] == 0
    # a scalar logged once, as NaN: one point, NaN (not dropped, not filled in elsewhere)
    odd = _series(ea, "odd")
    assert list(odd) == [1] and np.isnan(odd[1])
    assert "grads/0.weight/norm" in tags and "optimizer/0.weight.momentum_buffer/norm" in tags
    assert not ea.Tags()["histograms"]


def test_histograms_of_stored_tensors(run_dir, tmp_path):
    out = export_tensorboard(run_dir, tmp_path / "tb", stats=None, scalars=False, max_histogram_steps=2)
    ea = _events(tmp_path / "tb")
    assert not ea.Tags()["scalars"]
    with stepdump.open(run_dir) as run:
        assert run.steps == [0, 2, 4, 6] and run.meta["final_step"] == 6
        # capped at 2 per kind, first and last: the final record has params but no grads
        assert out.histogram_steps == (0, 4, 6)
        # (the NaN at step 4 spread through the loss: every param is all NaN at 6, so has no histogram)
        assert all(run.tensor(n, 6).isnan().all() for n in run.names("params"))
        n_events = 0
        for kind, want in (("params", {0}), ("grads", {0, 4})):
            for name in run.names(kind):
                events = {e.step: e.histogram_value for e in ea.Histograms(f"{kind}/{name}")}
                assert set(events) == want, (kind, name)
                n_events += len(events)
                for step, h in events.items():
                    v = run.tensor(name, step, kind).double()
                    v = v[torch.isfinite(v)]
                    assert h.num == v.numel()  # NaNs left out
                    assert h.min == pytest.approx(float(v.min())) and h.max == pytest.approx(float(v.max()))
                    assert h.sum == pytest.approx(float(v.sum()), rel=1e-5, abs=1e-6)
        assert out.histograms == n_events == len(run.names("params")) + 2 * len(run.names("grads"))
        assert run.tensor("2.weight", 4, "grads").isnan().sum() == 1


def test_cli_export_tb(run_dir, tmp_path, capsys):
    logdir = tmp_path / "tb"
    assert main(["export-tb", str(run_dir), str(logdir), "--stats", "norm,nan", "--kinds", "grads",
                 "--histograms", "grads", "--histogram-steps", "1"]) == 0
    assert "histograms" in capsys.readouterr().out
    ea = _events(logdir)
    tags = set(ea.Tags()["scalars"])
    assert {"loss", "lr", "grads/0.weight/norm", "grads/2.weight/nan"} <= tags
    assert not any(t.startswith("params/") or t.endswith("/mean") for t in tags)
    assert {e.step for e in ea.Histograms("grads/0.weight")} == {4}
    assert main(["export-tb", str(run_dir), str(tmp_path / "bad"), "--stats", "median"]) != 0
    assert main(["export-tb", str(tmp_path / "nope"), str(tmp_path / "x")]) == 3
