"""Words for a diff: the headline, the one-line reading of the first differences, the coverage.

The reading follows the causal order of one iteration: whatever differs earliest at the first
divergent step is the cause, and what was recorded *equal* at that step narrows it down (params
equal and grads different, with the batch and the RNG recorded equal, leaves the model's code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepdump.analysis.diff import DiffResult

_SHOWN = 5


def headline(res: DiffResult) -> str:
    """Identical, nothing comparable, or where the runs part and the first thing that differs."""
    where = f" on rank {res.rank}" if res.rank is not None else ""
    ranks = f" on each of {len(res.per_rank)} ranks" if res.per_rank else ""
    if not res.comparable:
        return f"nothing to compare{where}: {_why_incomparable(res)}; not identical"
    if res.first_step is None:
        return f"identical over {res.steps_compared} common steps{ranks}"
    cause = res.differences[0] if res.differences else None
    first = cause.what if cause is not None else "?"
    if cause is not None and cause.tensor is None and (cause.a is not None or cause.b is not None):
        first += f" ({cause.describe().split(': ', 1)[1]})"
    return f"runs diverge at step {res.first_step}{where}, first at {first}"


def reading(res: DiffResult, *, prev_compared: bool | None, parts_at_step: set[str]) -> str:
    """One line: what differs first and what that points at ("" when nothing differs).

    Args:
        prev_compared: Whether the common step just before ``first_step`` was compared (and so
            was equal); None when ``first_step`` is the first step compared.
        parts_at_step: The parts of the recorded state both runs had at ``first_step``
            (``rng``, ``batch``, ...).
    """
    if res.first_step is None or not res.differences:
        return ""
    k, diffs = res.first_step, res.differences
    stage = diffs[0].stage
    whats = [d.what for d in diffs if d.stage == stage]
    named = ", ".join(whats[:3]) + (f" and {len(whats) - 3} more" if len(whats) > 3 else "")
    verb = "differs" if len(whats) == 1 else "differ"
    params_equal = "params" in res.coverage.kinds
    if stage == "hyperparameters":
        if all(w.startswith("scaler") for w in whats):
            text = f"{named} {verb} at step {k} → the AMP loss scaling differs"
        else:
            text = f"{named} {verb} at step {k} → the schedule/hyperparameters differ"
    elif stage == "rng":
        text = (f"the RNG state differs at the start of step {k} ({named}) → the seeds differ, or one run drew "
                "random numbers the other did not (dropout, sampling, augmentation)")
    elif stage == "batch":
        text = f"the batch differs at step {k} ({named}) → the data differs (order, shuffling seed, augmentation)"
    elif stage == "params":
        if prev_compared is None:
            text = (f"params differ at the first compared step ({k}) → the runs start from different weights "
                    "(initialization seed or checkpoint)")
        elif prev_compared:
            text = (f"params differ at step {k} while everything compared at step {k - 1} was equal → the weights "
                    "were changed outside the optimizer step (a manual edit, an EMA written back), or the update "
                    "used something that was not recorded")
        else:
            text = f"params differ at step {k} (the step before was not compared) → an earlier update differed"
    elif stage in ("forward", "grads"):
        lead = "params equal, " if params_equal else ""
        what = named if stage == "forward" else "grads"
        text = f"{lead}{what} {verb if stage == 'forward' else 'differ'} at step {k} → {_inputs_cause(res, parts_at_step)}"
    elif whats == ["skipped by the GradScaler"]:
        text = (f"the GradScaler skipped step {k} in one run only → the grads held inf/NaN in one run "
                "(the loss scale or the grads differ)")
    else:
        text = (f"params and grads equal, optimizer state differs at step {k} → the optimizer state was "
                "initialized or restored differently")
    if res.config:
        text += f" (recorded with different {', '.join(key for key, _, _ in res.config)})"
    return text


def _inputs_cause(res: DiffResult, parts: set[str]) -> str:
    """What makes the outputs differ from equal params: narrowed by the inputs recorded equal."""
    rng = "rng" in parts
    batch = "inputs" in res.coverage.kinds or "batch" in parts
    if rng and batch:
        return "the model's code, the loss or their numerics differ (the batch and the RNG are equal)"
    if rng:
        return "the batch or the model's code differs (the RNG is equal; the batch was not recorded)"
    if batch:
        return "the RNG (dropout) or the model's code differs (the batch is equal; the RNG was not recorded)"
    return "the batch or the RNG differs, or the model's code (neither was recorded to tell)"


def summary_lines(res: DiffResult) -> list[str]:
    """The headline, the reading, the differences at the first step, what was and was not compared."""
    lines = [headline(res)]
    if res.reading:
        lines.append(f"reading: {res.reading}")
    if res.first_step is not None and len(res.differences) > 1:
        whats = [d.what for d in res.differences]
        more = f" (+{len(whats) - _SHOWN} more)" if len(whats) > _SHOWN else ""
        lines.append(f"at step {res.first_step}: {'; '.join(whats[:_SHOWN])}{more}")
    if res.first_tensor_step is not None and res.first_tensor_step != res.first_step and res.tensors:
        lines.append(f"tensors first differ at step {res.first_tensor_step}: {res.tensors[0].describe()}")
    lines.append("compared: " + compared_text(res))
    missing = not_compared_text(res)
    if missing:
        lines.append("not compared: " + missing)
    if res.config:
        lines.append("recorded with different settings: " + "; ".join(f"{k} A {a!r}, B {b!r}" for k, a, b in res.config))
    return lines


def compared_text(res: DiffResult) -> str:
    c = res.coverage
    parts = [f"{res.steps_compared} common steps",
             f"{c.tensors} tensors ({', '.join(c.kinds) or 'none'}) in {c.tensor_checks} step-tensor checks"]
    if c.state_steps:
        parts.append(f"recorded state ({', '.join(c.state_parts) or 'empty'}) at {c.state_steps} steps")
    if c.lr_steps:
        parts.append(f"lr at {c.lr_steps} steps")
    if c.scalars:
        parts.append(f"scalars {', '.join(c.scalars[:8])}" + (f" (+{len(c.scalars) - 8})" if len(c.scalars) > 8 else ""))
    return "; ".join(parts)


def not_compared_text(res: DiffResult) -> str:
    c, parts = res.coverage, []
    if res.steps_only_in_a or res.steps_only_in_b:
        parts.append(f"steps only in A: {_steps(res.steps_only_in_a)}, only in B: {_steps(res.steps_only_in_b)}")
    for side, names in (("A", res.names_only_in_a), ("B", res.names_only_in_b)):
        if names:
            parts.append(f"{len(names)} tensors only in {side} (e.g. {_name(names[0])})")
    for side, kinds in (("A", c.kinds_only_in_a), ("B", c.kinds_only_in_b)):
        if kinds:
            parts.append(f"kinds recorded by {side} only: {', '.join(kinds)}")
    for side, scalars in (("A", c.scalars_only_in_a), ("B", c.scalars_only_in_b)):
        if scalars:
            parts.append(f"scalars only in {side}: {', '.join(scalars[:5])}" + ("..." if len(scalars) > 5 else ""))
    if c.state_missing:
        none = " (no step has one in both runs)" if not c.state_steps else ""
        parts.append(f"hyperparameters other than lr, scheduler, scaler and RNG state at {c.state_missing} steps "
                     f"without a recorded state in both runs{none}")
    if res.comparable and "lr" not in c.scalars:
        parts.append("lr (not logged by both runs)")
    return "; ".join(parts)


def _why_incomparable(res: DiffResult) -> str:
    if res.steps_compared == 0:
        return (f"no step has fingerprints in both runs (A: {_steps(res.steps_only_in_a)}; "
                f"B: {_steps(res.steps_only_in_b)})")
    if res.names_only_in_a or res.names_only_in_b:
        a, b = res.names_only_in_a, res.names_only_in_b
        if not res.coverage.tensors:
            return (f"the runs have no tensor names in common (A: {len(a)}{_eg(a)}; B: {len(b)}{_eg(b)})")
    return "no tensor was recorded by both runs at a common step (of the kinds compared)"


def _eg(names: list[Any]) -> str:
    return f", e.g. {_name(names[0])}" if names else ""


def _name(key: Any) -> str:
    return f"{key[0]} {key[1]}"


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    shown = ", ".join(map(str, steps[:6]))
    return shown + (f" ... ({len(steps)} steps)" if len(steps) > 6 else "")
