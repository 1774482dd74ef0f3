"""``lr_jump``: the learning rate at a step is many times what it is around it."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._damage import loss_damage
from stepdump.analysis.rules._roles import check_scalar_option, damage_scalar
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
    otherwise it is a *jump* that stays. Read from the lr trajectory, three shapes
    that schedules make on purpose are left out: a rise from an lr of 0 (warmup from
    0); a rise that is one step of a *ramp* (:func:`_ramp_step`: the lr goes on rising
    after it, by steps of the same order, as a warmup from a small nonzero lr does,
    per update or in stairs per epoch); and a rise to an lr no higher than one the
    run had before (a warm restart). Drops are left out too (decay is the norm).
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
            if not spike and (x <= high[i - 1] * (1 + 1e-9) or _ramp_step(vals, int(i), factor)):
                continue  # back to an lr the run already had (a warm restart), or a warmup's step
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


# The last step of a geometric ramp may multiply the lr by up to this many times the ratio of
# the step before it (a constant ratio, with slack for rounding and a shorter last step).
RAMP_RATIO_SLACK = 2.0


def _ramp_step(vals: np.ndarray, i: int, factor: float) -> bool:
    """Whether the rise into ``vals[i]`` is one step of a ramp (a warmup), read from its neighbours.

    The trajectory is read as levels (runs of equal values: a schedule stepped per epoch
    holds each lr for many updates). The rise is a ramp's step when the ramp goes on after
    it (the next level is higher still, by a rise at least ``1/factor`` of this one: a
    linear warmup from a small lr, timm's ``warmup_lr_init`` or torchvision's
    ``LinearLR(start_factor=0.01)``, rises by equal steps, so its first step is a large
    ratio yet no larger a step than the ones after it), or when it ends a ramp that led
    up to it (the level before was itself a rise by a ratio at least half this one's: the
    last step of an exponential warmup, whose ratio is constant). A mistake is one rise out of a flat or
    falling stretch, or one that dwarfs what follows, and stays a jump.
    """
    rise = vals[i] - vals[i - 1]
    later = vals[i + 1:]
    after = later[later != vals[i]]
    if after.size and after[0] > vals[i] and after[0] - vals[i] >= rise / factor:
        return True
    earlier = vals[:i - 1]
    before = earlier[earlier != vals[i - 1]]
    if before.size and 0 < before[-1] < vals[i - 1]:
        return bool(vals[i] / vals[i - 1] <= RAMP_RATIO_SLACK * (vals[i - 1] / before[-1]))
    return False


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
    stays. Raising the lr from 0 (warmup), one step of a ramp that keeps rising
    by steps of the same order (a warmup from a small lr, per update or per
    epoch), or back to a value the run already had (warm restarts) is not a jump. One finding per step, listing the param
    groups that show it; WARNING, or ERROR when the loss then goes up by an
    order of magnitude or turns NaN/Inf.

    Attributes:
        factor: Allowed ratio of an lr to its neighbours.
        scalars: Globs of the lr scalars examined.
        loss: Name of the logged loss, read to judge the damage (None: the run's objective, else "loss").
    """

    name: ClassVar[str] = "lr_jump"
    factor: float = 10.0
    scalars: tuple[str, ...] = LR_SCALARS
    loss: str | None = None

    def __post_init__(self) -> None:
        check_positive(self.name, "factor", self.factor)
        if self.factor <= 1:
            raise ConfigError(f"{self.name}: factor must be > 1 (a ratio of learning rates), got {self.factor}")
        check_globs(self.name, "scalars", self.scalars)
        check_scalar_option(self.name, "loss", self.loss)

    def __call__(self, run: Any) -> list[Finding]:
        out = []
        for ev in lr_events(run, self.factor, self.scalars):
            damage = loss_damage(run, ev.step, damage_scalar(run, self.loss))
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
