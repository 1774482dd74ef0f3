"""stepdump: a flight recorder and time machine for PyTorch training.

Record every optimizer step (params, grads, optimizer state, scalars, RNG...)
with :class:`Recorder`, read it back with :func:`open`, and restore any step.
"""

from __future__ import annotations

__version__ = "0.1.0"

from stepdump.analysis.checks import check
from stepdump.analysis.diff import DiffResult, diff
from stepdump.analysis.verify import verify
from stepdump.capture.recorder import Recorder
from stepdump.errors import (
    ConfigError,
    CorruptDataError,
    FormatVersionError,
    NotARunError,
    ReplayDiverged,
    RestoreMismatchError,
    RunExistsError,
    RunLockedError,
    StepdumpError,
    StepNotFoundError,
    TensorNotFoundError,
    WriterError,
)
from stepdump.read.replay import ReplayResult, replay
from stepdump.read.run import Run, open
from stepdump.store.format import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "DiffResult",
    "CorruptDataError",
    "FormatVersionError",
    "NotARunError",
    "Recorder",
    "ReplayResult",
    "ReplayDiverged",
    "RestoreMismatchError",
    "Run",
    "RunExistsError",
    "RunLockedError",
    "StepNotFoundError",
    "StepdumpError",
    "TensorNotFoundError",
    "WriterError",
    "__version__",
    "check",
    "diff",
    "open",
    "replay",
    "verify",
]
