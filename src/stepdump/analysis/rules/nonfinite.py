"""``nan_inf``: where NaN/Inf first appears, ordered so that it points at the origin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules._frames import matches, nonfinite, skipped_steps, stats_windows
from stepdump.analysis.rules._roles import DEFAULT_OBJECTIVE, objective
from stepdump.analysis.rules.base import Rule, check_globs, register_rule

# Within one record t, the order in which values come into being (DESIGN.md,
# step semantics): optimizer state and params (and buffers) are what update
# t-1 left; then the forward pass (inputs, activations, the loss), then the
# backward pass (activation grads, param grads). The earliest non-finite value
# in this order is the one the others were computed from.
CAUSAL_RANK = {
    "hyper": 0,
    "optimizer": 0,
    "params": 1,
    "buffers": 1,
    "inputs": 2,
    "activations": 3,
    "scalar": 4,
    "activation_grads": 5,
    "grads": 6,
    "grad_scalar": 7,
}

# Scalars have no recorded order within an iteration (the catalog keys them by name), so their
# place follows what they are: the lr and the AMP scale are set before the iteration (with the
# optimizer state); a gradient norm is computed from the grads after backward; the objective is
# what the forward pass produced first; other losses and metrics come from the forward too, after it.
HYPER_SCALARS = ("lr", "lr/*", "grad_scale")
GRAD_SCALARS = ("*grad_norm*", "*grad*norm*", "*gradnorm*", "*grad_scale_inv*")

# Kinds whose NaN/Inf at a step the GradScaler skipped is what AMP expects:
# the scaler found them, skipped the update, and lowered the scale.
EXPECTED_WHEN_SKIPPED = frozenset({"grads", "activation_grads"})

_ORIGIN_HINT = {
    "hyper": "it was set before the iteration (the lr or the AMP scale: look at what sets it)",
    "optimizer": "update {prev} produced it (look at the grads and lr of step {prev})",
    "params": "update {prev} produced it, or the weights were changed outside the optimizer "
    "(look at the grads, optimizer state and lr of step {prev})",
    "buffers": "the forward pass of iteration {prev} produced it (e.g. BatchNorm running stats)",
    "inputs": "the batch itself holds it: check the data pipeline",
    "activations": "the forward pass produced it in this module (overflow, log/sqrt/div of bad values)",
    "scalar": "the forward pass produced it while every recorded tensor was still finite",
    "activation_grads": "the backward pass produced it",
    "grads": "the backward pass produced it (the first tensor in backward order is named)",
    "grad_scalar": "it was computed from the grads after the backward pass",
}

# The next thing to do, when the run lacks the kind that would name the module.
_CAPTURE = 'capture=("params", "grads", "optimizer", "{kind}")'
_RING = 'ring=16, trigger="nan_inf" keeps the cost to the steps around it'


def _next_action(kind: str, step: int, recorded: set[str]) -> str:
    """What to do next for an origin of ``kind``, given the kinds the run recorded."""
    if kind == "scalar":
        if "activations" not in recorded:
            return (f"record activations ({_CAPTURE.format(kind='activations')}; {_RING}) to find the module "
                    "that produced it")
        return (f"every recorded module output was finite: the loss computation itself produced it (log(0), a "
                f"division, bad labels); look at the batch of step {step} (record inputs, or rec.log_batch)")
    if kind in ("grads", "activation_grads") and "activation_grads" not in recorded:
        return (f"record activation_grads ({_CAPTURE.format(kind='activation_grads')}; {_RING}) to find the "
                "module whose backward produced it")
    if kind == "activations":
        return f"look at this module's input and weights at step {step}"
    return ""


@register_rule
@dataclass(frozen=True, kw_only=True)
class NanInf(Rule):
    """The first step and tensor (or scalar) holding NaN or Inf.

    One ERROR finding for the origin: the earliest step with a non-finite
    value, and within that step the earliest value in causal order
    (optimizer state, params, inputs, activations, loss, activation grads,
    grads; param grads in backward order, i.e. last parameter first). Logged
    scalars carry no order of their own within a step: the objective (the run's,
    :mod:`._roles`; "loss" by default) counts as the first the forward pass made,
    other scalars after it, and gradient norms (``grad_norm``, what
    ``clip_grad_norm_`` returns) after the grads they are computed from; the message
    says which came first and names the others. At steps
    the GradScaler skipped, non-finite grads are expected: they give one INFO
    finding (first step and count) instead. The message ends with the next
    thing to do; when the run lacks the kind that would name the module (a NaN
    first seen in the loss without activations), that is to record it.

    Attributes:
        scalars: Globs of scalar names to check (default every logged scalar).
    """

    name: ClassVar[str] = "nan_inf"
    scalars: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        check_globs(self.name, "scalars", self.scalars)

    def __call__(self, run: Any) -> list[Finding]:
        skipped = skipped_steps(run)
        events = self._tensor_events(run, skipped) + self._scalar_events(run)
        if not events:
            return []
        expected = [e for e in events if e["step"] in skipped and e["kind"] in EXPECTED_WHEN_SKIPPED]
        real = [e for e in events if not (e["step"] in skipped and e["kind"] in EXPECTED_WHEN_SKIPPED)]
        out: list[Finding] = []
        if real:
            out.append(self._origin(real, set(run.kinds())))
        if expected:
            steps = sorted({e["step"] for e in expected})
            first = min(expected, key=_order)
            out.append(self.finding(
                Severity.INFO, steps[0],
                f"{len(steps)} step(s) the GradScaler skipped had non-finite {first['kind']} (first at step "
                f"{steps[0]}, {first['kind']} {first['tensor']!r}); expected with mixed precision, the scaler "
                "lowers its scale and no update happens",
                kind=first["kind"], tensor=first["tensor"], value=len(steps), threshold=0,
            ))
        return out

    def _origin(self, events: list[dict[str, Any]], recorded: set[str]) -> Finding:
        first = min(events, key=_order)
        s, kind = first["step"], first["kind"]
        same_step = sum(1 for e in events if e["step"] == s) - 1
        later = sorted({e["step"] for e in events if e["step"] > s})
        scalar_kinds = ("scalar", "grad_scalar", "hyper")
        what = "scalar" if kind in scalar_kinds else kind
        counts = ", ".join(f"{n} {label}" for n, label in ((first["nan"], "NaN"), (first["inf"], "Inf")) if n)
        tail = f"; {same_step} other value(s) non-finite at step {s}" if same_step else ""
        others = [e["tensor"] for e in sorted(events, key=_order)
                  if e["step"] == s and e["kind"] in scalar_kinds and e is not first]
        if kind in scalar_kinds and others:
            tail += (f" (also logged non-finite at step {s}: {', '.join(map(repr, others))}; scalars logged in one "
                     "iteration keep no order in the run, so they are ordered by what they are: the objective "
                     "first, as the forward pass computes it, other losses and metrics next, gradient norms after "
                     "the grads they are computed from)")
        if later:
            tail += f"; non-finite values at {len(later)} later step(s) up to {later[-1]}"
        hint = _ORIGIN_HINT[kind].format(prev=s - 1)
        action = _next_action(kind, s, recorded)
        return self.finding(
            Severity.ERROR, s,
            f"first non-finite value: {what} {first['tensor']!r} at step {s} has {counts or 'NaN/Inf'}; "
            f"{hint}{tail}{f'. Next: {action}' if action else ''}",
            kind=None if kind in scalar_kinds else kind, tensor=first["tensor"],
            value=first["nan"] + first["inf"], threshold=0,
        )

    def _tensor_events(self, run: Any, skipped: set[int]) -> list[dict[str, Any]]:
        """Non-finite stats rows as events, read window by window (:func:`stats_windows`).

        Kept in full: the events at the first step of each class (real, or expected at a skipped
        step); at every later step, one event stands for the step (the finding only counts the
        steps). So memory follows the steps with NaN/Inf, not the rows holding them."""
        seen: dict[str, dict[str, int]] = {}  # kind -> name -> index in recording order (first appearance)
        kept: dict[bool, list[dict[str, Any]]] = {True: [], False: []}  # expected? -> events
        stand_in: dict[bool, dict[int, dict[str, Any]]] = {True: {}, False: {}}
        for df in stats_windows(run):
            if df.empty:
                continue
            for kind, names in df.groupby("kind", sort=False)["name"]:
                order = seen.setdefault(str(kind), {})
                for n in pd.unique(names):
                    order.setdefault(str(n), len(order))
            bad = nonfinite(df)
            hit = df[bad > 0]
            for r in hit.itertuples(index=False):
                step, kind = int(r.step), str(r.kind)
                e = {"step": step, "kind": kind, "tensor": r.name, "idx": seen[kind][str(r.name)],
                     "nan": int(r.nan or 0), "inf": int((r.posinf or 0) + (r.neginf or 0))}
                expected = step in skipped and kind in EXPECTED_WHEN_SKIPPED
                first = kept[expected]
                if not first or first[0]["step"] == step:
                    first.append(e)
                elif step not in stand_in[expected]:
                    stand_in[expected][step] = e
        events = [*kept[True], *kept[False], *stand_in[True].values(), *stand_in[False].values()]
        for e in events:  # grads in backward order: the last parameter's gradient is made first
            e["pos"] = len(seen["grads"]) - 1 - e["idx"] if e["kind"] == "grads" else e["idx"]
        return events

    def _scalar_events(self, run: Any) -> list[dict[str, Any]]:
        sc = run.scalars()
        cols = [c for c in sc.columns if c != "skipped" and matches(c, self.scalars)]
        logged_nan = _logged_nans(run)
        goal = objective(run).name or DEFAULT_OBJECTIVE
        out = []
        for col in cols:
            kind, pos = _scalar_place(col, goal)
            v = pd.to_numeric(sc[col], errors="coerce")
            for step, x in v.items():
                if pd.isna(x):
                    if (int(step), col) not in logged_nan:
                        continue  # not logged at this step
                    nan, inf = 1, 0
                elif abs(x) == float("inf"):
                    nan, inf = 0, 1
                else:
                    continue
                out.append({"step": int(step), "kind": kind, "tensor": col, "pos": pos, "nan": nan, "inf": inf,
                            "objective": col == goal})
        return out


def _scalar_place(name: str, goal: str) -> tuple[str, int]:
    """(kind for CAUSAL_RANK, position among its kind) of a logged scalar (see GRAD_SCALARS)."""
    if matches(name, HYPER_SCALARS):
        return "hyper", 0
    if matches(name.lower(), GRAD_SCALARS):
        return "grad_scalar", 0
    if name == goal:
        return "scalar", 0
    return "scalar", 1 if "loss" in name.lower() else 2


def _logged_nans(run: Any) -> set[tuple[int, str]]:
    """(step, name) of scalars logged as NaN.

    SQLite stores a NaN REAL as NULL, so in ``run.scalars()`` a logged NaN looks
    like "not logged at this step"; the catalog still has the row, so ask it.
    """
    return {(s, n) for s, n, _ in run.scalar_rows(nan_only=True)}  # checked: integer steps, text names


def _order(e: dict[str, Any]) -> tuple[int, int, int]:
    return (e["step"], CAUSAL_RANK.get(e["kind"], 9), e["pos"])
