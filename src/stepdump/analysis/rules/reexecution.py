"""``reexecution``: the verdicts of re-executions written back into the run (docs/reexecute.md).

``stepdump.reexecute(..., write_back=True)`` (``stepdump reexecute --write-back``) stores its verdict
under ``meta.reexecutions``; this rule puts each one that is not *reproduces*, and each NaN/Inf
origin ``find_nan`` named, among the findings of its step, so ``stepdump check`` and the report
show them. A step that reproduces without a NaN gives no finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules.base import Rule, register_rule
from stepdump.read.activations import reexecutions

# A verdict's quantity -> the tensor kind it names
_KIND = {"grads": "grads", "params after the update": "params", "optimizer after the update": "optimizer"}


@register_rule
@dataclass(frozen=True, kw_only=True)
class Reexecution(Rule):
    """An ERROR where a re-executed step differs from the record while re-execution is stable on the
    recording's own setup (a suspected silent corruption at record time); a WARNING where it differs
    because this host computes differently, or where re-executions disagree (nondeterminism); a
    WARNING naming the first op whose output held a NaN/Inf (``find_nan``)."""

    name: ClassVar[str] = "reexecution"

    def __call__(self, run: Any) -> list[Finding]:
        out = []
        for step, mark in reexecutions(run).items():
            if not isinstance(mark, dict):
                continue
            verdict = str(mark.get("verdict", "?"))
            first = mark.get("first") if isinstance(mark.get("first"), list) else None
            parts, severity = [], Severity.WARNING
            if verdict != "reproduces":
                where = f", first at {first[0]} {first[1]!r}" if first and len(first) == 2 else ""
                n = mark.get("n_differing", len(mark.get("differing") or []))
                text = f"re-executed step {step}: {verdict}{where} ({n} quantities differ)"
                if verdict == "nondeterministic":
                    op = mark.get("op")
                    text += f"; first op that differs: {op['where']}" if isinstance(op, dict) else ""
                elif mark.get("cause") == "environment":
                    text += "; this host computes differently: " + "; ".join(map(str, mark.get("environment") or []))
                else:
                    severity = Severity.ERROR
                    text += ("; re-execution is stable and the setup matches the recording: suspected silent data "
                             "corruption at record time")
                parts.append(text)
            nan = mark.get("nan_op")
            if isinstance(nan, dict):
                stats = "; ".join(f"input {i}: {s}" for i, s in enumerate(nan.get("input_stats") or []))
                parts.append(f"first NaN/Inf of step {step}: {nan.get('where')}" + (f" ({stats})" if stats else ""))
            if not parts:
                continue
            kind = _KIND.get(first[0]) if verdict != "reproduces" and first and len(first) == 2 else None
            tensor = first[1] if kind is not None and first else None
            out.append(self.finding(severity, step, "; ".join(parts) + " (stepdump reexecute --write-back; "
                                    "docs/reexecute.md)", kind=kind, tensor=tensor))
        return out
