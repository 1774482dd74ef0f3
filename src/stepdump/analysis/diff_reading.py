"""Words for a diff: the headline, the one-line reading of the first differences, the coverage.

The reading follows the causal order of one iteration: whatever differs earliest at the first
divergent step is the cause, and what was recorded *equal* at that step narrows it down (params
equal and grads different, with the batch and the RNG recorded equal, leaves the model's code).

An RNG stream is never the verdict (it may differ while nothing computed from it does); where it
differs at the start of the divergent step and the loss or grads differ from equal params, the
reading names it as the likely cause, and where it differs and nothing computed does, a note says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepdump.analysis.diff_result import DiffResult
    from stepdump.analysis.diff_state import RngDiff

_SHOWN = 5


def headline(res: DiffResult) -> str:
    """Identical, nothing comparable, or where the runs part and the first thing that differs."""
    where = f" on rank {res.rank}" if res.rank is not None else f" in pair {res.pair}" if res.pair else ""
    ranks = f" on each of {len(res.per_rank)} ranks" if res.per_rank else ""
    if not res.comparable:
        return f"nothing to compare{where}: {_why_incomparable(res)}; not identical"
    if res.first_step is None and res.noise is not None:
        return (f"no difference beyond the noise over {res.steps_compared} common steps: every one is within "
                f"the noise among A and its {res.noise.repeats} repeat(s) (run-level false-alarm rate "
                f"{res.noise.alpha * 100:g}%)")
    if res.first_step is None and res.coverage.fp_kinds_differ:
        return (f"no difference in what was compared over {res.steps_compared} common steps{ranks}; not identical: "
                f"{fp_kinds_text(res)}")
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
    if not (res.steps_compared or res.steps_only_in_a or res.steps_only_in_b):
        # Only logged scalars, no recorded state: nothing tells what made them differ.
        return (f"{named} {verb} at step {k}, and neither run holds a step (no step() of the optimizer given to "
                "the Recorder ran; `stepdump check` says which one did), so nothing recorded can tell why")
    params_equal = "params" in res.coverage.kinds
    if stage == "hyperparameters":
        if all(w.startswith("scaler") for w in whats):
            text = f"{named} {verb} at step {k} → the AMP loss scaling differs"
        else:
            text = f"{named} {verb} at step {k} → the schedule/hyperparameters differ"
    elif stage == "batch":
        text = (f"the batch differs at step {k} ({named}) → the data differs (order, shuffling seed, augmentation)"
                + _rng_too(res, k, parts_at_step))
    elif stage == "params":
        if prev_compared is None:
            text = (f"params differ at the first compared step ({k}) → the runs start from different weights "
                    "(initialization seed or checkpoint)" + _rng_too(res, k, parts_at_step))
        elif prev_compared:
            text = (f"params differ at step {k} while everything compared at step {k - 1} was equal → the weights "
                    "were changed outside the optimizer step (a manual edit, an EMA written back), or the update "
                    "used something that was not recorded")
        else:
            text = f"params differ at step {k} (the step before was not compared) → an earlier update differed"
    elif stage in ("forward", "grads"):
        lead = "params equal, " if params_equal else ""
        what = named if stage == "forward" else "grads"
        text = (f"{lead}{what} {verb if stage == 'forward' else 'differ'} at step {k} → "
                f"{_inputs_cause(res, k, parts_at_step)}")
    elif whats == ["skipped by the GradScaler"]:
        text = (f"the GradScaler skipped step {k} in one run only → the grads held inf/NaN in one run "
                "(the loss scale or the grads differ)")
    else:
        text = (f"params and grads equal, optimizer state differs at step {k} → the optimizer state was "
                "initialized or restored differently")
    if res.config:
        text += f" (recorded with different {', '.join(key for key, _, _ in res.config)})"
    return text


def _inputs_cause(res: DiffResult, k: int, parts: set[str]) -> str:
    """What makes the outputs differ from equal params: the RNG where it differs at the start of
    the step, else narrowed by the inputs recorded equal."""
    at_k = [d.stream for d in res.rng if d.last_step == k]
    if "rng" in parts and at_k:
        return (f"the {_and(at_k)} RNG {_verb(at_k)} at the start of step {k} (the likely cause: dropout, "
                "sampling or augmentation drew other numbers)")
    rng = "rng" in parts
    batch = "inputs" in res.coverage.kinds or "batch" in parts
    unknown = "was left out" if "rng" in res.ignored else "was not recorded"
    if rng and batch:
        return "the model's code, the loss or their numerics differ (the batch and the RNG are equal)"
    if rng:
        return "the batch or the model's code differs (the RNG is equal; the batch was not recorded)"
    if batch:
        return (f"the RNG (dropout) or the model's code differs (the batch is equal; the RNG {unknown})"
                + _rng_too(res, k, parts))
    return ("the batch or the RNG differs, or the model's code (neither was recorded to tell)"
            + _rng_too(res, k, parts))


def _rng_too(res: DiffResult, k: int, parts: set[str]) -> str:
    """``; the numpy RNG differs too (...)``: RNG streams that may explain a difference at step
    ``k`` without being the verdict ("" when none does)."""
    if "rng" in parts:  # step k's RNG was compared: only a stream differing there can explain it
        at_k = [d.stream for d in res.rng if d.last_step == k]
        return f"; the {_and(at_k)} RNG {_verb(at_k)} too (a possible cause)" if at_k else ""
    if not res.rng:
        return ""
    first = min(d.first_step for d in res.rng)
    streams = [d.stream for d in res.rng]
    return (f"; the {_and(streams)} RNG {_verb(streams)} from step {first} on (a possible cause; the RNG of "
            f"step {k} was not recorded)")


def rng_notes(rng: list[RngDiff], compared: int, first_step: int | None) -> list[str]:
    """One note per group of RNG streams that differ alike: where, and that nothing computed
    differs (before ``first_step``, when the runs diverge later)."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for d in rng:
        groups.setdefault((d.first_step, d.last_step, d.steps), []).append(d.stream)
    notes = []
    for (first, last, steps), streams in groups.items():
        span = f"{first}-{last}" if first != last else f"step {first}"
        where = (f"every step compared ({span})" if steps == compared
                 else f"{steps} of {compared} steps compared (first at step {first})")
        text = f"{_and(streams)} RNG {_verb(streams)} at {where}"
        if first_step is None:
            text += "; nothing computed differs"
        elif first < first_step:
            text += f"; nothing computed differs before step {first_step}"
        notes.append(text)
    return notes


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _verb(words: list[str]) -> str:
    return "differs" if len(words) == 1 else "differ"


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
    lines += [f"note: {n}" for n in res.notes]
    lines.append("compared: " + compared_text(res))
    missing = not_compared_text(res)
    if missing:
        lines.append("not compared: " + missing)
    if res.ignored:
        lines.append(f"ignored: {', '.join(res.ignored)} (left out of the comparison)")
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
    if c.fp_kinds_differ:
        parts.append(fp_kinds_text(res))
    if res.comparable and not any(s == "lr" or s.endswith("/lr") for s in c.scalars):  # a joint run's: G/lr
        parts.append("lr (not logged by both runs)")
    return "; ".join(parts)


def fp_kinds_text(res: DiffResult) -> str:
    """The step-tensor checks a diff could not make for two fingerprint kinds, with the first."""
    c = res.coverage
    first = c.fp_kinds_differ_first
    if first is None:
        return ""
    step, kind, name, ka, kb = first
    checks = "1 step-tensor check" if c.fp_kinds_differ == 1 else f"{c.fp_kinds_differ} step-tensor checks"
    return (f"{checks} (first: step {step}, {kind} {name}): fingerprint kinds differ ({ka} in A, {kb} in B) and no "
            "bytes are stored at this step")


def _why_incomparable(res: DiffResult) -> str:
    if res.coverage.fp_kinds_differ and not res.coverage.tensor_checks:
        return fp_kinds_text(res)
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
    kind, name = key
    return f"{kind} {name}"


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    shown = ", ".join(map(str, steps[:6]))
    return shown + (f" ... ({len(steps)} steps)" if len(steps) > 6 else "")
