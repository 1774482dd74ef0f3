"""``recording_stopped``: the Recorder stepped aside during the run (do no harm, docs/reliability.md),
or recorded nothing at all.

The training went on, unrecorded, after a failure inside the recorder (full
disk, an I/O error, a bug). The run says where in its meta; this rule puts it
among the findings, so ``stepdump check`` and the report show it, not only
``stepdump info``. A run that holds no step (the loop never stepped the optimizer
given to the Recorder: SAM's ``first_step`` / ``second_step``, a hand-written update)
is said the same way: every other rule would find nothing in it.
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
            return self._no_step(run)
        last = mark.get("last_committed")
        held = "the run holds no step" if not isinstance(last, int) else f"the run ends at step {last}"
        return [self.finding(
            Severity.WARNING, mark["step"],
            f"recording stopped at step {mark['step']} ({mark.get('where', '?')}): {mark.get('error', '?')}; "
            f"training went on unrecorded and {held}",
        )]

    def _no_step(self, run: Any) -> list[Finding]:
        """One WARNING when the run holds no step, naming the optimizer seen stepping instead."""
        if run.steps:
            return []
        info = run.meta.get("no_step")
        info = info if isinstance(info, dict) else {}
        instead = info.get("stepped_instead")
        iterations = info.get("iterations")
        seen = f" after {iterations} iterations that logged scalars" if isinstance(iterations, int) and iterations else ""
        why = (f"; {instead} stepped its params instead: record with that optimizer" if isinstance(instead, str)
               else "; give the Recorder the optimizer whose step() the loop calls")
        return [self.finding(
            Severity.WARNING, None,
            f"the run holds no step: no step() of the optimizer given to the Recorder "
            f"({run.meta.get('optimizer_class', '?')}) ran{seen}, so nothing but scalars was recorded{why}",
        )]
