"""Op-level localize: the first op that differs between two setups re-executing the same step.

``stepdump.localize`` names the first *module* whose output differs; this names the op inside it
(e.g. GELU tanh vs exact in a port): both setups are put in the state of the recorded step, fed
its batch and RNG, and run under the op tracer (:mod:`stepdump.core.optrace`); the first op whose
output differs while its inputs are equal is named with its module path and source line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepdump.analysis.localize import Setup
from stepdump.core.optrace import OpRecord, first_op_difference
from stepdump.reexec.engine import check_batch, execute, prepare, stored_batch


@dataclass
class OpLocalization:
    """Where two setups first part within one step, op by op (``op`` None: every op agrees)."""

    step: int
    op: OpRecord | None
    other: OpRecord | None
    reason: str
    ops_compared: int

    def summary(self) -> str:
        if self.op is None:
            return f"step {self.step}: all {self.ops_compared} ops agree, bit for bit, in both setups"
        return f"step {self.step}: first op that differs: {self.op.where()} ({self.reason})"


def localize_ops(run: Any, step: int, a: Setup | tuple, b: Setup | tuple, *, batch: Any = None) -> OpLocalization:
    """Re-execute ``step`` of ``run`` in setups ``a`` and ``b`` (``Setup`` or ``(model, optimizer,
    train_step)``) under the op tracer and name the first op whose output differs while its inputs
    are equal. Each setup's state is reached as :func:`stepdump.reexecute` reaches it."""
    sa, sb = (s if isinstance(s, Setup) else Setup(*s) for s in (a, b))
    if batch is not None:
        check_batch(run, step, batch)
    traces = []
    for s in (sa, sb):
        prep = prepare(run, step, s.model, s.optimizer, s.train_step)
        given = batch if batch is not None else stored_batch(
            run, step, run.step_state(step) if run.catalog.has_state(step) else {})
        traces.append(execute(prep, given, s.model, s.optimizer, s.train_step, trace=True).ops)
    ra, rb = (t.records for t in traces if t is not None)
    found = first_op_difference(ra, rb)
    if found is None:
        return OpLocalization(step, None, None, "", min(len(ra), len(rb)))
    op, other, reason = found
    return OpLocalization(step, op, other, reason, op.index + 1)
