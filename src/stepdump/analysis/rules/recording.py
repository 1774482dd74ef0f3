"""``recording_stopped``: the Recorder stepped aside during the run (do no harm, docs/reliability.md).

The training went on, unrecorded, after a failure inside the recorder (full
disk, an I/O error, a bug). The run says where in its meta; this rule puts it
among the findings, so ``stepdump check`` and the report show it, not only
``stepdump info``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules.base import Rule, register_rule


@register_rule
@dataclass(frozen=True, kw_only=True)
class RecordingStopped(Rule):
    """One WARNING when recording stopped before the training did: the first step not
    recorded, where and why, and the last step the run holds."""

    name: ClassVar[str] = "recording_stopped"

    def __call__(self, run: Any) -> list[Finding]:
        mark = run.meta.get("recording_stopped")
        if not isinstance(mark, dict) or not isinstance(mark.get("step"), int):
            return []
        last = mark.get("last_committed")
        held = "the run holds no step" if not isinstance(last, int) else f"the run ends at step {last}"
        return [self.finding(
            Severity.WARNING, mark["step"],
            f"recording stopped at step {mark['step']} ({mark.get('where', '?')}): {mark.get('error', '?')}; "
            f"training went on unrecorded and {held}",
        )]
