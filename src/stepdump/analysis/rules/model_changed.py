"""``model_changed``: the model's structure changed mid-run (pruning, a parametrization, a module replaced).

The record follows the model (capture/structure.py): from the step of the change on, its params
and buffers are recorded under the model's new names, and each step restores and exports into
the model as it was at that step. This rule says where that happened, so that a reader who
restores a step knows which model to build, and a sudden change of a weight's name or of the
loss there has its cause beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules.base import Rule, register_rule


@register_rule
@dataclass(frozen=True, kw_only=True)
class ModelChanged(Rule):
    """One INFO finding per change of the model's structure, at its step, naming what was removed
    and added (``2.weight`` -> ``2.weight_orig`` and the buffer ``2.weight_mask`` for pruning)."""

    name: ClassVar[str] = "model_changed"

    def __call__(self, run: Any) -> list[Finding]:
        from stepdump.read.state import describe_change, layout_changes

        if not isinstance(getattr(run, "meta", None), dict):
            return []
        return [self.finding(
            Severity.INFO, step,
            f"the model's structure changed at step {step} ({describe_change(before, after)}; pruning, a "
            "parametrization or a module replaced): steps from here restore and export into the model as it "
            "is after the change, earlier ones into the model before it",
        ) for step, before, after in layout_changes(run)]
