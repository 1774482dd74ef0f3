"""How much harm a flagged step did, read from the logged loss: the severity of a finding follows it.

A gradient spike that the loss shrugs off is a warning; one after which the
loss goes up by an order of magnitude, or turns NaN/Inf, is an error. The
rules that flag a step (``exploding_gradient``, ``lr_jump``, ``loss_spike``,
``update_ratio``) ask :func:`loss_damage` about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Severity
from stepdump.analysis.rules._frames import fmt, times

# The loss rising this many times over its level before the step is damage
# worth an error: an order of magnitude, far beyond mini-batch noise.
SEVERE_RATIO = 10.0
# Steps after the flagged one in which the loss is watched (the bad update
# shows in the next step's loss; a run may take a few steps to blow up).
AFTER = 10
# Earlier loss values forming the level before the step.
BEFORE = 50


@dataclass(frozen=True)
class Damage:
    """What the loss did from a flagged step on.

    Attributes:
        severe: The loss turned non-finite, or rose at least ``SEVERE_RATIO`` times.
        text: A clause for a message (``"; the loss then went from 2.3 to 163 (70x) by step 27"``),
            empty when the loss did not visibly move or was not logged.
        ratio: Peak loss over the level before the step (NaN when unknown).
    """

    severe: bool = False
    text: str = ""
    ratio: float = math.nan

    def severity(self, base: Severity = Severity.WARNING) -> Severity:
        """``base``, raised to ERROR when the damage is severe."""
        return Severity.ERROR if self.severe else base


def loss_damage(run: Any, step: int, scalar: str = "loss") -> Damage:
    """The damage done from ``step`` on: the loss over steps ``step..step+AFTER`` against its level before.

    The level is the median of the (up to ``BEFORE``) finite values logged before
    ``step``. Values logged as NaN are read from the catalog (a NaN scalar is
    stored as NULL, so ``run.scalars()`` cannot tell it from "not logged").
    """
    sc = run.scalars()
    if scalar not in sc.columns:
        return Damage()
    v = pd.to_numeric(sc[scalar], errors="coerce").astype(float)
    window = v[(v.index >= step) & (v.index <= step + AFTER)]
    bad = [int(s) for s, x in window.items() if np.isinf(x)]
    bad += [s for s, n, _ in run.scalar_rows(nan_only=True) if n == scalar and step <= s <= step + AFTER]
    before = v[(v.index < step) & np.isfinite(v)].iloc[-BEFORE:]
    after = window[np.isfinite(window)]
    rose = ""
    ratio = math.nan
    if not before.empty and not after.empty and float(before.median()) > 0:
        level = float(before.median())
        peak_step = int(after.idxmax())
        peak = float(after[peak_step])
        ratio = peak / level
        if ratio >= 2:  # below that, within the noise of a healthy run: not worth a clause
            rose = f"from {fmt(level)} to {fmt(peak)} ({times(ratio)}) by step {peak_step}"
    if bad:
        return Damage(True, f"; the {scalar} then went {rose + ' and ' if rose else ''}non-finite at step {min(bad)}",
                      math.inf)
    if not rose:
        return Damage(ratio=ratio)
    return Damage(ratio >= SEVERE_RATIO, f"; the {scalar} then went {rose}", ratio)
