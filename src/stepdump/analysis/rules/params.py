"""Parameter rules: ``unchanged_tensor``, ``weight_norm_growth``, ``update_ratio``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd
import torch

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._series import (
    fmt,
    matches,
    ndim,
    nonfinite,
    optimized_params,
    param_hypers,
    skipped_steps,
)
from stepdump.analysis.rules.base import (
    Rule,
    check_globs,
    check_int,
    check_positive,
    register_rule,
)
from stepdump.errors import ConfigError


def _params(run: Any) -> pd.DataFrame:
    if "params" not in run.kinds():
        return pd.DataFrame(columns=["step", "kind", "name", "shape", "norm", "nan", "posinf", "neginf",
                                     "fingerprint"])
    return run.stats("params")


@register_rule
@dataclass(frozen=True, kw_only=True)
class UnchangedTensor(Rule):
    """A parameter the optimizer steps that never changes: frozen by mistake.

    A parameter counts as optimized when it is in an optimizer param group or
    has grads or optimizer state in the run. If its fingerprint (a hash of its
    exact bytes) is the same at every one of at least ``min_steps`` recorded
    steps, and at least one of those steps was a real (not skipped) update,
    one WARNING names it. The message says why when the run shows it: lr 0 in
    its param group, or a gradient that is always zero or missing.

    Attributes:
        min_steps: Recorded steps needed before a parameter can be called unchanged.
    """

    name: ClassVar[str] = "unchanged_tensor"
    min_steps: int = 3

    def __post_init__(self) -> None:
        check_int(self.name, "min_steps", self.min_steps, 2)

    def __call__(self, run: Any) -> list[Finding]:
        params = _params(run)
        if params.empty:
            return []
        optimized = optimized_params(run)
        skipped = skipped_steps(run)
        grads = run.stats("grads") if "grads" in run.kinds() else None
        hypers: dict[str, dict[str, Any]] | None = None
        out = []
        for name, rows in params.groupby("name", sort=False):
            if name not in optimized or len(rows) < self.min_steps or rows["fingerprint"].nunique() != 1:
                continue
            steps = sorted(int(s) for s in rows["step"])
            if all(s in skipped for s in steps[:-1]):
                continue
            if hypers is None:
                hypers = param_hypers(run)
            why = _why_unchanged(str(name), grads, hypers.get(str(name), {}))
            out.append(self.finding(
                Severity.WARNING, steps[0],
                f"param {name!r} is stepped by the optimizer but is bitwise identical at all {len(steps)} recorded "
                f"steps ({steps[0]}-{steps[-1]}){why}; frozen by mistake? If it is meant to be frozen, leave it "
                "out of the optimizer",
                kind="params", tensor=str(name), value=len(steps), threshold=self.min_steps,
            ))
        return out


def _why_unchanged(name: str, grads: pd.DataFrame | None, hyper: dict[str, Any]) -> str:
    lr = hyper.get("lr")
    if isinstance(lr, (int, float)) and lr == 0:
        return ": its param group has lr=0"
    if grads is None:
        return ""
    g = grads[grads["name"] == name]
    if g.empty:
        return ": it never has a gradient (requires_grad off, or unused in the forward pass)"
    if (g["norm"].fillna(0) == 0).all() and (nonfinite(g) == 0).all():
        return ": its gradient is always zero"
    return ""


@register_rule
@dataclass(frozen=True, kw_only=True)
class WeightNormGrowth(Rule):
    """A weight's L2 norm grows by more than ``factor`` over the run.

    Compares each parameter's norm at every recorded step with its norm at
    its first recorded step; the first step where the ratio passes ``factor``
    gives a WARNING. Only tensors with at least ``min_dims`` dimensions are
    examined (by default weight matrices: biases and norm scales often start
    at or near zero, so a ratio to their start means little). Steady growth
    suggests missing weight decay or a learning rate too high.

    Attributes:
        factor: Allowed growth of the norm relative to the first recorded step.
        min_dims: Fewest dimensions a parameter needs to be examined.
        names: Globs of parameter names examined.
    """

    name: ClassVar[str] = "weight_norm_growth"
    factor: float = 10.0
    min_dims: int = 2
    names: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        check_positive(self.name, "factor", self.factor)
        if self.factor <= 1:
            raise ConfigError(f"{self.name}: factor must be > 1 (a growth factor), got {self.factor}")
        check_int(self.name, "min_dims", self.min_dims, 0)
        check_globs(self.name, "names", self.names)

    def __call__(self, run: Any) -> list[Finding]:
        params = _params(run)
        out = []
        for name, rows in params.groupby("name", sort=False):
            if not matches(str(name), self.names) or ndim(rows["shape"].iloc[0]) < self.min_dims:
                continue
            rows = rows[nonfinite(rows) == 0].sort_values("step")
            norms = rows.set_index("step")["norm"].dropna().astype(float)
            if len(norms) < 2 or norms.iloc[0] <= 0:
                continue
            ratio = norms / norms.iloc[0]
            over = ratio[ratio > self.factor]
            if over.empty:
                continue
            s = int(over.index[0])
            out.append(self.finding(
                Severity.WARNING, s,
                f"param {name!r}: norm {fmt(norms[s])} at step {s} is {fmt(ratio[s])}x its norm "
                f"{fmt(norms.iloc[0])} at step {int(norms.index[0])} (limit {fmt(self.factor)}x; "
                f"{fmt(ratio.iloc[-1])}x at the last step). Weight decay missing, or the learning rate too high?",
                kind="params", tensor=str(name), value=ratio[s], threshold=self.factor,
            ))
        return out


@register_rule
@dataclass(frozen=True, kw_only=True)
class UpdateRatio(Rule):
    """Relative size of each update, ``||p[t+1] - p[t]|| / ||p[t]||``, out of ``[lo, hi]``.

    Measured from the stored values of consecutive full steps (t not skipped),
    read lazily. To stay fast on long runs at most ``max_pairs`` pairs are read:
    the half whose norm change ``| ||p[t+1]|| - ||p[t]|| | / ||p[t]||`` (a lower
    bound of the ratio, known from the stats alone) is largest, the rest spread
    evenly over the run. Every stats step is also screened with that lower
    bound, so an update too large is caught even at steps not stored in full.

    Per parameter: a WARNING at the first step whose ratio is above ``hi`` (the
    update rewrites a large part of the weight: learning rate too high), and a
    WARNING when the median nonzero ratio is below ``lo`` (updates lost to float
    rounding or a learning rate far too low). Ratios of exactly 0 (no change) are
    ``unchanged_tensor``'s business. Only tensors with at least ``min_dims``
    dimensions are examined (weights; biases start near zero).

    Attributes:
        lo: Smallest healthy median update ratio.
        hi: Largest healthy update ratio at any step.
        min_dims: Fewest dimensions a parameter needs to be examined.
        max_pairs: Most pairs of consecutive full steps read.
        names: Globs of parameter names examined.
    """

    name: ClassVar[str] = "update_ratio"
    lo: float = 1e-7
    hi: float = 0.1
    min_dims: int = 2
    max_pairs: int = 32
    names: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        check_positive(self.name, "lo", self.lo)
        check_positive(self.name, "hi", self.hi)
        if self.lo >= self.hi:
            raise ConfigError(f"{self.name}: lo ({self.lo}) must be below hi ({self.hi})")
        check_int(self.name, "min_dims", self.min_dims, 0)
        check_int(self.name, "max_pairs", self.max_pairs, 0)
        check_globs(self.name, "names", self.names)

    def __call__(self, run: Any) -> list[Finding]:
        params = _params(run)
        if params.empty:
            return []
        optimized = optimized_params(run)
        shapes = params.groupby("name", sort=False)["shape"].first()
        names = [str(n) for n, sh in shapes.items()
                 if n in optimized and matches(str(n), self.names) and ndim(sh) >= self.min_dims]
        if not names:
            return []
        skipped = skipped_steps(run)
        bound = _norm_change(params[params["name"].isin(names)], skipped)
        measured = self._measure(run, names, skipped, bound)
        out = []
        for name in names:
            out.extend(self._judge(name, measured.get(name, {}), bound.get(name, pd.Series(dtype=float))))
        return out

    def _measure(self, run: Any, names: list[str], skipped: set[int],
                 bound: dict[str, pd.Series]) -> dict[str, dict[int, float]]:
        full = run.steps
        fullset = set(full)
        pairs = [t for t in full if t + 1 in fullset and t not in skipped]
        pairs = _choose_pairs(pairs, bound, self.max_pairs)
        out: dict[str, dict[int, float]] = {n: {} for n in names}
        cache: dict[tuple[str, int], torch.Tensor] = {}
        for t in pairs:
            for name in names:
                try:
                    a = cache.pop((name, t), None)
                    a = run.tensor(name, t, "params") if a is None else a
                    b = run.tensor(name, t + 1, "params")
                except KeyError:  # not stored at one of the two steps
                    continue
                cache[(name, t + 1)] = b
                a64, b64 = a.detach().double(), b.detach().double()
                den = float(torch.linalg.vector_norm(a64))
                if den > 0 and math.isfinite(den):
                    r = float(torch.linalg.vector_norm(b64 - a64)) / den
                    if math.isfinite(r):
                        out[name][t] = r
            cache = {k: v for k, v in cache.items() if k[1] == t + 1}
        return out

    def _judge(self, name: str, ratios: dict[int, float], bound: pd.Series) -> list[Finding]:
        out = []
        big = {t: r for t, r in ratios.items() if r > self.hi}
        big_bound = {int(t): float(r) for t, r in bound.items() if r > self.hi and int(t) not in ratios}
        if big or big_bound:
            s = min([*big, *big_bound])
            measured = s in big
            r = big[s] if measured else big_bound[s]
            n = len(big) + len(big_bound)
            out.append(self.finding(
                Severity.WARNING, s,
                f"param {name!r}: update {s} changed it by {'' if measured else 'at least '}{fmt(r)} of its norm "
                f"(above hi={fmt(self.hi)}; {n} step(s) above in all). The learning rate is too high for this "
                "tensor at that step",
                kind="params", tensor=name, value=r, threshold=self.hi,
            ))
        nonzero = {t: r for t, r in ratios.items() if r > 0}
        if nonzero:
            med = float(pd.Series(nonzero).median())
            if med < self.lo:
                s = min(t for t, r in nonzero.items() if r < self.lo)
                out.append(self.finding(
                    Severity.WARNING, s,
                    f"param {name!r}: median update ratio {fmt(med)} over {len(nonzero)} measured steps is below "
                    f"lo={fmt(self.lo)} (first at step {s}); updates this small are lost to rounding: the learning "
                    "rate or the gradients are far too small",
                    kind="params", tensor=name, value=med, threshold=self.lo,
                ))
        return out


def _norm_change(params: pd.DataFrame, skipped: set[int]) -> dict[str, pd.Series]:
    """Per name: | ||p[t+1]|| - ||p[t]|| | / ||p[t]|| for consecutive stats steps t, t+1 (t not skipped)."""
    out: dict[str, pd.Series] = {}
    for name, rows in params.groupby("name", sort=False):
        norms = rows[nonfinite(rows) == 0].set_index("step")["norm"].astype(float).sort_index()
        nxt = norms.reindex(norms.index + 1)
        nxt.index = norms.index
        lb = ((nxt - norms).abs() / norms.where(norms > 0)).dropna()
        out[str(name)] = lb[~lb.index.isin(list(skipped))]
    return out


def _choose_pairs(pairs: list[int], bound: dict[str, pd.Series], budget: int) -> list[int]:
    """At most ``budget`` pairs: half with the largest norm change, the rest evenly spaced."""
    if len(pairs) <= budget:
        return pairs
    if budget == 0:
        return []
    score = pd.concat(list(bound.values()), axis=1).max(axis=1) if bound else pd.Series(dtype=float)
    score = score.reindex(pairs).fillna(0.0)
    chosen = set(score.sort_values(ascending=False, kind="stable").index[: budget // 2].astype(int))
    rest = [t for t in pairs if t not in chosen]
    k = budget - len(chosen)
    if k > 0 and rest:
        stride = len(rest) / k
        chosen.update(rest[min(len(rest) - 1, int(i * stride))] for i in range(k))
    return sorted(chosen)
