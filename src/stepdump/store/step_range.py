"""What a ``steps=`` argument is, and the steps a catalog can hold: torch-free and query-free
(the catalog's queries and the stat arrays both select steps by these)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from stepdump.errors import ConfigError

#: What a ``steps=`` argument takes: a step, a range, a slice, an iterable of steps, or None (all).
StepRange = int | range | slice | Iterable[int] | None

#: The largest step a catalog can hold (SQLite stores 64-bit integers).
MAX_STEP = 2**63 - 1


def as_step(step: Any) -> int:
    """Steps often come out of a DataFrame as numpy.int64, which SQLite would bind as a
    blob that equals no step; take anything that is an integer, refuse the rest (and one
    outside 64 bits, which SQLite cannot bind: an OverflowError otherwise)."""
    if isinstance(step, bool):
        raise ConfigError(f"a step is an integer, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"a step is an integer, got {type(step).__name__} {step!r}") from None
    if not -MAX_STEP - 1 <= value <= MAX_STEP:
        raise ConfigError(f"step {value} is out of range: steps are 0 to {MAX_STEP}")
    return value


def clamped(steps: range) -> range:
    """``steps`` (stride > 0) cut to the steps a catalog can hold, 0 to MAX_STEP, the same
    steps in it selected: its bounds can then be bound as SQLite integers."""
    start = steps.start
    if start < 0:  # the first of its steps at 0 or above
        start += -(start // steps.step) * steps.step
    if start > MAX_STEP:
        return range(0)
    return range(start, min(max(steps.stop, 0), MAX_STEP + 1), min(steps.step, MAX_STEP))


__all__ = ["MAX_STEP", "StepRange", "as_step", "clamped"]
