"""TensorBoard export of distributions per block (issue 26 item 6): ``<kind>_by_block/<block>``.

Besides one histogram per tensor at stored steps, the export writes one per block of the
report's grouping (:mod:`stepdump.analysis.report_groups`): every finite value of the block's
tensors at that step. Read back with TensorBoard's own reader, each must hold exactly the values
of the stored tensors (count, min, max bit for bit; NaN left out), at every exported step, for
params and grads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import record_run
from torch import nn

import stepdump
from stepdump.analysis.report_groups import tensor_groups
from stepdump.render.tensorboard import export_tensorboard

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 6)
        self.h = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(2)])
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.h:
            x = torch.tanh(b(x))
        return self.head(x)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five Adam steps stored in full at 0, 2, 4; one NaN in a grad of block h.1 at step 4 (the last update)."""
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 1)
    model = _Blocks()

    def nan_at_4(t: int, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        if t == 4:
            m.h[1][0].weight.grad[0, 0] = float("nan")  # type: ignore[index]

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return record_run(tmp_path_factory.mktemp("tbg") / "run", steps=5, model=model, opt=opt,  # type: ignore[no-any-return]
                      batch=lambda t: (x, y), before_step=nan_at_4, every=2)


@pytest.fixture(scope="module")
def exported(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EventAccumulator, int]:
    out = export_tensorboard(run_dir, tmp_path_factory.mktemp("tb") / "tb", stats=None, scalars=False)
    ea = EventAccumulator(str(out.logdir), size_guidance={"histograms": 0})
    ea.Reload()
    return ea, out.group_histograms


def _blocks(run: stepdump.types.Run, kind: str) -> dict[str, list[str]]:
    g = tensor_groups(run.names(kind))
    out: dict[str, list[str]] = {}
    for name in run.names(kind):
        out.setdefault(g["block"][name], []).append(name)
    return {b: names for b, names in out.items() if len(names) > 1}


@pytest.mark.parametrize("kind", ["params", "grads"])
def test_block_histograms_hold_the_blocks_values(run_dir: Path, exported: tuple[EventAccumulator, int],
                                                 kind: str) -> None:
    ea, _ = exported
    with stepdump.open(run_dir) as run:
        blocks = _blocks(run, kind)
        assert set(blocks) == {"embed", "h.0", "h.1", "head"}
        steps = [s for s in run.steps if run.fingerprints(s, (kind,))]
        assert steps
        for block, names in blocks.items():
            events = {e.step: e.histogram_value for e in ea.Histograms(f"{kind}_by_block/{block}")}
            assert sorted(events) == steps, (kind, block)
            for step, h in events.items():
                v = torch.cat([run.tensor(n, step, kind).double().reshape(-1) for n in names])
                v = v[torch.isfinite(v)]
                assert h.num == v.numel() and sum(h.bucket) == v.numel()
                assert h.min == float(v.min()) and h.max == float(v.max())


def test_nan_left_out_of_its_block(run_dir: Path, exported: tuple[EventAccumulator, int]) -> None:
    ea, _ = exported
    with stepdump.open(run_dir) as run:
        total = sum(run.tensor(n, 4, "grads").numel() for n in ("h.1.0.weight", "h.1.0.bias", "h.1.1.weight",
                                                                 "h.1.1.bias"))
    h = {e.step: e.histogram_value for e in ea.Histograms("grads_by_block/h.1")}[4]
    assert h.num == total - 1


def test_count_and_switch_off(run_dir: Path, exported: tuple[EventAccumulator, int], tmp_path: Path) -> None:
    ea, n = exported
    tags = [t for t in ea.Tags()["histograms"] if "_by_block/" in t]
    assert n == sum(len(ea.Histograms(t)) for t in tags) > 0
    out = export_tensorboard(run_dir, tmp_path / "off", stats=None, scalars=False, histogram_groups=False)
    off = EventAccumulator(str(out.logdir), size_guidance={"histograms": 0})
    off.Reload()
    assert out.group_histograms == 0 and not [t for t in off.Tags()["histograms"] if "_by_block/" in t]
    per_tensor = sum(len(ea.Histograms(t)) for t in ea.Tags()["histograms"] if "_by_block/" not in t)
    assert out.histograms == per_tensor == sum(len(off.Histograms(t)) for t in off.Tags()["histograms"])
