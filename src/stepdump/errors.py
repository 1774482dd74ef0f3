"""Every error stepdump raises derives from :class:`StepdumpError`.

Each subclass names a situation a user can act on, and every message says what
happened and what to do about it. The CLI maps these classes to exit codes; the
library itself never exits or prints.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class StepdumpError(Exception):
    """Base class of every error raised by stepdump."""


class ConfigError(StepdumpError, ValueError):
    """An argument to a stepdump function or class is invalid."""


class NotARunError(StepdumpError, FileNotFoundError):
    """The path does not hold a stepdump run."""


class FormatVersionError(StepdumpError):
    """The run was written in a store format this stepdump cannot read."""


class RunExistsError(StepdumpError, FileExistsError):
    """A Recorder was pointed at a directory that already holds a run."""


class RunLockedError(StepdumpError):
    """Another Recorder is still writing this run."""


class StepNotFoundError(StepdumpError, KeyError):
    """The requested step was not recorded (or not with the data asked for)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TensorNotFoundError(StepdumpError, KeyError):
    """The requested tensor name or kind does not exist in the run."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RestoreMismatchError(StepdumpError):
    """The objects given to restore do not match what the run recorded."""


class CorruptDataError(StepdumpError):
    """Stored bytes fail their checksum or cannot be decoded."""


class InterruptedWriteError(StepdumpError):
    """A write to the run's catalog was cut off (a process killed mid-transaction left a hot
    ``catalog.sqlite-journal``), and rolling it back needs write access this process lacks.

    Nothing committed is lost: opening the run once with write access to its directory (any
    stepdump command, ``stepdump.open``, a Recorder) rolls it back.
    """


class WriterError(StepdumpError):
    """The background writer failed; the message carries the cause."""


class ReadBudgetError(StepdumpError):
    """A read would cost more than the store can justify, so it was refused before the work.

    Raised when rebuilding a gradient-log step would decode far more gradient bytes than the
    store holds for them (docs/reliability.md, "Resource bounds per read"): a damaged or hostile
    store, or one whose grads compress unusually well. The message gives the numbers; if you
    trust the store, raise the allowance with ``STEPDUMP_DECODE_BUDGET=<bytes>``.
    """


class ReplayDiverged(StepdumpError):
    """A replayed step does not reproduce the recorded fingerprints.

    ``step``, ``kind`` and ``name`` say where (when known).
    """

    step: int | None = None
    kind: str | None = None
    name: str | None = None


class RebuildError(StepNotFoundError):
    """A step of a gradient-log run cannot be rebuilt, or its rebuild does not reproduce the record.

    Raised instead of returning unverified values: the optimizer cannot be re-run from recorded
    gradients (a closure optimizer, an unknown optimizer class, a missing gradient blob), or
    re-applying the recorded updates does not give the recorded fingerprints (another device or
    kernel than the recording's, a damaged gradient or hyperparameter). A subclass of
    :class:`StepNotFoundError`: code that handles "not stored at this step" handles it too.
    ``step``, ``kind`` and ``name`` say where (when known).
    """

    step: int | None = None
    kind: str | None = None
    name: str | None = None


class BatchMismatchError(StepdumpError, ValueError):
    """The batch given to a re-execution is not the one recorded at that step (its fingerprints
    differ from those ``log_batch`` stored): pass the step's own batch, or none to use the stored one."""


def nearest_steps(step: int, available: Sequence[int], k: int = 3) -> str:
    """Describe the recorded steps closest to ``step`` for an error message."""
    if not available:
        return "the run has no recorded steps yet"
    near = sorted(available, key=lambda s: (abs(s - step), s))[:k]
    return "nearest recorded steps: " + ", ".join(str(s) for s in sorted(near))


def close_names(name: str, choices: Iterable[str], k: int = 3) -> str:
    """Suggest names close to ``name`` for an error message."""
    choices = list(choices)
    hits = difflib.get_close_matches(name, choices, n=k, cutoff=0.5)
    if hits:
        return "did you mean " + ", ".join(repr(h) for h in hits) + "?"
    if not choices:
        return "no names of that kind were recorded"
    shown = ", ".join(repr(c) for c in choices[:5])
    more = f" (and {len(choices) - 5} more)" if len(choices) > 5 else ""
    return f"recorded names: {shown}{more}"
