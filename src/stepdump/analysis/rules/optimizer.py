"""Optimizer-state rule: ``optimizer_state`` (Adam's eps swamps its second moment)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
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
            root = _root_vmax(rows, counts, param, beta2)
            if root is None:
                continue
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


def _root_vmax(rows: pd.DataFrame, counts: _StepCounts, param: str, beta2: float | None) -> pd.Series | None:
    """sqrt of one state tensor's largest element by step, bias-corrected with ``beta2`` and
    its parameter's step count where given; finite rows with a positive max only (None: none)."""
    ok = (nonfinite(rows) == 0).to_numpy()
    steps = rows["step"].to_numpy()[ok]
    vmax = rows["max"].to_numpy(dtype=float)[ok]
    order = np.argsort(steps, kind="stable")
    steps, vmax = steps[order], vmax[order]
    keep = ~np.isnan(vmax) & (vmax > 0)
    steps, vmax = steps[keep], vmax[keep]
    if steps.size > 1 and not (np.diff(steps) > 0).all():
        return _root_vmax_frames(rows, counts, param, beta2)  # a repeated step: as the frames align it
    if not steps.size:
        return None
    if beta2 is not None:
        n = counts.at(param, steps)
        if n is None:
            return _root_vmax_frames(rows, counts, param, beta2)
        corr = 1 - beta2 ** n
        with np.errstate(invalid="ignore", divide="ignore"):
            adj = vmax / np.where(corr > 0, corr, np.nan)
        vmax = np.where(np.isnan(adj), vmax, adj)
    return pd.Series(np.power(vmax, 0.5), index=pd.Index(steps, name="step"), name="max")


def _root_vmax_frames(rows: pd.DataFrame, counts: _StepCounts, param: str, beta2: float | None) -> pd.Series | None:
    """:func:`_root_vmax` with frames, for rows whose steps repeat (what they align on decides)."""
    rows = rows[nonfinite(rows) == 0].sort_values("step")
    vmax = rows.set_index("step")["max"].astype(float).dropna()
    vmax = vmax[vmax > 0]
    if vmax.empty:
        return None
    if beta2 is not None:
        n = counts.get(param, pd.Series(dtype=float)).reindex(vmax.index)
        corr = 1 - beta2 ** n
        vmax = (vmax / corr.where(corr > 0)).fillna(vmax)
    return vmax.pow(0.5)


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

    def at(self, param: str, steps: np.ndarray) -> np.ndarray | None:
        """``get(param).reindex(steps)`` as an array (NaN: no count at that step); None where the
        count's steps repeat (the Series' reindex decides then)."""
        name = self._names.get(param)
        if name is None:
            return np.full(steps.size, np.nan)
        rows = name_rows(self._run, "optimizer", name)
        have = rows["step"].to_numpy()
        values = rows["max"].to_numpy(dtype=float)
        order = np.argsort(have, kind="stable")
        have, values = have[order], values[order]
        if have.size > 1 and not (np.diff(have) > 0).all():
            return None
        at = np.searchsorted(have, steps)
        found = at < have.size
        found[found] = have[at[found]] == steps[found]
        out = np.full(steps.size, np.nan)
        out[found] = values[at[found]]
        return out


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
