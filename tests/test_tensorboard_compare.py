"""TensorBoard export of a comparison (issue 26 item 6): several runs exported together carry,
in each later run's directory, what the report's comparison shows: A − B and the relative
difference |A − B| / max(|A|, |B|) of every scalar both runs logged (A: the first run), and where
``stepdump diff`` says they part (``compare/diverged`` 0 then 1 from that step on,
``compare/first_divergent_step``, and the reading as text). Read back with TensorBoard's own
reader, every value must equal (as float32, TensorBoard's type) what the test computes from the
runs' own scalars, at exactly the steps both logged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import record_run
from torch import nn

import stepdump
from stepdump.cli.main import main
from stepdump.render.tensorboard_compare import export_tensorboard_runs

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS, BUMP = 12, 5


def _record(path: Path, lr_after: float, steps: int = STEPS, extra: bool = False) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def before(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if t >= BUMP:
            for g in opt.param_groups:
                g["lr"] = lr_after

    def log(t: int, loss: torch.Tensor) -> dict[str, object]:
        return {"loss": loss, **({"only_here": float(t)} if extra else {})}

    return record_run(path, steps=steps, model=model, opt=opt, before_step=before, log=log)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tbc")
    return {
        "base": _record(root / "base", 1e-2),
        "same": _record(root / "same", 1e-2),  # the same run again: bit for bit equal
        "lr5x": _record(root / "lr5x", 5e-2, extra=True),  # parts at BUMP; logs a scalar base does not
        "short": _record(root / "short", 5e-2, steps=8),  # parts at BUMP, fewer steps
    }


def _events(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _series(run: stepdump.types.Run, name: str) -> dict[int, float]:
    return {s: (np.nan if v is None else float(v)) for s, n, v in run.scalar_rows() if n == name}


def _f32_equal(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert np.float32(got[k]) == np.float32(v) or (np.isnan(got[k]) and np.isnan(v)), (k, got[k], v)


@pytest.mark.parametrize("other", ["same", "lr5x", "short"])
def test_comparison_scalars_read_back(runs: dict[str, Path], other: str, tmp_path: Path) -> None:
    out = export_tensorboard_runs([runs["base"], runs[other]], tmp_path / "tb", labels=["base", other],
                                  stats=None, histograms=None)
    base = _events(tmp_path / "tb" / "base")
    ea = _events(tmp_path / "tb" / other)
    assert not [t for t in base.Tags()["scalars"] if t.startswith("compare/")]  # the first run is A
    with stepdump.open(runs["base"]) as a, stepdump.open(runs[other]) as b:
        want_div = stepdump.diff(a, b)
        tags = set(ea.Tags()["scalars"])
        for name in ("loss", "lr"):
            sa, sb = _series(a, name), _series(b, name)
            common = sorted(set(sa) & set(sb))
            assert common and len(common) == min(len(sa), len(sb))
            d = {s: sa[s] - sb[s] for s in common}
            rel = {s: abs(d[s]) / max(abs(sa[s]), abs(sb[s])) if max(abs(sa[s]), abs(sb[s])) > 0 else 0.0
                   for s in common}
            _f32_equal({e.step: e.value for e in ea.Scalars(f"compare/{name}/a_minus_b")}, d)
            _f32_equal({e.step: e.value for e in ea.Scalars(f"compare/{name}/rel_diff")}, rel)
        assert "compare/only_here/a_minus_b" not in tags  # logged by one run only: nothing to compare
        diverged = {e.step: e.value for e in ea.Scalars("compare/diverged")}
        assert sorted(diverged) == sorted(set(a.all_steps) & set(b.all_steps))
        first = want_div.first_step
        if other == "same":
            assert want_div.identical and first is None
            assert set(diverged.values()) == {0.0}
            assert "compare/first_divergent_step" not in tags
        else:
            assert first == BUMP
            assert diverged == {s: float(s >= first) for s in diverged}
            (marker,) = ea.Scalars("compare/first_divergent_step")
            assert marker.step == first and marker.value == first
            d_lr = {e.step: e.value for e in ea.Scalars("compare/lr/a_minus_b")}
            assert [s for s, v in sorted(d_lr.items()) if v != 0][0] == first  # the lr is what parts them
        (text,) = ea.Tensors("compare/divergence/text_summary")
        assert text.step == (first if first is not None else 0)
        said = text.tensor_proto.string_val[0].decode()
        assert want_div.headline() in said
    assert out.compared == (("base", other, first),)


def test_three_runs_each_compared_to_the_first(runs: dict[str, Path], tmp_path: Path) -> None:
    out = export_tensorboard_runs([runs["base"], runs["lr5x"], runs["same"]], tmp_path / "tb", stats=None,
                                  histograms=None)
    assert [e.logdir.name for e in out.runs] == ["base", "lr5x", "same"]  # directory names as labels
    assert out.compared == (("base", "lr5x", BUMP), ("base", "same", None))
    for name, parts in (("lr5x", 1.0), ("same", 0.0)):
        ea = _events(tmp_path / "tb" / name)
        assert max(e.value for e in ea.Scalars("compare/diverged")) == parts
        assert {e.step for e in ea.Scalars("loss")} == set(range(STEPS))  # its own scalars are there too


def test_without_compare_only_the_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    out = export_tensorboard_runs([runs["base"], runs["lr5x"]], tmp_path / "tb", compare=False, stats=None,
                                  histograms=None)
    assert out.compared == ()
    assert not [t for t in _events(tmp_path / "tb" / "lr5x").Tags()["scalars"] if t.startswith("compare/")]


def test_labels_must_match_and_be_directory_names(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(stepdump.StepdumpError, match="labels"):
        export_tensorboard_runs([runs["base"], runs["lr5x"]], tmp_path / "a", labels=["x"])
    with pytest.raises(stepdump.StepdumpError, match="label"):
        export_tensorboard_runs([runs["base"], runs["lr5x"]], tmp_path / "b", labels=["x", "x"])
    with pytest.raises(stepdump.StepdumpError, match="label"):
        export_tensorboard_runs([runs["base"], runs["lr5x"]], tmp_path / "c", labels=["x", "../y"])


def test_cli_export_tb_compare(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logdir = tmp_path / "tb"
    assert main(["export-tb", str(runs["base"]), str(logdir), "--compare", str(runs["lr5x"]),
                 "--label", "A", "--label", "B", "--no-stats", "--histograms", "none"]) == 0
    assert f"parts at step {BUMP}" in capsys.readouterr().out
    ea = _events(logdir / "B")
    assert {e.step: e.value for e in ea.Scalars("compare/first_divergent_step")} == {BUMP: BUMP}
    assert {e.step for e in _events(logdir / "A").Scalars("loss")} == set(range(STEPS))
    assert main(["export-tb", str(runs["base"]), str(tmp_path / "x"), "--label", "A"]) == 2  # --label needs --compare
