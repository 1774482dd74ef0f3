"""The shapes the rules learnt in issue 27, as rows of cases: lr trajectories (warmups, stairs,
restarts, mistakes), which scalar is the objective, the causal order of logged NaNs, and
sparse-by-construction gradients (embeddings, pruning masks) in real recorded runs.

The lr and objective rows run the rules on a stand-in run holding only scalars (the rules read
nothing else for them); the rest record tiny real runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.utils.prune
from helpers import record_run
from torch import nn

import stepdump
from stepdump.analysis.checks import CachedRun
from stepdump.analysis.rules._roles import objective
from stepdump.checks import LossNotDecreasing, LrJump, NanInf, Severity
from stepdump.errors import ConfigError


class ScalarsRun:
    """A run that holds scalars only: what lr_jump, loss_not_decreasing and the roles read."""

    def __init__(self, scalars: dict[str, list[float]], meta: dict[str, Any] | None = None) -> None:
        n = max(len(v) for v in scalars.values())
        self._sc = pd.DataFrame({k: pd.Series(v, index=range(len(v)), dtype=float) for k, v in scalars.items()},
                                index=range(n))
        self._sc["skipped"] = False
        self.meta = meta or {}

    def scalars(self, names: Any = None, steps: Any = None) -> pd.DataFrame:
        return self._sc.copy()

    def scalar_rows(self, steps: Any = None, *, nan_only: bool = False) -> list[tuple[int, str, float | None]]:
        rows = [(int(s), c, None if math.isnan(v) else float(v)) for c in self._sc.columns if c != "skipped"
                for s, v in self._sc[c].items()]
        return [r for r in rows if r[2] is None] if nan_only else rows


def cosine(n: int, peak: float) -> list[float]:
    return [peak * 0.5 * (1 + math.cos(math.pi * i / n)) for i in range(n)]


LR_SHAPES = {
    # name: (lr per step, steps lr_jump must name)
    "linear warmup from 1e-6 (timm)": ([1e-6 + t * (1e-3 - 1e-6) / 5 for t in range(5)] + cosine(20, 1e-3), []),
    "LinearLR(start_factor=0.01) per step": ([0.1 * (0.01 + 0.99 * min(t, 10) / 10) for t in range(11)]
                                             + cosine(20, 0.1), []),
    "LinearLR in stairs per epoch": ([0.002] * 4 + [0.068] * 4 + [0.134] * 4 + [0.2] * 4 + [0.1] * 4, []),
    "exponential warmup x20 per step": ([1e-6 * 20 ** t for t in range(4)] + [8e-3] * 10, []),
    "warmup from 0": ([0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3] + cosine(10, 1e-3), []),
    "warm restarts": ((cosine(8, 1e-2) + [1e-2]) * 3, []),
    "step decay": ([1e-2] * 5 + [1e-3] * 5 + [1e-4] * 5, []),
    "one-step spike x1000": ([1e-3] * 6 + [1.0] + [1e-3] * 6, [6]),
    "spike inside a warmup": ([1e-6, 2e-4, 4e-4, 0.6, 8e-4, 1e-3, 1e-3, 1e-3], [3]),
    "jump x50 that stays": ([1e-4] * 8 + [5e-3] * 8, [8]),
    "jump x50 then decay": ([1e-4] * 8 + cosine(8, 5e-3), [8]),
    "jump that dwarfs the rise after it": ([1e-5] * 4 + [1e-2, 1.001e-2, 1.002e-2, 1.003e-2], [4]),
    "single-step warmup to the peak": ([1e-5, 1e-3] + cosine(10, 1e-3), [1]),
    "gentle ramp, then x12 that stays": ([1e-3 * 1.5 ** t for t in range(5)] + [1.5 ** 4 * 1.2e-2] * 6, [5]),
}


@pytest.mark.parametrize("shape", list(LR_SHAPES))
def test_lr_jump_reads_the_trajectory(shape: str) -> None:
    lrs, named = LR_SHAPES[shape]
    found = LrJump()(CachedRun(ScalarsRun({"lr": lrs, "loss": [1.0] * len(lrs)})))
    assert [f.step for f in found] == named, [f.message for f in found]


# -- the objective ----------------------------------------------------------------------------------

ROLE_CASES = {
    # name: (logged scalar names, run metadata, check(objective=...), the objective)
    "supervised": (["loss", "acc1"], {}, None, "loss"),
    "cleanrl PPO": (["loss", "policy_loss", "value_loss", "entropy", "approx_kl"], {}, None, None),
    "SB3 PPO": (["train/loss", "train/entropy_loss", "train/clip_fraction", "rollout/ep_rew_mean"], {}, None, None),
    "TRL PPO": (["ppo/loss/policy", "ppo/loss/value", "objective/kl"], {}, None, None),
    "dcgan D": (["loss", "D_x", "D_G_z1"], {}, None, None),
    "GAN named losses": (["d_loss", "g_loss"], {}, None, None),
    "DPO keeps its loss": (["loss", "rewards/chosen", "rewards/margins"], {}, None, "loss"),
    "declared at record time": (["loss", "entropy", "policy_loss"], {"user": {"objective": "policy_loss"}}, None,
                                "policy_loss"),
    "declared none at record time": (["loss"], {"user": {"objective": None}}, None, None),
    "declared to check": (["loss", "entropy"], {}, "loss", "loss"),
    "check overrides the record": (["loss", "val"], {"user": {"objective": "val"}}, "loss", "loss"),
    "declared none to check": (["loss"], {}, False, None),
}


@pytest.mark.parametrize("case", list(ROLE_CASES))
def test_objective_of_a_run(case: str) -> None:
    names, meta, declared, want = ROLE_CASES[case]
    run = CachedRun(ScalarsRun({n: [1.0] * 25 for n in names}, meta), objective=declared)
    assert objective(run).name == want


def test_loss_not_decreasing_follows_the_objective() -> None:
    rising = [1.0 + 0.01 * t for t in range(30)]
    rl = ScalarsRun({"loss": rising, "entropy": rising})
    found = LossNotDecreasing()(CachedRun(rl))
    assert [(f.severity, f.step) for f in found] == [(Severity.INFO, None)] and "entropy" in found[0].message
    assert [f.severity for f in LossNotDecreasing()(CachedRun(rl, objective="loss"))] == [Severity.WARNING]
    assert LossNotDecreasing()(CachedRun(rl, objective=False)) == []  # declared: silent
    assert [f.tensor for f in LossNotDecreasing(scalar="entropy")(CachedRun(rl))] == ["entropy"]  # configured
    with pytest.raises(ConfigError, match="objective must be the name of a logged scalar"):
        stepdump.check(stepdump.types.Run.__new__(stepdump.types.Run), objective=3)  # type: ignore[arg-type]


# -- the causal order of NaN scalars --------------------------------------------------------------------

NAN_ORDER = {
    # scalars logged NaN at step 5 (by name) -> the one named first
    "loss and grad_norm": (["grad_norm", "loss"], "loss"),
    "loss, a metric, grad_norm": (["acc", "grad_norm", "loss"], "loss"),
    "grad_norm alone": (["grad_norm"], "grad_norm"),
    "a component loss before a metric": (["acc", "aux_loss"], "aux_loss"),
    "the declared objective first": (["loss", "policy_loss"], "policy_loss"),
}


@pytest.mark.parametrize("case", list(NAN_ORDER))
def test_nan_scalars_in_causal_order(case: str) -> None:
    nans, first = NAN_ORDER[case]
    scalars = {n: [1.0] * 5 + [math.nan] * 3 for n in nans}
    scalars.setdefault("loss", [1.0] * 8)
    run = ScalarsRun(scalars)
    run.kinds = lambda: []  # type: ignore[method-assign]
    run.stats = lambda *a, **k: pd.DataFrame()  # type: ignore[method-assign]
    found = NanInf()(CachedRun(run, objective="policy_loss" if "declared" in case else None))
    assert [(f.step, f.tensor) for f in found] == [(5, first)]


# -- sparse by construction, in recorded runs -------------------------------------------------------------


class Bag(nn.Module):
    """An input embedding of 200 rows (8 looked up per batch) and a head; the kinds of sparse grads."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.table: nn.Module = nn.EmbeddingBag(200, 8) if kind == "bag" else nn.Embedding(200, 8)
        self.head = nn.Linear(8, 1)
        self.kind = kind

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.table(ids) if self.kind == "bag" else self.table(ids).mean(1)
        return self.head(h)


@pytest.mark.parametrize("kind", ["embedding", "bag", "pruned"])
@pytest.mark.parametrize("mode", ["full", "lean"])
def test_sparse_by_construction_grads_are_not_dead_units(tmp_path: Path, kind: str, mode: str) -> None:
    torch.manual_seed(0)
    if kind == "pruned":  # torch.nn.utils.prune: weight_orig is the param, weight_mask zeroes 95% of it
        model: nn.Module = nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 1))
        torch.nn.utils.prune.random_unstructured(model[0], "weight", amount=0.95)
        batch: Any = lambda t: (torch.randn(16, 40, generator=torch.Generator().manual_seed(t)), torch.zeros(16, 1))
        grad_name = "0.weight_orig"
    else:
        model = Bag(kind)
        batch = lambda t: (torch.randint(0, 200, (2, 4), generator=torch.Generator().manual_seed(t)),  # noqa: E731
                           torch.zeros(2, 1))
        grad_name = "table.weight"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lean = {"every": None, "stats_every": 1} if mode == "lean" else {}
    record_run(tmp_path / "run", steps=14, model=model, opt=opt, batch=batch, **lean)
    with stepdump.open(tmp_path / "run") as run:
        zf = run.stats("grads", name=grad_name)["zero_frac"]
        assert (zf > 0.9).all()  # the shape: most of the gradient is exactly zero, every step
        found = stepdump.check(run, rules=["dead_units"], config={"dead_units": {"exclude": ()}})
    assert found == [], [f.message for f in found]


def test_unchanged_causes_are_one_finding_each(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen, in the optimizer: INFO
    forgotten = [model[2].bias, model[4].bias]  # have grads, in no group: WARNING
    opt = torch.optim.Adam([p for p in model.parameters() if all(p is not q for q in forgotten)], lr=1e-2)
    record_run(tmp_path / "run", steps=8, model=model, opt=opt,
               batch=lambda t: (torch.randn(16, 8, generator=torch.Generator().manual_seed(t)), torch.zeros(16, 1)))
    found = stepdump.check(tmp_path / "run", rules=["unchanged_tensor"])
    got = {(f.severity, tuple(sorted(f.tensors or (f.tensor,)))) for f in found}
    assert got == {(Severity.INFO, ("0.bias", "0.weight")), (Severity.WARNING, ("2.bias", "4.bias"))}
    assert np.all([("never had a gradient" in f.message) == (f.severity == Severity.INFO) for f in found])


def test_cli_check_takes_the_objective(cli: Any, tmp_path: Path) -> None:
    rising = [1.0 + 0.05 * t for t in range(25)]
    record_run(tmp_path / "run", steps=25, log=lambda t, loss: {"loss": rising[t], "entropy": 0.5})
    rows = lambda *more: cli("check", tmp_path / "run", "--rules", "loss_not_decreasing", *more,  # noqa: E731
                             ok=None).stdout.splitlines()[1:]
    assert [r.split("\t")[:2] for r in rows()] == [["info", "loss_not_decreasing"]]  # looks like RL: not judged
    judged = rows("--objective", "loss")
    assert [r.split("\t")[:2] for r in judged] == [["warning", "loss_not_decreasing"]]
    assert "loss did not decrease" in judged[0]
    assert rows("--objective", "none") == []
