"""Gradient rules: ``exploding_gradient``, ``vanishing_gradient``, ``dead_units``."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._damage import loss_damage
from stepdump.analysis.rules._roles import check_scalar_option, damage_scalar
from stepdump.analysis.rules._frames import (
    as_step_array,
    episodes,
    fmt,
    matches,
    nonfinite,
    optimized_params,
    skipped_steps,
    sustained,
    times,
    trailing_median,
    windowed_grad_norm,
)
from stepdump.analysis.rules._gradnorm import GradNorm, grad_norms
from stepdump.analysis.rules.base import (
    Rule,
    check_fraction,
    check_globs,
    check_int,
    check_kinds,
    check_positive,
    register_rule,
)
from stepdump.analysis.rules._walk import TensorWalk, WalkingRule
from stepdump.analysis.rules.lr import lr_cause
from stepdump.errors import ConfigError
from stepdump.store.format import TENSOR_KINDS


@register_rule
@dataclass(frozen=True, kw_only=True)
class ExplodingGradient(Rule):
    """The global gradient norm ``sqrt(sum of squared per-tensor grad norms)`` blows up.

    The norm judged is the one backward produced, **before clipping**, when the
    run shows clipping (:mod:`._gradnorm`): a logged ``norm_scalar`` (the HF
    ``Trainer`` logs ``grad_norm``) or the integrations' ``grad_clip`` metadata.
    Recorded grads clipped before ``optimizer.step()`` sit at the clip value and
    hide a blow-up; when that is all the run has, an INFO finding says what to log.

    A step is flagged when the norm is above ``max_norm`` or more than
    ``factor`` times the median of the ``window`` steps before it (only once
    ``min_history`` earlier steps exist). All flagged steps give **one** finding,
    at the first, naming the grad tensor whose norm jumped most against its own
    trailing median, with the number of flagged steps and the peak. ERROR when
    the norm passed ``max_norm`` or the loss then went up by an order of
    magnitude or turned NaN/Inf; WARNING otherwise. Skipped steps and steps with
    NaN/Inf grads are left out (``nan_inf`` reports those).

    Attributes:
        max_norm: Absolute limit on the global grad norm (None: no absolute test).
        factor: Allowed jump over the trailing median.
        window: Number of earlier steps in the trailing median.
        min_history: Earlier steps needed before the relative test applies.
        norm_scalar: Logged scalar holding the pre-clip global norm (None: never read one).
        loss: Name of the logged loss, read to judge the damage (None: the run's objective, else "loss").
    """

    name: ClassVar[str] = "exploding_gradient"
    max_norm: float | None = 1e4
    factor: float = 10.0
    window: int = 50
    min_history: int = 10
    norm_scalar: str | None = "grad_norm"
    loss: str | None = None

    def __post_init__(self) -> None:
        if self.max_norm is not None:
            check_positive(self.name, "max_norm", self.max_norm)
        check_positive(self.name, "factor", self.factor)
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "min_history", self.min_history, 1)
        if self.norm_scalar is not None and (not isinstance(self.norm_scalar, str) or not self.norm_scalar):
            raise ConfigError(f"{self.name}: norm_scalar must be a scalar name or None, got {self.norm_scalar!r}")
        check_scalar_option(self.name, "loss", self.loss)

    def __call__(self, run: Any) -> list[Finding]:
        recorded, grad_steps = windowed_grad_norm(run, skipped_steps(run))
        gn = grad_norms(run, recorded, skipped_steps(run), self.norm_scalar)
        out = [self._hidden(gn)] if gn.hidden else []
        g = gn.norms
        if g.empty:
            return out
        med = trailing_median(g, self.window, self.min_history)
        over_abs = g > self.max_norm if self.max_norm is not None else pd.Series(False, index=g.index)
        over_rel = g > self.factor * med
        flagged = [int(s) for s in g.index[over_abs | over_rel]]
        if not flagged:
            return out
        eps = episodes(flagged, [int(s) for s in g.index])
        s, peak = flagged[0], max(flagged, key=lambda t: g[t])
        name = self._most_jumped_at(run, gn, grad_steps, s)
        absolute = bool(over_abs[s])
        if absolute:
            limit, why = float(self.max_norm), f"above max_norm={fmt(self.max_norm)}"  # type: ignore[arg-type]
        else:
            limit = self.factor * float(med[s])
            why = f"{times(g[s] / med[s])} the median {fmt(med[s])} of the {self.window} steps before"
        source = f" ({gn.source})" if gn.source else ""
        where = f"; largest jump in grads {name!r}" if name else ""
        span = ""
        if len(flagged) > 1:
            span = (f"; {len(flagged)} steps flagged in {len(eps)} stretch(es), peak {fmt(g[peak])} at step {peak}")
        if gn.clip and gn.source:
            span += f"; clipping to {fmt(gn.clip)} scaled this step's gradient down {times(g[s] / gn.clip)}"
        damage = loss_damage(run, s, damage_scalar(run, self.loss))
        cause = lr_cause(run, s)
        todo = ("Fix the lr at the step lr_jump names" if cause else
                f"Lower the learning rate (or the clip value), or look at the batch of step {s}")
        out.append(self.finding(
            Severity.ERROR if absolute else damage.severity(), s,
            f"global grad norm {fmt(g[s])}{source} at step {s} is {why}{where}{span}{damage.text}{cause}. {todo}",
            kind="grads", tensor=name, value=g[s], threshold=limit,
        ))
        return out

    def _most_jumped_at(self, run: Any, gn: GradNorm, grad_steps: list[int], s: int) -> str | None:
        """The grad whose norm at ``s`` jumped most against its median over the ``window`` steps
        before (steps with grad norms); reads only those steps' rows."""
        pos = bisect.bisect_left(grad_steps, s)
        if pos == len(grad_steps) or grad_steps[pos] != s:
            return None
        grads = run.stats("grads", steps=grad_steps[max(0, pos - self.window): pos + 1])
        # Per-tensor norms as backward made them: clipping scaled every tensor of a step alike.
        per_tensor = grads.pivot_table(index="step", columns="name", values="norm", aggfunc="last")
        per_tensor = per_tensor.mul(gn.scale().reindex(per_tensor.index).fillna(1.0), axis=0)
        tensor_med = per_tensor.shift(1).rolling(self.window, min_periods=1).median()
        return _most_jumped(per_tensor, tensor_med, s)

    def _hidden(self, gn: GradNorm) -> Finding:
        scalar = self.norm_scalar or "grad_norm"
        return self.finding(
            Severity.INFO, int(gn.recorded.index[0]),
            f"the recorded grads look clipped: their global norm is at {fmt(gn.clip or 0)} at {gn.at_clip} of "
            f"{len(gn.recorded)} steps, so a gradient blow-up before clipping cannot be seen. Log the pre-clip norm "
            f"each step: rec.log({scalar}=torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) "
            "(it returns the norm before clipping)",
            kind="grads", value=gn.at_clip, threshold=gn.clip,
        )


def _most_jumped(norms: pd.DataFrame, medians: pd.DataFrame, step: int) -> str | None:
    """The tensor whose norm at ``step`` is largest against its own trailing median (or largest)."""
    if step not in norms.index:
        return None
    now = norms.loc[step]
    ratio = now / medians.loc[step].where(medians.loc[step] > 0)
    ratio = ratio.dropna()
    if not ratio.empty:
        return str(ratio.idxmax())
    now = now.dropna()
    return None if now.empty else str(now.idxmax())


@register_rule
@dataclass(frozen=True, kw_only=True)
class VanishingGradient(Rule):
    """The global gradient norm of the optimized parameters is nearly zero for a while.

    A step is flagged when the global grad norm (over the grads of parameters
    the optimizer steps) is below ``min_norm``; ``patience`` or more
    consecutive recorded steps give one WARNING at the first of them. The
    model is then barely learning: a loss scaled far down, a detached graph,
    saturated activations, or a loss that is already exactly zero.

    Attributes:
        min_norm: Global grad norms below this count as vanished.
        patience: Consecutive flagged steps needed for a finding.
    """

    name: ClassVar[str] = "vanishing_gradient"
    min_norm: float = 1e-8
    patience: int = 5

    def __post_init__(self) -> None:
        check_positive(self.name, "min_norm", self.min_norm)
        check_int(self.name, "patience", self.patience, 1)

    def __call__(self, run: Any) -> list[Finding]:
        g, _ = windowed_grad_norm(run, skipped_steps(run), optimized_params(run))
        flagged = [int(s) for s in g.index[g < self.min_norm]]
        out = []
        for ep in sustained(flagged, [int(s) for s in g.index], self.patience):
            s = ep[0]
            out.append(self.finding(
                Severity.WARNING, s,
                f"global grad norm {fmt(g[s])} at step {s} is below min_norm={fmt(self.min_norm)} for "
                f"{len(ep)} recorded steps (to step {ep[-1]}); the parameters barely get a gradient. Check the "
                "loss scale, detached tensors, and saturated activations",
                kind="grads", tensor=None, value=g[s], threshold=self.min_norm,
            ))
        return out


class _Stretch(NamedTuple):
    """A tensor's first stretch of mostly-zero steps (DeadUnits)."""

    name: str
    steps: int  # the stretch's recorded steps
    more: int  # stretches after it
    zero_frac: float  # at its first step


@register_rule
@dataclass(frozen=True, kw_only=True)
class DeadUnits(WalkingRule):
    """Tensors whose elements are almost all exactly zero, step after step.

    For each tensor of ``kinds``, a step is flagged when its ``zero_frac``
    (fraction of elements exactly 0) is above ``max_zero_frac``; ``patience``
    or more consecutive recorded steps make a stretch. Tensors whose stretch starts
    at the same step share one cause and **one** WARNING listing them
    (``Finding.tensors``): typically ReLUs that stopped firing (a large negative
    bias, a too-high learning rate), so the units, the weights feeding them, and
    everything before them get no gradient. The lead tensor is the last one, in
    recording order, whose every sibling (same module) is flagged: the layer whose
    units died. Skipped steps are left out.

    Gradients that are sparse by construction are not units that never fire, and
    are left out: the parameters of an ``nn.Embedding`` / ``nn.EmbeddingBag`` (only
    the rows a batch looks up get a gradient; the run's layout lists them), pruned
    weights (``<name>_orig`` with a ``<name>_mask`` buffer: the mask zeroes the
    rest), and names matching ``exclude`` (for runs recorded before the layout
    listed embeddings).

    Attributes:
        max_zero_frac: Zero fraction above which a step is flagged.
        patience: Consecutive flagged steps needed for a finding.
        kinds: Kinds of tensors examined.
        exclude: Globs of tensor names left out.
    """

    name: ClassVar[str] = "dead_units"
    max_zero_frac: float = 0.9
    patience: int = 10
    kinds: tuple[str, ...] = ("activations", "activation_grads", "grads")
    exclude: tuple[str, ...] = ("*embed*", "*wte*", "*wpe*")

    def __post_init__(self) -> None:
        check_fraction(self.name, "max_zero_frac", self.max_zero_frac, open_low=False)
        check_int(self.name, "patience", self.patience, 1)
        check_kinds(self.name, "kinds", self.kinds, TENSOR_KINDS)
        check_globs(self.name, "exclude", self.exclude)

    def walk(self, run: Any) -> TensorWalk:
        return _DeadUnitsWalk(self, run)

    def _grouped(self, kind: str, s: int, hits: list[_Stretch]) -> Finding:
        names = [h.name for h in hits]
        lead = _dead_layer(names)
        name, n, more, zf = next(h for h in hits if h.name == lead)
        also = f" more such stretch(es) later" if more else ""
        if len(hits) == 1:
            what = (f"{kind} {name!r}: {zf:.0%} of its elements are exactly zero for {n} recorded steps from "
                    f"step {s}{f' ({more}{also})' if more else ''}")
        else:
            what = (f"{kind} of {len(hits)} tensors are over {self.max_zero_frac:.0%} exact zeros for "
                    f"{self.patience}+ recorded steps from step {s} ({', '.join(map(repr, names[:6]))}"
                    f"{f' and {len(names) - 6} more' if len(names) > 6 else ''}); the last layer whose every "
                    f"tensor is dead is {name.rsplit('.', 1)[0]!r}")
        return self.finding(
            Severity.WARNING, s,
            f"{what}; units that never fire (dead ReLUs: a large negative bias, a too-high lr) pass no gradient "
            "back, so they, the weights feeding them and everything before them stop learning",
            kind=kind, tensor=name, value=zf, threshold=self.max_zero_frac, tensors=names,
        )


class _Runs:
    """``dead_units``' count of one tensor's stretches across the pieces of its history: the
    stretches closed so far and the run of flagged steps open at the end of the last piece."""

    __slots__ = ("first", "more", "open_start", "open_len", "open_zf")

    def __init__(self) -> None:
        self.first: tuple[int, int, float] | None = None  # the first stretch: first step, steps, zero_frac there
        self.more = 0  # stretches after it
        self.open_start = 0
        self.open_len = 0  # flagged steps in a row at the end of the last piece (0: none open)
        self.open_zf = math.nan

    def close(self, patience: int) -> None:
        """The open run ends (an unflagged step, or the history's end): a stretch if long enough."""
        if self.open_len >= patience:
            if self.first is None:
                self.first = (self.open_start, self.open_len, self.open_zf)
            else:
                self.more += 1
        self.open_len = 0


class _DeadUnitsWalk(TensorWalk):
    """``dead_units``' walk over the tensors of its kinds, a piece of a tensor's rows at a time:
    each tensor's first stretch of mostly-zero steps, by the step it starts at. A stretch is a run
    of flagged steps consecutive among the steps that measured ``zero_frac``
    (:func:`~stepdump.analysis.rules._frames.sustained`), counted across the pieces."""

    stat_columns = ("nan", "posinf", "neginf", "zero_frac")

    def __init__(self, rule: DeadUnits, run: Any) -> None:
        self.rule = rule
        present = run.kinds()
        self.kinds = tuple(k for k in rule.kinds if k in present)
        self.sparse = sparse_by_construction(run)
        self.skip = as_step_array(skipped_steps(run))
        # where each tensor first shows among the rows kept (by step, then recording order)
        self.recording = {k: {n: i for i, n in enumerate(run.names(k))} for k in self.kinds}
        self.first: dict[str, dict[str, tuple[int, int]]] = {k: {} for k in self.kinds}
        self.runs: dict[str, dict[str, _Runs]] = {k: {} for k in self.kinds}

    def visit(self, kind: str, name: str, rows: pd.DataFrame) -> None:
        rule = self.rule
        kept = ~np.isin(rows["step"].to_numpy(), self.skip) & (nonfinite(rows) == 0).to_numpy()
        if not kept.any():
            return
        steps = rows["step"].to_numpy()[kept]
        if name not in self.first[kind]:  # the pieces come in step order: its first kept step is here
            self.first[kind][name] = (int(steps.min()), self.recording[kind].get(name, -1))
        if matches(str(name), rule.exclude) or (kind == "grads" and str(name) in self.sparse):
            return
        runs = self.runs[kind].get(name)
        if runs is None:  # in the order the tensors first keep a row, as a walk over whole histories
            runs = self.runs[kind][name] = _Runs()
        # NULL zero_frac: not measured (large tensors at lean stats-only steps), not "no zeros";
        # the stretch is counted over the steps that measured it.
        zf = _by_step(steps, rows["zero_frac"].to_numpy(dtype=float)[kept])
        if zf is None:  # a step twice: as the frames take it
            zf = rows[kept].sort_values("step").set_index("step")["zero_frac"].astype(float).dropna()
        if zf.empty:
            return
        values = zf.to_numpy()
        flagged = (values > rule.max_zero_frac).astype(np.int8)
        edges = np.diff(np.concatenate(([0], flagged, [0])))
        starts, ends = np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()
        if runs.open_len and (not starts or starts[0] > 0):
            runs.close(rule.patience)  # the open run ends at this piece's first step
        for lo, hi in zip(starts, ends, strict=True):
            if lo == 0 and runs.open_len:  # the run open at the last piece's end goes on
                runs.open_len += hi
            else:
                runs.open_start, runs.open_len, runs.open_zf = int(zf.index[lo]), hi - lo, float(values[lo])
            if hi < len(values):  # ends inside this piece
                runs.close(rule.patience)

    def finish(self) -> list[Finding]:
        out = []
        for kind in self.kinds:
            stretches: dict[int, list[_Stretch]] = {}  # first step -> hits
            for name, runs in self.runs[kind].items():
                runs.close(self.rule.patience)
                if runs.first is not None:
                    s, n, zf = runs.first
                    stretches.setdefault(s, []).append(_Stretch(name, n, runs.more, zf))
            first = self.first[kind]
            for s, hits in sorted(stretches.items()):
                out.append(self.rule._grouped(kind, s, sorted(hits, key=lambda h: first[h.name])))
        return out


def _by_step(steps: np.ndarray, values: np.ndarray) -> pd.Series | None:
    """``values`` by step, sorted, NaN dropped (a Series' ``sort_values``, ``set_index``,
    ``dropna``); None when a step repeats."""
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    if steps.size > 1 and not (np.diff(steps) > 0).all():
        return None
    keep = ~np.isnan(values)
    return pd.Series(values[keep], index=pd.Index(steps[keep], name="step"), name="zero_frac")


def _dead_layer(names: list[str]) -> str:
    """The last name (recording order) whose module's tensors are all in ``names``: the dead layer.

    A dead unit zeroes the gradient of its own weights and bias, of every layer before it, and
    of the next layer's weight (its input is zero) but not of that layer's bias.
    """
    flagged = set(names)
    for n in reversed(names):
        module = n.rsplit(".", 1)[0] if "." in n else ""
        siblings = [m for m in names if (m.rsplit(".", 1)[0] if "." in m else "") == module]
        if all(m in flagged for m in siblings) and len(siblings) > 1:
            return siblings[0]
    return names[-1]


def sparse_by_construction(run: Any) -> set[str]:
    """Params whose gradient is mostly zero by design: embeddings (the run's layout lists them)
    and pruned weights (``x_orig`` with an ``x_mask`` buffer, torch.nn.utils.prune)."""
    layout = run.meta.get("layout", {}) if isinstance(getattr(run, "meta", None), dict) else {}
    if not isinstance(layout, dict):
        return set()
    out = {str(n) for n in layout.get("embeddings", []) or []}
    # (kind, recorded name) of each state_dict entry ([key, kind, name], FORMAT.md)
    entries = [(kind, str(name)) for e in layout.get("state_dict", []) or [] if isinstance(e, list) and len(e) == 3
               for _key, kind, name in (e,)]
    buffers = {name for kind, name in entries if kind == "buffers"}
    for kind, name in entries:
        if kind == "params" and name.endswith("_orig") and name[: -len("_orig")] + "_mask" in buffers:
            out.add(name)
    return out
