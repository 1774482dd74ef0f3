"""Optimizer-state rule: ``optimizer_state`` (Adam's eps swamps its second moment)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._frames import (
    fmt,
    frame_names,
    name_rows,
    nonfinite,
    optimizer_param,
    param_hypers,
    sustained,
)
from stepdump.analysis.rules.base import (
    Rule,
    check_globs,
    check_int,
    check_positive,
    register_rule,
)

DEFAULT_EPS = 1e-8  # torch.optim.Adam/AdamW/RMSprop's default


@register_rule
@dataclass(frozen=True, kw_only=True)
class OptimizerState(Rule):
    """Adam-style second moment so small that ``eps`` dominates the update.

    Adam divides by ``sqrt(v_hat) + eps``. When even the largest element of
    ``v_hat`` (``exp_avg_sq`` with Adam's bias correction ``1 - beta2**step``;
    RMSprop's ``square_avg`` as is) has ``sqrt(max v_hat) < ratio * eps``, eps
    is the whole denominator: the update turns into ``lr * m / eps``, a
    momentum-SGD step scaled by 1/eps, and Adam's per-parameter scaling is
    gone. Usually the gradients are tiny (a loss scaled far down) or eps is
    too large for them. ``patience`` consecutive recorded steps give one
    WARNING per state tensor. State that is exactly zero (never a gradient)
    is left to ``unchanged_tensor``.

    ``eps`` and ``betas`` are read from the run's param groups (last full
    step); ``eps`` set here overrides that.

    Attributes:
        ratio: Fraction of eps that ``sqrt(max v_hat)`` must stay above.
        patience: Consecutive flagged steps needed for a finding.
        eps: eps to compare with (None: each param group's own, else 1e-8).
        keys: Optimizer state keys holding squared-gradient averages.
    """

    name: ClassVar[str] = "optimizer_state"
    ratio: float = 0.1
    patience: int = 5
    eps: float | None = None
    keys: tuple[str, ...] = ("exp_avg_sq", "square_avg")

    def __post_init__(self) -> None:
        check_positive(self.name, "ratio", self.ratio)
        check_int(self.name, "patience", self.patience, 1)
        if self.eps is not None:
            check_positive(self.name, "eps", self.eps)
        check_globs(self.name, "keys", self.keys)

    def __call__(self, run: Any) -> list[Finding]:
        kinds = run.kinds()
        if "optimizer" not in kinds:
            return []
        params = run.names("params") if "params" in kinds else []
        split = {n: optimizer_param(n, params) for n in frame_names(run, "optimizer")}
        if not params:  # no params recorded: fall back to "<param>.<key>" with the key last
            split = {n: tuple(n.rsplit(".", 1)) if "." in n else None for n in split}  # type: ignore[misc]
        wanted = {n: pk for n, pk in split.items() if pk is not None and pk[1] in self.keys}
        if not wanted:
            return []
        hypers = param_hypers(run)
        counts = _StepCounts(run, split)
        out = []
        for name in (n for n in split if n in wanted):  # one state tensor's rows at a time
            rows = name_rows(run, "optimizer", name)
            param, key = wanted[str(name)]
            hyper = hypers.get(param, {})
            eps = self.eps if self.eps is not None else _float(hyper.get("eps"), DEFAULT_EPS)
            beta2 = _beta2(hyper) if key == "exp_avg_sq" else None
            rows = rows[nonfinite(rows) == 0].sort_values("step")
            vmax = rows.set_index("step")["max"].astype(float).dropna()
            vmax = vmax[vmax > 0]
            if vmax.empty:
                continue
            if beta2 is not None:
                n = counts.get(param, pd.Series(dtype=float)).reindex(vmax.index)
                corr = 1 - beta2 ** n
                vmax = (vmax / corr.where(corr > 0)).fillna(vmax)
            root = vmax.pow(0.5)
            limit = self.ratio * eps
            flagged = [int(s) for s in root.index[root < limit]]
            eps_runs = sustained(flagged, [int(s) for s in root.index], self.patience)
            if not eps_runs:
                continue
            ep = eps_runs[0]
            s = ep[0]
            out.append(self.finding(
                Severity.WARNING, s,
                f"optimizer {name!r}: sqrt of its largest {key}{' (bias-corrected)' if beta2 is not None else ''} "
                f"is {fmt(root[s])} at step {s}, below {fmt(self.ratio)} x eps={fmt(eps)} for {len(ep)} recorded "
                f"steps; eps dominates the denominator, so the update is lr*m/eps, not Adam's. The gradients are "
                "tiny (loss scaled down?) or eps is too large for them",
                kind="optimizer", tensor=str(name), value=root[s], threshold=limit,
            ))
        return out


class _StepCounts:
    """Param -> its optimizer ``step`` count by step (Adam keeps it as a tensor), read when asked."""

    def __init__(self, run: Any, split: dict[str, Any]) -> None:
        self._run = run
        self._names = {pk[0]: n for n, pk in split.items() if pk is not None and pk[1] == "step"}

    def get(self, param: str, default: pd.Series) -> pd.Series:
        name = self._names.get(param)
        if name is None:
            return default
        return name_rows(self._run, "optimizer", name).set_index("step")["max"].astype(float)


def _beta2(hyper: dict[str, Any]) -> float | None:
    betas = hyper.get("betas")
    try:
        b2 = float(betas[1])  # type: ignore[index]
    except (TypeError, IndexError, ValueError):
        return 0.999 if betas is None else None  # torch's default when the run keeps no groups
    return b2 if 0 <= b2 < 1 else None


def _float(v: Any, default: float) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) and f > 0 else default
