"""``unchanged_tensor``: a parameter that never changes, grouped by the real cause."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._frames import as_step_array, name_rows, nonfinite, optimized_params, skipped_steps
from stepdump.analysis.rules._walk import TensorWalk, WalkingRule
from stepdump.analysis.rules.base import check_int, register_rule
from stepdump.analysis.rules.params import _listed


class _Unchanged(NamedTuple):
    """One param whose recorded bytes never changed."""

    name: str
    first: int  # its first recorded step
    last: int
    steps: int  # recorded steps


@register_rule
@dataclass(frozen=True, kw_only=True)
class UnchangedTensor(WalkingRule):
    """A parameter the optimizer should step that never changes, grouped by the real cause.

    A parameter is examined when it is in an optimizer param group (the run's layout) or has
    grads or optimizer state. If its fingerprint (a hash of its exact bytes) is the same at
    every one of at least ``min_steps`` recorded steps, and at least one of those steps was a
    real (not skipped) update, the run says why, and each cause gives **one** finding listing
    every parameter it touched (``Finding.tensors``):

    * in a param group but **never had a gradient** (``requires_grad=False``, or unused in the
      forward pass): INFO, since that is how a frozen base is built (peft hands the whole model
      to the optimizer), and a freeze by mistake looks the same in the run; WARNING when no
      parameter of the optimizer ever changed (nothing trains);
    * a gradient at every step but **in no param group**: WARNING, forgotten when the
      optimizer was built (its gradient is computed and thrown away);
    * a gradient that is **always exactly zero**: WARNING;
    * **lr 0** at every recorded step of its param group: WARNING;
    * none of these visible (a nonzero gradient and lr): WARNING, cause unknown.

    Attributes:
        min_steps: Recorded steps needed before a parameter can be called unchanged.
    """

    name: ClassVar[str] = "unchanged_tensor"
    min_steps: int = 3

    def __post_init__(self) -> None:
        check_int(self.name, "min_steps", self.min_steps, 2)

    def walk(self, run: Any) -> TensorWalk:
        return _UnchangedWalk(self, run)

    def _grouped(self, cause: str, hits: list[_Unchanged], nothing_trains: bool) -> Finding:
        names = [h.name for h in hits]
        first, last, n = min(h.first for h in hits), max(h.last for h in hits), max(h.steps for h in hits)
        one = len(names) == 1
        them = f"param {names[0]!r} is" if one else f"{len(names)} params ({_listed(names)}) are"
        it = "it" if one else "they"
        same = f"bitwise identical at all {n} recorded steps ({first}-{last})"
        severity = Severity.WARNING
        if cause == "no_grad":
            severity = Severity.WARNING if nothing_trains else Severity.INFO
            why = (f"{them} in the optimizer but never had a gradient, so {it} never changed ({same}): frozen with "
                   "requires_grad=False, or unused in the forward pass. That is how a frozen base is built (LoRA, "
                   f"a fine-tuned head); if {'it' if one else 'any of them'} should train, set requires_grad=True "
                   "before the first backward")
            if nothing_trains:
                why += "; no parameter of the optimizer changed at all: nothing trains"
        elif cause == "not_in_optimizer":
            why = (f"{them} given a gradient but in no param group, so the optimizer never updates "
                   f"{'it' if one else 'them'} ({same}): forgotten when the optimizer was built? Add "
                   f"{'it' if one else 'them'} to a param group, or set requires_grad=False")
        elif cause == "zero_grad":
            why = (f"{them} in the optimizer but {'its' if one else 'their'} gradient is always zero, exactly "
                   f"({same}): zeroed before the step, or nothing downstream depends on {'it' if one else 'them'} "
                   "(a detached branch, a zero multiplier, dead units)")
        elif cause == "lr_zero":
            why = f"{them} in a param group with lr=0 at every recorded step ({same}): set a nonzero lr"
        else:
            why = (f"{them} in the optimizer with a nonzero gradient and lr, yet {same}: the updates are lost "
                   "(too small for the weights' dtype?) or undone after the step")
        return self.finding(severity, first, why, kind="params", tensor=names[0], value=n, threshold=self.min_steps,
                            tensors=names)


class _Seen:
    """What ``unchanged_tensor`` keeps of one param across the pieces of its history."""

    __slots__ = ("rows", "first", "last", "real", "values", "null", "changed")

    def __init__(self) -> None:
        self.rows = 0
        self.first: int | None = None  # its first and last recorded steps
        self.last: int | None = None
        self.real = 0  # rows at steps not skipped
        self.values: list[Any] = []  # its distinct fingerprints (few: one while it is unchanged)
        self.null = False  # a fingerprint missing (NULL) somewhere
        self.changed = False  # two fingerprints that differ, whatever else comes


class _UnchangedWalk(TensorWalk):
    """``unchanged_tensor``'s walk over the params, a piece of a weight's rows at a time; the
    cause of each unchanged one is looked up once the walk is done (its grads are read then, not
    beside the walk's rows)."""

    kinds = ("params",)
    stat_columns = ()

    def __init__(self, rule: UnchangedTensor, run: Any) -> None:
        self.rule, self.run = rule, run
        self.optimized = optimized_params(run)
        self.skipped = skipped_steps(run)
        self.skip = as_step_array(self.skipped)
        self.seen: dict[str, _Seen] = {}
        self.unchanged: list[_Unchanged] = []
        self.changed: set[str] = set()

    def visit(self, kind: str, name: str, rows: pd.DataFrame) -> None:
        if name not in self.optimized or not len(rows):
            return
        seen = self.seen.get(name)
        if seen is None:
            seen = self.seen[name] = _Seen()
        steps = rows["step"].to_numpy()
        seen.rows += len(steps)
        lo, hi = int(steps.min()), int(steps.max())
        seen.first = lo if seen.first is None else min(seen.first, lo)
        seen.last = hi if seen.last is None else max(seen.last, hi)
        seen.real += int((~np.isin(steps, self.skip)).sum())
        if seen.changed:
            return
        fp = rows["fingerprint"]
        seen.null = seen.null or bool(fp.isna().any())
        for v in pd.unique(fp.dropna()):
            if v in seen.values:
                continue
            seen.values.append(v)
            # two values apart even as floats (what a NULL anywhere makes the column) stay apart
            if len(seen.values) > 1 and _distinct(seen.values, True) > 1:
                seen.changed = True
                return

    def _judge(self) -> None:
        """The walk's verdicts, as a walk over each weight's whole history gives them: a param
        with fewer than ``min_steps`` rows is not looked at; one whose fingerprint takes more than
        one value (``rows["fingerprint"].nunique() != 1``) changed; else it is unchanged unless
        every step before its last was skipped."""
        for name, seen in self.seen.items():
            if seen.rows < self.rule.min_steps or seen.first is None or seen.last is None:
                continue
            if seen.changed or _distinct(seen.values, seen.null) != 1:
                self.changed.add(name)
                continue
            # every step but the last one (sorted) skipped: the rows at real steps, less the last
            if seen.real - (0 if seen.last in self.skipped else 1) == 0:
                continue
            self.unchanged.append(_Unchanged(name, seen.first, seen.last, seen.rows))

    def finish(self) -> list[Finding]:
        self._judge()
        run = self.run
        groups = _group_of(run)
        grads = "grads" in run.kinds()
        causes: dict[str, list[_Unchanged]] = {}
        for hit in self.unchanged:
            causes.setdefault(_why_unchanged(run, hit.name, grads, groups), []).append(hit)
        out = []
        for cause, hits in causes.items():
            nothing_trains = cause == "no_grad" and not self.changed and bool(groups)
            out.append(self.rule._grouped(cause, hits, nothing_trains))
        return out


def _distinct(values: list[Any], null: bool) -> int:
    """``nunique()`` of a fingerprint column holding ``values`` (and a NULL where ``null``): a
    NULL makes the whole column float, where two fingerprints may round to one value."""
    return int(pd.Series([*values, *([None] if null else [])]).nunique())


def _group_of(run: Any) -> dict[str, int]:
    """Param name -> index of its param group, from the run's layout (empty when the run has none)."""
    layout = run.meta.get("layout", {}) if isinstance(run.meta, dict) else {}
    out: dict[str, int] = {}
    for i, group in enumerate(layout.get("groups", []) if isinstance(layout, dict) else []):
        for n in group if isinstance(group, list) else []:
            out.setdefault(str(n), i)
    return out


def _why_unchanged(run: Any, name: str, grads: bool, groups: dict[str, int]) -> str:
    """The cause of an unchanged param: no_grad, not_in_optimizer, zero_grad, lr_zero or unknown
    (``grads``: the run recorded grads; this param's are read)."""
    g = name_rows(run, "grads", name) if grads else None
    if g is not None and g.empty:
        return "no_grad"
    if groups and name not in groups:
        return "not_in_optimizer"
    if g is not None and (g["norm"].fillna(0) == 0).all() and (nonfinite(g) == 0).all():
        return "zero_grad"
    if name in groups:
        i = groups[name]
        sc = run.scalars()
        col = "lr" if i == 0 else f"lr/{i}"
        if col in sc.columns:
            lr = pd.to_numeric(sc[col], errors="coerce").dropna()
            if len(lr) and bool((lr == 0).all()):
                return "lr_zero"
    return "unknown"
