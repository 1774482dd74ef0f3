"""``stepdump verify`` of a gradient log: re-apply every segment's recorded updates.

Intact blobs are not enough in a gradient log: its params and optimizer state between keyframes
exist only as the recorded updates re-applied, so each segment (keyframe to next keyframe, the
last one to the last recorded step) is re-run and checked at every step that has fingerprints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stepdump.errors import ReadBudgetError, RebuildError, StepdumpError
from stepdump.read.gradlog_chain import GroupsChanged
from stepdump.store.format import LEVEL_STATS

if TYPE_CHECKING:
    from stepdump.read.gradlog import GradientLog


@dataclass
class SegmentReport:
    """What :meth:`GradientLog.verify_segments` found (``stepdump verify``)."""

    checked: int = 0  # segments whose updates reproduced every recorded fingerprint up to the next keyframe
    problems: list[tuple[int, str]] = field(default_factory=list)  # (first step that differs, why)
    unchecked: list[str] = field(default_factory=list)  # what could not be re-run here, and why


def verify_segments(engine: GradientLog, progress: Callable[[int, int], None] | None = None) -> SegmentReport:
    """Re-apply every segment of ``engine``'s run. Each segment costs its K updates.

    A segment that does not reproduce is a problem (its first step that differs), whatever the
    reason: a gradient or hyperparameter record that is consistent with its own checksum and
    fingerprint but not the one training used, or another kernel than the recording's (the
    error names which the run and this host point at). What cannot be re-run here at all (the
    optimizer, a device this machine lacks, ``add_param_group`` between keyframes) or not within
    the read budget (gradlog_budget.py: the whole verify shares one) is listed as unchecked.
    ``progress(done, total)``: after each segment.
    """
    report = SegmentReport()
    refusal = engine.refusal()
    if refusal is not None:
        report.unchecked.append(str(refusal))
        return report
    run = engine.run
    keys = engine.keyframes()
    logged = run.catalog.steps(LEVEL_STATS)
    ends = [*keys[1:], max(logged, default=keys[-1]) if keys else 0]
    with engine.read_call() as budget:
        for i, (k, end) in enumerate(zip(keys, ends, strict=True)):
            try:
                budget.reserve(run, k, end - 1, end)  # the whole call's work, bounded before it is done
                engine.replay(k, end)
                report.checked += 1
            except ReadBudgetError as e:  # not re-applied: nothing is known about the segment
                report.unchecked.append(f"the segment from keyframe {k}: {e}")
            except RebuildError as e:
                if isinstance(e, GroupsChanged):
                    report.unchecked.append(str(e))
                else:
                    report.problems.append((k if e.step is None else e.step, str(e)))
            except StepdumpError as e:  # a damaged blob or record on the way (the blob checks name it too)
                report.problems.append((k, f"the segment from keyframe {k} cannot be re-applied: {e}"))
            if progress is not None:
                progress(i + 1, len(keys))
    return report
