"""Loss rules: ``loss_spike`` and ``loss_not_decreasing``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._damage import loss_damage
from stepdump.analysis.rules._frames import episodes, fmt, robust_z
from stepdump.analysis.rules._roles import check_scalar_option, objective
from stepdump.analysis.rules.base import (
    Rule,
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
    register_rule,
)
from stepdump.analysis.rules.lr import lr_cause
from stepdump.errors import ConfigError


def loss_series(run: Any, scalar: str) -> pd.Series:
    """The finite values of scalar ``scalar`` by step (NaN/Inf are ``nan_inf``'s business)."""
    sc = run.scalars()
    if scalar not in sc.columns:
        return pd.Series(dtype=float, name=scalar)
    v = pd.to_numeric(sc[scalar], errors="coerce").astype(float)
    return v[np.isfinite(v)]


def _check_scalar_name(rule: str, value: Any) -> None:
    check_scalar_option(rule, "scalar", value)


@register_rule
@dataclass(frozen=True, kw_only=True)
class LossSpike(Rule):
    """The loss jumps far above its recent values.

    Robust z-score of each logged value against the ``window`` values before
    it: ``z = (x - median) / max(1.4826 * MAD, floor)``. A step with ``z > z``
    (upward jumps only, once ``min_history`` earlier values exist) is flagged;
    consecutive flagged steps give one finding at the first: WARNING, or ERROR
    when the loss goes up by an order of magnitude or turns NaN/Inf within
    ten steps. ``1.4826 * MAD``
    estimates the standard deviation of normal noise, so z=6 is a six-sigma
    jump. The scalar judged is the run's objective (:mod:`._roles`) unless
    ``scalar`` names one; a run with no objective (RL, a GAN) is not judged.

    The test runs on ``log(loss)`` when every value is positive (``log_scale``
    None, the default): mini-batch loss noise is multiplicative and skewed to
    the right (a batch of hard examples), and on a linear scale healthy runs
    with small batches reach z of 8-10, while on a log scale they stay near 3.
    ``rel_floor`` is the smallest noise scale, as a relative change (0.01: a
    loss that is flat to 1% needs a jump of ~6% to count).

    Attributes:
        scalar: Name of the logged loss scalar (None: the run's objective).
        z: Robust z-score above which a step is a spike.
        window: Logged values before a step that form its baseline.
        min_history: Values needed before the test applies.
        rel_floor: Lower bound of the noise scale, relative.
        log_scale: True: test log(loss); False: the loss itself; None: log when all values are > 0.
    """

    name: ClassVar[str] = "loss_spike"
    scalar: str | None = None
    z: float = 6.0
    window: int = 50
    min_history: int = 10
    rel_floor: float = 0.01
    log_scale: bool | None = None

    def __post_init__(self) -> None:
        _check_scalar_name(self.name, self.scalar)
        check_positive(self.name, "z", self.z)
        check_int(self.name, "window", self.window, 2)
        check_int(self.name, "min_history", self.min_history, 2)
        check_non_negative(self.name, "rel_floor", self.rel_floor)
        if self.log_scale not in (None, True, False):
            raise ConfigError(f"{self.name}: log_scale must be True, False or None, got {self.log_scale!r}")

    def __call__(self, run: Any) -> list[Finding]:
        scalar = self.scalar if self.scalar is not None else objective(run).name
        if scalar is None:
            return []
        loss = loss_series(run, scalar)
        if len(loss) <= self.min_history:
            return []
        positive = bool((loss > 0).all())
        if self.log_scale and not positive:
            raise ConfigError(f"{self.name}: log_scale=True but {scalar!r} has values <= 0; use log_scale=False")
        log = positive if self.log_scale is None else self.log_scale
        zs = robust_z(loss, self.window, self.min_history, self.rel_floor, log=log)
        flagged = [int(s) for s in zs.index[zs["z"] > self.z]]
        out = []
        for ep in episodes(flagged, [int(s) for s in loss.index]):
            s = ep[0]
            peak = max(ep, key=lambda t: loss[t])
            span = f"; elevated for {len(ep)} steps, peak {fmt(loss[peak])} at step {peak}" if len(ep) > 1 else ""
            # An order of magnitude above the level (or NaN/Inf right after) is damage, not noise: ERROR.
            damage = loss_damage(run, s, scalar)
            cause = lr_cause(run, s)
            todo = ("Fix the lr at the step lr_jump names" if cause else
                    f"Look at the batch of step {s} (record inputs, or rec.log_batch), the learning rate and the "
                    "gradient norm of the steps before")
            out.append(self.finding(
                damage.severity(), s,
                f"{scalar} spikes to {fmt(loss[s])} at step {s} (median of the previous {self.window} values "
                f"{fmt(zs['median'][s])}, robust z={fmt(zs['z'][s])} > {fmt(self.z)}{' on a log scale' if log else ''})"
                f"{span}{damage.text}{cause}. {todo}",
                kind=None, tensor=scalar, value=zs["z"][s], threshold=self.z,
            ))
        return out


@register_rule
@dataclass(frozen=True, kw_only=True)
class LossNotDecreasing(Rule):
    """Over the run, the loss did not go down.

    Compares the median of the last ``frac`` of the logged loss values with the
    median of the first ``frac``; a WARNING (a whole-run finding, step None)
    when ``median_last >= median_first * (1 - min_decrease)``. Needs at least
    ``min_steps`` logged values; medians make it robust to noisy batches.

    The scalar judged is the run's objective (:mod:`._roles`: declared with
    ``check(objective=...)`` or at record time, else ``"loss"``) unless ``scalar``
    names one. A run with no objective is not judged: one INFO says why when that
    was inferred (the scalars it logs mark it as RL or a GAN, whose losses are not
    expected to fall), nothing when it was declared.

    Attributes:
        scalar: Name of the logged loss scalar (None: the run's objective).
        frac: Fraction of the values at each end that is compared.
        min_steps: Logged values needed for the test.
        min_decrease: Relative decrease required (0: any decrease passes).
    """

    name: ClassVar[str] = "loss_not_decreasing"
    scalar: str | None = None
    frac: float = 0.2
    min_steps: int = 20
    min_decrease: float = 0.0

    def __post_init__(self) -> None:
        _check_scalar_name(self.name, self.scalar)
        check_fraction(self.name, "frac", self.frac)
        if self.frac > 0.5:
            raise ConfigError(f"{self.name}: frac must be <= 0.5 (the two ends must not overlap), got {self.frac}")
        check_int(self.name, "min_steps", self.min_steps, 2)
        check_fraction(self.name, "min_decrease", self.min_decrease, open_low=False)

    def __call__(self, run: Any) -> list[Finding]:
        scalar = self.scalar
        if scalar is None:
            obj = objective(run)
            if obj.name is None:
                return [] if obj.declared else self._not_judged(run, obj.why)
            scalar = obj.name
        loss = loss_series(run, scalar)
        n = len(loss)
        if n < self.min_steps:
            return []
        k = max(1, math.floor(n * self.frac))
        first, last = float(loss.iloc[:k].median()), float(loss.iloc[-k:].median())
        limit = first * (1 - self.min_decrease) if first >= 0 else first * (1 + self.min_decrease)
        if last < limit:
            return []
        steps = [int(s) for s in loss.index]
        return [self.finding(
            Severity.WARNING, None,
            f"{scalar} did not decrease: median {fmt(last)} over steps {steps[-k]}-{steps[-1]} vs {fmt(first)} "
            f"over steps {steps[0]}-{steps[k - 1]}. Check the learning rate (too low or too high), that the "
            "optimizer steps the model's parameters, and the labels",
            kind=None, tensor=scalar, value=last, threshold=limit,
        )]

    def _not_judged(self, run: Any, why: str) -> list[Finding]:
        logged = [c for c in run.scalars().columns if c != "skipped" and "loss" in c.lower()]
        if not logged:
            return []
        return [self.finding(
            Severity.INFO, None,
            f"not judged: {why}. To judge one, declare it: stepdump.check(run, objective=NAME) or "
            "Recorder(..., metadata={'objective': NAME})",
            kind=None, tensor=logged[0],
        )]
