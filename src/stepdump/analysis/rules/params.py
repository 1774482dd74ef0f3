"""Parameter rules: ``weight_norm_growth``, ``update_ratio`` (``unchanged_tensor``: :mod:`.unchanged`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._damage import loss_damage
from stepdump.analysis.rules._roles import check_scalar_option, damage_scalar
from stepdump.analysis.rules._frames import (
    as_step_array,
    fmt,
    matches,
    ndim,
    nonfinite,
    optimized_params,
    skipped_steps,
    times,
)
from stepdump.analysis.rules.base import (
    check_globs,
    check_int,
    check_positive,
    register_rule,
)
from stepdump.analysis.rules._walk import TensorWalk, WalkingRule
from stepdump.analysis.rules.lr import lr_cause
from stepdump.errors import ConfigError


@register_rule
@dataclass(frozen=True, kw_only=True)
class WeightNormGrowth(WalkingRule):
    """A weight's L2 norm grows by more than ``factor`` over the run.

    Compares each parameter's norm at every recorded step with its norm at
    its first recorded step; the first step where the ratio passes ``factor``
    gives a WARNING; all such weights share one finding (``Finding.tensors``),
    at the earliest of those steps. Only tensors with at least ``min_dims`` dimensions are
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

    def walk(self, run: Any) -> TensorWalk:
        return _NormGrowthWalk(self)

    def _findings(self, grown: list[tuple[int, str, float, float, float, int]],
                  last: dict[str, float]) -> list[Finding]:
        """``grown``: (step, name, ratio, norm, first norm, first step) of each weight past ``factor``;
        ``last``: each one's ratio at its last step."""
        if not grown:
            return []
        # One cause (weight decay missing, an lr too high) grows many weights: one finding lists them.
        grown = sorted(grown, key=lambda g: (g[0], -g[2]))
        s, name, r, norm, first, first_step = grown[0]
        names = [g[1] for g in grown]
        others = ""
        if len(grown) > 1:
            worst = max(last, key=lambda n: last[n])
            others = (f"; {len(grown)} weights in all grew past {fmt(self.factor)}x ({_listed(names)}), "
                      f"the most {worst!r}: {times(last[worst])} at the last step")
        return [self.finding(
            Severity.WARNING, s,
            f"param {name!r}: norm {fmt(norm)} at step {s} is {times(r)} its norm {fmt(first)} at step {first_step} "
            f"(limit {times(self.factor)}; {times(last[name])} at the last step){others}. Weight decay missing, or the "
            "learning rate too high? Compare with the lr_jump and exploding_gradient findings at that step",
            kind="params", tensor=name, value=r, threshold=self.factor, tensors=names,
        )]


class _Growth:
    """What ``weight_norm_growth`` keeps of one weight across the pieces of its history."""

    __slots__ = ("examined", "first_step", "first", "norms", "last", "over")

    def __init__(self, examined: bool) -> None:
        self.examined = examined  # its name and first shape pass the rule's filters
        self.first_step = 0
        self.first = math.nan  # its first finite norm (nan: none yet)
        self.norms = 0  # finite norms seen
        self.last = math.nan  # its last finite norm
        self.over: tuple[int, float, float] | None = None  # the first step past factor: step, ratio, norm


class _NormGrowthWalk(TensorWalk):
    """``weight_norm_growth``'s walk: each weight's first step past ``factor``, a piece of its
    rows at a time (its first finite norm is in the first piece holding one: the pieces come in
    step order)."""

    kinds = ("params",)
    stat_columns = ("nan", "posinf", "neginf", "norm")

    def __init__(self, rule: WeightNormGrowth) -> None:
        self.rule = rule
        self.seen: dict[str, _Growth] = {}

    def visit(self, kind: str, name: str, rows: pd.DataFrame) -> None:
        rule = self.rule
        g = self.seen.get(name)
        if g is None:  # its first piece: its first row's shape
            g = self.seen[name] = _Growth(matches(str(name), rule.names)
                                          and ndim(rows["shape"].iloc[0]) >= rule.min_dims)
        if not g.examined:
            return
        rows = rows[nonfinite(rows) == 0].sort_values("step")
        norms = rows.set_index("step")["norm"].dropna().astype(float)
        if norms.empty:
            return
        if not g.norms:
            g.first_step, g.first = int(norms.index[0]), float(norms.iloc[0])
        g.norms += len(norms)
        g.last = float(norms.iloc[-1])
        if g.over is not None or g.first <= 0:
            return
        ratio = norms / g.first
        over = ratio[ratio > rule.factor]
        if not over.empty:
            s = int(over.index[0])
            g.over = (s, float(ratio[s]), float(norms[s]))

    def finish(self) -> list[Finding]:
        grown: list[tuple[int, str, float, float, float, int]] = []  # step, name, ratio, norm, first norm, first step
        last: dict[str, float] = {}
        for name, g in self.seen.items():
            if not g.examined or g.norms < 2 or g.first <= 0 or g.over is None:
                continue
            s, r, norm = g.over
            grown.append((s, name, r, norm, g.first, g.first_step))
            last[name] = float(np.float64(g.last) / np.float64(g.first))
        return self.rule._findings(grown, last)


def _listed(names: list[str], most: int = 6) -> str:
    """Names for a message: the first ``most`` quoted, then how many more (all are in ``Finding.tensors``)."""
    head = ", ".join(repr(n) for n in names[:most])
    return head if len(names) <= most else f"{head} and {len(names) - most} more"


@register_rule
@dataclass(frozen=True, kw_only=True)
class UpdateRatio(WalkingRule):
    """Relative size of each update, ``||p[t+1] - p[t]|| / ||p[t]||``, per weight.

    Measured from the stored values of consecutive full steps (t not skipped),
    read lazily. To stay fast on long runs at most ``max_pairs`` pairs are read:
    the half whose norm change ``| ||p[t+1]|| - ||p[t]|| | / ||p[t]||`` (a lower
    bound of the ratio, known from the stats alone) is largest, the rest spread
    evenly over the run. Every stats step is also screened with that lower
    bound, so a huge update is caught even at steps not stored in full.

    Three verdicts per parameter, and one finding per verdict listing every
    parameter that got it (one cause, not one finding per weight):

    * one update above ``step_hi`` (default 1: the update is larger than the
      weight itself), at the first such step: a learning-rate blow-up (ERROR
      when the loss then goes up by an order of magnitude or turns NaN/Inf,
      else WARNING);
    * the median ratio over the measured steps above ``hi``: the learning rate
      is too high for this tensor all along (single early steps of a small
      layer may pass ``hi``, hence the median);
    * the median nonzero ratio below ``lo``: updates lost to float32 rounding
      (its resolution is ~6e-8) or a learning rate far too low.

    A weight whose first recorded value is exactly zero (LoRA's ``lora_B``, a
    zero-initialised output layer) grows from nothing: its first updates are as
    large as the weight by construction. For it, an update is a blow-up only when
    it is also ``GROWTH_JUMP`` (10) times the median of its earlier updates, and
    the median verdict ``hi`` is not given.

    Ratios of exactly 0 (no change) are ``unchanged_tensor``'s business. Only
    tensors with at least ``min_dims`` dimensions are examined (weights; biases
    often start at zero, so their ratio means little).

    Attributes:
        lo: Smallest healthy median update ratio.
        hi: Largest healthy median update ratio.
        step_hi: Largest healthy ratio of a single update.
        min_dims: Fewest dimensions a parameter needs to be examined.
        max_pairs: Most pairs of consecutive full steps read.
        names: Globs of parameter names examined.
        loss: Name of the logged loss, read to judge the damage of a blow-up (None: the run's objective,
            else "loss").
    """

    name: ClassVar[str] = "update_ratio"
    lo: float = 1e-7
    hi: float = 0.1
    step_hi: float = 1.0
    min_dims: int = 2
    max_pairs: int = 32
    names: tuple[str, ...] = ("*",)
    loss: str | None = None

    def __post_init__(self) -> None:
        check_positive(self.name, "lo", self.lo)
        check_positive(self.name, "hi", self.hi)
        check_positive(self.name, "step_hi", self.step_hi)
        if not self.lo < self.hi <= self.step_hi:
            raise ConfigError(
                f"{self.name}: need lo < hi <= step_hi, got lo={self.lo}, hi={self.hi}, step_hi={self.step_hi}"
            )
        check_int(self.name, "min_dims", self.min_dims, 0)
        check_int(self.name, "max_pairs", self.max_pairs, 0)
        check_globs(self.name, "names", self.names)
        check_scalar_option(self.name, "loss", self.loss)

    def walk(self, run: Any) -> TensorWalk:
        return _UpdateRatioWalk(self, run)

    def _findings(self, run: Any, names: list[str], kept: dict[str, tuple[pd.Series, pd.Series | None]],
                  score: pd.Series) -> list[Finding]:
        """The verdicts once the walk is done: ``names`` the weights examined, ``kept`` what judging
        each needs (:class:`_UpdateRatioWalk`), ``score`` each step's largest norm change."""
        if not names:
            return []
        skipped = skipped_steps(run)
        full = set(run.steps)
        pairs = [t for t in sorted(full) if t + 1 in full and t not in skipped]
        pairs, spread = _choose_pairs(pairs, score, self.max_pairs)
        measured = _measure(run, names, pairs)
        verdicts: dict[str, list[_Verdict]] = {"blow_up": [], "high": [], "low": []}
        for name in names:
            bound, norms = kept[name]
            ratios = measured.get(name, {})
            typical = {t: r for t, r in ratios.items() if t in spread}
            for v in self._judge(name, ratios, typical, bound, norms):
                verdicts[v.what].append(v)
        return [f for what, vs in verdicts.items() if vs for f in [self._grouped(run, what, vs)]]

    def _judge(self, name: str, ratios: dict[int, float], typical: dict[int, float],
               bound: pd.Series, norms: pd.Series | None) -> list[_Verdict]:
        """Verdicts for one tensor: ``ratios`` all measured, ``typical`` the evenly spread ones;
        ``norms`` its norm by step when it started at exactly zero (else None)."""
        out = []
        big = {t: r for t, r in ratios.items() if r > self.step_hi}
        big_bound = {int(t): float(r) for t, r in bound.items() if r > self.step_hi and int(t) not in ratios}
        if norms is not None:  # grown from zero: a large ratio is its growth; judge updates by each other
            keep = _outgrown(ratios, bound, norms)
            big = {t: r for t, r in big.items() if t in keep}
            big_bound = {t: r for t, r in big_bound.items() if t in keep}
        if big or big_bound:
            s = min([*big, *big_bound])
            measured = s in big
            out.append(_Verdict("blow_up", name, s, big[s] if measured else big_bound[s], not measured,
                                len(big) + len(big_bound)))
        nonzero = {t: r for t, r in typical.items() if r > 0}
        if not nonzero:
            return out
        med = float(pd.Series(nonzero).median())
        if med > self.hi and norms is None:  # from zero, every update is large against the weight
            s = min(t for t, r in nonzero.items() if r > self.hi)
            out.append(_Verdict("high", name, s, med, False, len(nonzero)))
        elif med < self.lo:
            s = min(t for t, r in nonzero.items() if r < self.lo)
            out.append(_Verdict("low", name, s, med, False, len(nonzero)))
        return out

    def _grouped(self, run: Any, what: str, verdicts: list[_Verdict]) -> Finding:
        """One finding for every tensor with the same verdict: one cause, not one per weight."""
        low = what == "low"
        verdicts = sorted(verdicts, key=lambda v: (v.step, v.ratio if low else -v.ratio))
        lead = verdicts[0]
        names = [v.name for v in verdicts]
        steps = sorted({v.step for v in verdicts})
        n = len(verdicts)
        at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        them = f"{n} weights ({_listed(names)})" if n > 1 else f"param {lead.name!r}"
        if what == "blow_up":
            worst = max(verdicts, key=lambda v: v.ratio)
            damage = loss_damage(run, lead.step, damage_scalar(run, self.loss))
            cause = lr_cause(run, lead.step)
            message = (f"update {lead.step} changed {them} by {'at least ' if worst.lower_bound else ''}"
                       f"{fmt(worst.ratio)} times {'its' if n == 1 else 'their'} norm"
                       f"{f' (most: {worst.name!r})' if n > 1 else ''}, above step_hi={fmt(self.step_hi)}, "
                       f"at {at}: the update blew the weights away{damage.text}{cause}. "
                       f"Look at the learning rate and the gradient norm of step {lead.step}")
            return self.finding(damage.severity(), lead.step, message, kind="params", tensor=worst.name,
                                value=worst.ratio, threshold=self.step_hi, tensors=names)
        if what == "high":
            message = (f"median update ratio of {them} is above hi={fmt(self.hi)} (up to {fmt(lead.ratio)} over "
                       f"{lead.count} measured steps; first above at {at}): each update rewrites a large part of "
                       "the weight. Lower the learning rate for these tensors")
            return self.finding(Severity.WARNING, lead.step, message, kind="params", tensor=lead.name,
                                value=lead.ratio, threshold=self.hi, tensors=names)
        message = (f"median update ratio of {them} is below lo={fmt(self.lo)} (down to {fmt(lead.ratio)} over "
                   f"{lead.count} measured steps; first below at {at}): updates this small are lost to rounding. "
                   "Raise the learning rate, or find why the gradients are so small (a loss scaled down?)")
        return self.finding(Severity.WARNING, lead.step, message, kind="params", tensor=lead.name,
                            value=lead.ratio, threshold=self.lo, tensors=names)


class _Updates:
    """What ``update_ratio`` keeps of one weight across the pieces of its history."""

    __slots__ = ("examined", "pending", "first_step", "zero", "carry", "bounds", "norms")

    def __init__(self) -> None:
        self.examined: bool | None = None  # its first shape given has min_dims (None: no shape yet)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # its bounds while examined is None
        self.first_step: int | None = None  # its first step with a row
        self.zero: bool | None = None  # its first finite norm is exactly 0, at its first step (None: no norm yet)
        self.carry: tuple[Any, Any] | None = None  # its last finite row so far: step, norm
        self.bounds: list[tuple[np.ndarray, np.ndarray]] = []  # what judging it needs of its bounds
        self.norms: list[tuple[np.ndarray, np.ndarray]] = []  # its finite norms, when grown from zero


#: Norm-change rows ``update_ratio`` gathers before folding them into each step's largest.
_SCORE_ROWS = 1 << 20


class _UpdateRatioWalk(TensorWalk):
    """``update_ratio``'s one pass over the weights, a piece of a tensor's rows at a time (a long
    run's params frame is steps x tensors): it picks the names and each step's largest norm change
    (which pairs to read), and keeps of each weight what judging it needs once the pairs are
    measured. A norm change at t needs the norm at t + 1: each weight's last finite row of a piece
    is carried into the next."""

    kinds = ("params",)
    stat_columns = ("nan", "posinf", "neginf", "norm")

    def __init__(self, rule: UpdateRatio, run: Any) -> None:
        self.rule, self.run = rule, run
        self.optimized = optimized_params(run)
        self.skipped = skipped_steps(run)
        self.skip = as_step_array(self.skipped)
        self.seen: dict[str, _Updates] = {}
        self.scores: list[tuple[np.ndarray, np.ndarray]] = []  # (steps, norm changes), folded now and then
        self.score_rows = 0

    def visit(self, kind: str, name: str, rows: pd.DataFrame) -> None:
        rule = self.rule
        if not (name in self.optimized and matches(name, rule.names)) or not len(rows):
            return
        u = self.seen.get(name)
        if u is None:
            u = self.seen[name] = _Updates()
        if u.first_step is None:  # the pieces come in step order: its first step is in its first
            u.first_step = int(rows["step"].min())
        if u.examined is None:
            shape = rows["shape"].dropna()  # the groupby's first(): the first shape given
            if len(shape):
                u.examined = ndim(shape.iloc[0]) >= rule.min_dims
        if u.examined is False:
            return
        steps, norms = _finite_norms(rows)
        if steps is None:  # a repeated step: the frames' way, which refuses it as before
            bound = _norm_change(rows, self.skipped)[name]
            piece = (bound.index.to_numpy(), bound.to_numpy(dtype=float))
        else:
            keep = ~np.isnan(norms)
            if u.zero is None and keep.any():  # its first finite norm
                u.zero = bool(norms[keep][0] == 0.0 and int(steps[keep][0]) == u.first_step)
            if u.zero:
                u.norms.append((steps[keep], norms[keep]))
            if u.carry is not None:
                steps = np.concatenate((np.asarray([u.carry[0]], dtype=steps.dtype), steps))
                norms = np.concatenate((np.asarray([u.carry[1]], dtype=float), norms))
            if steps.size:
                u.carry = (steps[-1], norms[-1])
            piece = _bounds(steps, norms, self.skip)
        if u.examined is None:
            u.pending.append(piece)
            return
        for t, lb in [*u.pending, piece]:
            self._keep(u, t, lb)
        u.pending = []

    def _keep(self, u: _Updates, steps: np.ndarray, lb: np.ndarray) -> None:
        """Norm changes of an examined weight: into each step's largest, and those judging it
        needs (above step_hi, or every one of a weight grown from zero: a long run's bounds are
        steps x weights)."""
        if not steps.size:
            return
        self.scores.append((steps, lb))
        self.score_rows += steps.size
        if self.score_rows > _SCORE_ROWS:
            self.scores = [_largest(self.scores)]
            self.score_rows = self.scores[0][0].size
        big = lb > self.rule.step_hi
        u.bounds.append((steps, lb) if u.zero else (steps[big], lb[big]))

    def finish(self) -> list[Finding]:
        names: list[str] = []
        kept: dict[str, tuple[pd.Series, pd.Series | None]] = {}
        for name, u in self.seen.items():
            if not u.examined:
                continue
            names.append(name)
            bound = _series(u.bounds, "norm")
            if not u.zero:
                kept[name] = (bound, None)
                continue
            kept[name] = (bound, _series(u.norms, "norm"))
        steps, largest = _largest(self.scores)
        score = pd.Series(largest, index=pd.Index(steps, name="step"), name="norm", dtype=float)
        return self.rule._findings(self.run, names, kept, score)


def _series(parts: list[tuple[np.ndarray, np.ndarray]], name: str) -> pd.Series:
    """(steps, values) pieces, in step order, as one Series by step."""
    steps = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    values = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    return pd.Series(values.astype(float), index=pd.Index(steps, name="step"), name=name)


def _largest(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's largest value of the (steps, values) pieces (none NaN), by step."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0)
    steps = np.concatenate([p[0] for p in parts])
    values = np.concatenate([p[1] for p in parts]).astype(float)
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    at = np.flatnonzero(np.concatenate(([True], steps[1:] != steps[:-1])))
    return steps[at], np.maximum.reduceat(values, at)


@dataclass(frozen=True)
class _Verdict:
    """What ``update_ratio`` found for one tensor, before findings are grouped per cause."""

    what: str  # "blow_up", "high" or "low"
    name: str
    step: int
    ratio: float  # the single update's ratio (blow_up) or the median ratio
    lower_bound: bool  # blow_up known only as a lower bound, from the stats
    count: int  # blow-up steps, or measured steps behind the median


# A weight grown from exactly zero (LoRA's B, zero-initialised output layers) has an update as
# large as itself at first by construction; its update is a blow-up only when it is also this
# many times the median of its earlier updates.
GROWTH_JUMP = 10.0


def _by_name(params: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """``params.groupby("name", sort=False)`` as a list; a one-tensor frame (what the rules pass
    here) as itself, without the groupby's cost."""
    names = params["name"].to_numpy()
    if len(names) and isinstance(names[0], str) and (names == names[0]).all():
        return [(names[0], params)]
    return [(str(n), rows) for n, rows in params.groupby("name", sort=False)]


def _finite_norms(rows: pd.DataFrame) -> tuple[np.ndarray | None, np.ndarray]:
    """(steps, norms) of one tensor's rows without NaN/Inf elements, by step: what
    ``rows[nonfinite(rows) == 0].set_index("step")["norm"].astype(float).sort_index()`` holds,
    as arrays. (None, _) where a step repeats (a Series would refuse to align on it)."""
    ok = (nonfinite(rows) == 0).to_numpy()
    steps = rows["step"].to_numpy()[ok]
    norms = rows["norm"].to_numpy(dtype=float)[ok]
    order = np.argsort(steps, kind="stable")
    steps, norms = steps[order], norms[order]
    if steps.size > 1 and not (np.diff(steps) > 0).all():
        return None, norms
    return steps, norms


def _outgrown(ratios: dict[int, float], bound: pd.Series, norms: pd.Series) -> set[int]:
    """Steps whose update is :data:`GROWTH_JUMP` times the median of the weight's earlier ones.

    Update sizes are ratio x norm: measured where the pair was read, else the stats' lower bound.
    """
    size = {int(t): float(r) * float(norms.get(t, math.nan)) for t, r in bound.items()}
    size.update({t: r * float(norms.get(t, math.nan)) for t, r in ratios.items()})
    out: set[int] = set()
    seen: list[float] = []
    for t in sorted(size):
        u = size[t]
        if not math.isfinite(u):
            continue
        if seen and u > GROWTH_JUMP * float(pd.Series(seen).median()):
            out.add(t)
        if u > 0:
            seen.append(u)
    return out


def _norm_change(params: pd.DataFrame, skipped: set[int]) -> dict[str, pd.Series]:
    """Per name: | ||p[t+1]|| - ||p[t]|| | / ||p[t]|| for consecutive stats steps t, t+1 (t not skipped)."""
    out: dict[str, pd.Series] = {}
    skip = np.fromiter(skipped, dtype=np.int64, count=len(skipped))
    for name, rows in _by_name(params):
        steps, norms = _finite_norms(rows)
        if steps is None:  # a repeated step: the frames' way, which refuses it as before
            norm_s = rows[nonfinite(rows) == 0].set_index("step")["norm"].astype(float).sort_index()
            nxt = norm_s.reindex(norm_s.index + 1)
            nxt.index = norm_s.index
            lb_s = ((nxt - norm_s).abs() / norm_s.where(norm_s > 0)).dropna()
            out[str(name)] = lb_s[~lb_s.index.isin(list(skipped))]
            continue
        t, lb = _bounds(steps, norms, skip)
        out[str(name)] = pd.Series(lb, index=pd.Index(t, name="step"), name="norm")
    return out


def _bounds(steps: np.ndarray, norms: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(t, | ||p[t+1]|| - ||p[t]|| | / ||p[t]||) of the steps t with a norm change (t + 1 among
    ``steps`` too, neither norm NaN, t not in ``skip``), from a tensor's finite rows by step."""
    # the norm at t + 1, where that step has one (NaN elsewhere), as reindex(index + 1) gives it
    at = np.searchsorted(steps, steps + 1)
    has = at < steps.size
    has[has] = steps[at[has]] == steps[has] + 1
    nxt_v = np.full(steps.size, np.nan)
    nxt_v[has] = norms[at[has]]
    with np.errstate(invalid="ignore", divide="ignore"):
        lb = np.abs(nxt_v - norms) / np.where(norms > 0, norms, np.nan)
    keep = ~np.isnan(lb) & ~np.isin(steps, skip)
    return steps[keep], lb[keep]


def _measure(run: Any, names: list[str], pairs: list[int]) -> dict[str, dict[int, float]]:
    """name -> {t: ||p[t+1] - p[t]|| / ||p[t]||} for the pairs (t, t+1), reading each tensor once."""
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    prev: dict[str, torch.Tensor] = {}  # values at step t, kept from the previous pair when it was t-1
    last = None
    for t in pairs:
        if last != t - 1:
            prev = {}
        nxt: dict[str, torch.Tensor] = {}
        for name in names:
            try:
                a = prev[name] if name in prev else run.tensor(name, t, "params").detach().double()
                b = run.tensor(name, t + 1, "params").detach().double()
            except KeyError:  # not stored at one of the two steps
                continue
            nxt[name] = b
            den = float(torch.linalg.vector_norm(a))
            if den > 0 and math.isfinite(den):
                r = float(torch.linalg.vector_norm(b - a)) / den
                if math.isfinite(r):
                    out[name][t] = r
        prev, last = nxt, t
    return out


def _choose_pairs(pairs: list[int], score: pd.Series, budget: int) -> tuple[list[int], set[int]]:
    """At most ``budget`` pairs: half with the largest ``score`` (the largest norm change of any
    weight at the step), the rest evenly spaced.

    Returns the chosen pairs and the evenly spread ones (a fair sample for medians).
    """
    if len(pairs) <= budget:
        return pairs, set(pairs)
    if budget == 0:
        return [], set()
    score = score.reindex(pairs).fillna(0.0)
    chosen = set(score.sort_values(ascending=False, kind="stable").index[: budget // 2].astype(int))
    rest = [t for t in pairs if t not in chosen]
    k = budget - len(chosen)
    spread = {rest[min(len(rest) - 1, int(i * len(rest) / k))] for i in range(k)} if k > 0 and rest else set()
    return sorted(chosen | spread), spread
