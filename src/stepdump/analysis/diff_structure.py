"""Two runs whose models changed structure differently (one pruned at step 3, the other not).

Where the structure of one model changed mid-run (pruning, a parametrization, a module replaced:
meta ``layouts``, FORMAT.md) and the other's did not at that step, their tensors from there on
have different names, and the first values that differ follow from that change, not from the batch
or the RNG. :func:`structure_reading` says so, at the step of the change.
"""

from __future__ import annotations

from typing import Any


def _changes(run: Any) -> dict[int, str]:
    """step -> what changed there, for a single store."""
    from stepdump.read.state import describe_change, layout_changes

    if not isinstance(getattr(run, "meta", None), dict):
        return {}
    return {step: describe_change(before, after) for step, before, after in layout_changes(run)}


def structure_notes(run_a: Any, run_b: Any) -> list[tuple[int, str]]:
    """(step, note) for each change of the model's structure one run has and the other has not
    at the same step, oldest first."""
    ca, cb = _changes(run_a), _changes(run_b)
    notes = []
    for step in sorted(ca.keys() | cb.keys()):
        if ca.get(step) == cb.get(step):
            continue
        said = [f"{who}: {c[step]}" for who, c in (("A", ca), ("B", cb)) if step in c]
        notes.append((step, f"the model's structure changed at step {step} ({'; '.join(said)}: pruning, a "
                            "parametrization or a module replaced), in one run only"))
    return notes


def structure_reading(first_step: int | None, notes: list[tuple[int, str]]) -> str | None:
    """The reading of a divergence at ``first_step`` that a structure change at or before it explains."""
    if first_step is None:
        return None
    before = [(s, n) for s, n in notes if s <= first_step]
    if not before:
        return None
    step, note = before[0]
    return f"{note} → the runs train different models from step {step}"
