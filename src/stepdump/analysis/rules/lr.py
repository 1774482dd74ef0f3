"""``lr_jump``: the learning rate at a step is many times what it is around it."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._damage import loss_damage
from stepdump.analysis.rules._frames import fmt, times
from stepdump.analysis.rules.base import Rule, check_globs, check_positive, register_rule
from stepdump.errors import ConfigError

# The Recorder logs the lr of param group 0 as "lr", of group i as "lr/i".
LR_SCALARS = ("lr", "lr/*")


@dataclass(frozen=True)
class LrEvent:
    """One lr anomaly at one step, over every lr scalar that shows it."""

    step: int
    spike: bool  # True: above both neighbours; False: a jump up that stays
    ratio: float  # the largest over the scalars: lr / max(neighbours), or lr / previous lr
    scalars: tuple[str, ...]
    value: float  # lr at the step, of the first scalar
    before: tuple[int, float]  # (step, lr) of the previous recorded step
    after: tuple[int, float] | None  # (step, lr) of the next one (spikes)
    stays: int  # jumps: recorded steps from this one on that keep the lr within factor of it


def lr_events(run: Any, factor: float = 10.0, scalars: tuple[str, ...] = LR_SCALARS) -> list[LrEvent]:
    """Steps whose lr is more than ``factor`` times that of the recorded step before it.

    A *spike* is also more than ``factor`` times the lr of the step after it;
    otherwise it is a *jump* that stays. Jumps from an lr of 0 (warmup) and to
    an lr no higher than one the run had before (a warm restart) are left out:
    schedules do that on purpose. Drops are left out too (decay is the norm).
    """
    sc = run.scalars()
    cols = [c for c in sc.columns if c != "skipped" and any(fnmatch.fnmatchcase(c, g) for g in scalars)]
    found: dict[tuple[int, bool], list[tuple[str, float, LrEvent]]] = {}
    for col in cols:
        v = pd.to_numeric(sc[col], errors="coerce").astype(float)
        v = v[np.isfinite(v) & (v >= 0)].sort_index()
        steps, vals = [int(s) for s in v.index], v.to_numpy()
        if len(vals) < 2:
            continue
        high = np.maximum.accumulate(vals)[:-1]  # the largest lr before each step from the second on
        prev, cur = vals[:-1], vals[1:]
        for i in np.flatnonzero((prev > 0) & (cur > factor * prev)) + 1:
            x, before = vals[i], vals[i - 1]
            nxt = vals[i + 1] if i + 1 < len(vals) else None
            spike = nxt is not None and x > factor * max(before, nxt)
            if not spike and x <= high[i - 1] * (1 + 1e-9):
                continue  # back to an lr the run already had: a warm restart
            ratio = x / max(before, nxt) if spike and nxt is not None else x / before
            stays = 0 if spike else int(np.argmax(np.append(vals[i:] * factor < x, True)))
            ev = LrEvent(steps[i], spike, float(ratio), (col,), float(x), (steps[i - 1], float(before)),
                         (steps[i + 1], float(nxt)) if spike and nxt is not None else None, stays)
            found.setdefault((steps[i], spike), []).append((col, float(ratio), ev))
    out = []
    for _, hits in sorted(found.items()):
        first = hits[0][2]
        out.append(LrEvent(first.step, first.spike, max(r for _, r, _ in hits), tuple(c for c, _, _ in hits),
                           first.value, first.before, first.after, first.stays))
    return out


def lr_cause(run: Any, step: int, lookback: int = 2) -> str:
    """A clause naming an lr spike or jump at ``step`` or up to ``lookback`` steps before, or ""."""
    for ev in reversed(lr_events(run)):
        if step - lookback <= ev.step <= step:
            what = "spike" if ev.spike else "jump"
            return f"; it follows the lr {what} at step {ev.step} ({times(ev.ratio)}, see lr_jump)"
    return ""


@register_rule
@dataclass(frozen=True, kw_only=True)
class LrJump(Rule):
    """The learning rate at a step is ``factor`` or more times what it is around it.

    Reads the lr the Recorder logs for each param group (``lr``, ``lr/1``, ...).
    A *spike*: the lr at step k is more than ``factor`` times the lr at both
    neighbouring recorded steps (a one-step mistake: a param-group edit, a
    schedule bug). A *jump*: more than ``factor`` times the step before, and it
    stays. Raising the lr from 0 (warmup) or back to a value the run already had
    (warm restarts) is not a jump. One finding per step, listing the param
    groups that show it; WARNING, or ERROR when the loss then goes up by an
    order of magnitude or turns NaN/Inf.

    Attributes:
        factor: Allowed ratio of an lr to its neighbours.
        scalars: Globs of the lr scalars examined.
        loss: Name of the logged loss, read to judge the damage.
    """

    name: ClassVar[str] = "lr_jump"
    factor: float = 10.0
    scalars: tuple[str, ...] = LR_SCALARS
    loss: str = "loss"

    def __post_init__(self) -> None:
        check_positive(self.name, "factor", self.factor)
        if self.factor <= 1:
            raise ConfigError(f"{self.name}: factor must be > 1 (a ratio of learning rates), got {self.factor}")
        check_globs(self.name, "scalars", self.scalars)
        if not isinstance(self.loss, str) or not self.loss:
            raise ConfigError(f"{self.name}: loss must be the name of a logged scalar, got {self.loss!r}")

    def __call__(self, run: Any) -> list[Finding]:
        out = []
        for ev in lr_events(run, self.factor, self.scalars):
            damage = loss_damage(run, ev.step, self.loss)
            groups = f" (param groups {', '.join(ev.scalars)})" if len(ev.scalars) > 1 else ""
            if ev.spike and ev.after is not None:
                what = (f"lr at step {ev.step} is {times(ev.ratio)} its neighbours{groups}: {fmt(ev.value)} against "
                        f"{fmt(ev.before[1])} at step {ev.before[0]} and {fmt(ev.after[1])} at step {ev.after[0]}")
                todo = (f"Find what set the lr at step {ev.step} (a param_group edit, the scheduler, a restored "
                        "checkpoint) and fix it")
            else:
                what = (f"lr jumps {times(ev.ratio)} at step {ev.step}{groups}, from {fmt(ev.before[1])} at step "
                        f"{ev.before[0]} to {fmt(ev.value)}, and stays there for {ev.stays} recorded step(s)")
                todo = f"If the jump is not meant, fix the scheduler or whatever sets the lr at step {ev.step}"
            out.append(self.finding(
                damage.severity(), ev.step, f"{what}{damage.text}. {todo}",
                kind=None, tensor=ev.scalars[0], value=ev.ratio, threshold=self.factor, tensors=ev.scalars,
            ))
        return out
