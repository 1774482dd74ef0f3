"""What to record: kinds, tensor-name globs and step schedules."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Union

from stepdump.errors import ConfigError
from stepdump.store.format import LEVEL_FULL, LEVEL_NONE, LEVEL_STATS, TENSOR_KINDS

Every = Union[int, range, Iterable[int], Callable[[int], bool], None]

CORE_KINDS = ("params", "grads", "optimizer")


class StepSet:
    """Which steps an action happens at: every n-th, a range, a set, or a predicate."""

    def __init__(self, every: Every, what: str = "every") -> None:
        self.description: str
        self._pred: Callable[[int], bool]
        self.dynamic = callable(every) and not isinstance(every, (int, range))  # may change its mind
        if every is None:
            self._pred, self.description = (lambda s: False), "never"
        elif isinstance(every, bool):
            raise ConfigError(f"{what} must be an int, range, iterable of steps or callable, not a bool")
        elif isinstance(every, int):
            if every < 1:
                raise ConfigError(f"{what}={every}: give a positive step interval (1 = every step), or None")
            n = every
            self._pred, self.description = (lambda s: s % n == 0), f"every {n}"
        elif isinstance(every, range):
            r = every
            self._pred, self.description = (lambda s: s in r), repr(r)
        elif callable(every):
            fn = every
            self._pred, self.description = (lambda s: bool(fn(s))), getattr(fn, "__name__", "callable")
        else:
            try:
                if isinstance(every, (str, bytes)):  # iterable, but "12" is not steps {1, 2}
                    raise TypeError
                steps = frozenset(int(s) for s in every)
            except (TypeError, ValueError) as e:
                raise ConfigError(
                    f"{what} must be an int, range, iterable of steps or callable; got {type(every).__name__}"
                ) from e
            self._pred, self.description = steps.__contains__, f"{len(steps)} listed steps"

    def __call__(self, step: int) -> bool:
        return self._pred(step)


def check_kinds(capture: Iterable[str] | str) -> tuple[str, ...]:
    kinds = (capture,) if isinstance(capture, str) else tuple(capture)
    for k in kinds:
        if k not in TENSOR_KINDS:
            raise ConfigError(f"unknown capture kind {k!r}; choose from {', '.join(TENSOR_KINDS)}")
    return kinds


class NameFilter:
    """include/exclude glob patterns over tensor names (fnmatch syntax)."""

    def __init__(self, include: str | Iterable[str] | None = "*", exclude: str | Iterable[str] | None = None):
        self.include = patterns(include, ["*"], "include")
        self.exclude = patterns(exclude, [], "exclude")
        self._memo: dict[str, bool] = {}  # asked for the same names at every step (and several times per step)

    def __call__(self, name: str) -> bool:
        got = self._memo.get(name)
        if got is None:
            got = self._memo[name] = any(fnmatch.fnmatchcase(name, p) for p in self.include) and not any(
                fnmatch.fnmatchcase(name, p) for p in self.exclude)
        return got


def patterns(value: str | Iterable[str] | None, default: list[str], what: str = "include/exclude") -> list[str]:
    """Glob pattern(s) as a list (``default`` for None); ConfigError for anything but strings."""
    if value is None:
        return default
    if isinstance(value, str):
        return [value]
    try:
        pats = list(value)
    except TypeError:
        pats = [value]  # type: ignore[list-item]
    if not all(isinstance(p, str) for p in pats):
        raise ConfigError(f"{what}= takes a glob string or a list of glob strings, got {value!r}")
    return pats


class Levels:
    """A schedule's ``(full, stats)`` steps as a step's record level (``store.format.LEVEL_*``)."""

    def __init__(self, full: Every, stats: Every) -> None:
        self.full, self.stats = StepSet(full, "every"), StepSet(stats, "stats_every")
        # The hooks ask for the same step's level four to six times a step: a fixed schedule's
        # answer for the last step asked is kept (a callable's may change between two asks:
        # a trigger the loop sets is asked again every time).
        self._fixed = not (self.full.dynamic or self.stats.dynamic)
        self._last: tuple[int | None, int] = (None, LEVEL_NONE)  # (a dynamic schedule's stays so)

    def __call__(self, t: int) -> int:
        last = self._last
        if last[0] == t:
            return last[1]
        level = LEVEL_FULL if self.full(t) else LEVEL_STATS if self.stats(t) else LEVEL_NONE
        if self._fixed:
            self._last = (t, level)
        return level
