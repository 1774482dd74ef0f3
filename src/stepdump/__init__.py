"""stepdump: a flight recorder and time machine for PyTorch training.

Record every optimizer step (params, grads, optimizer state, scalars, RNG...)
with :class:`Recorder`, read it back with :func:`open`, and restore any step.
"""

from __future__ import annotations

__version__ = "0.1.0"

from stepdump.analysis.checks import check
from stepdump.analysis.cross_rank import (
    cross_rank,  # also registers the cross_rank check rule
)
from stepdump.analysis.diff import DiffResult, diff
from stepdump.analysis.verify import verify
from stepdump.capture.recorder import Recorder
from stepdump.capture.upload import Remote
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
from stepdump.read.ranked import DistributedRun
from stepdump.read.remote import RemoteRun
from stepdump.read.replay import ReplayResult, replay
from stepdump.read.run import Run, open
from stepdump.store.format import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "DiffResult",
    "DistributedRun",
    "CorruptDataError",
    "FormatVersionError",
    "NotARunError",
    "Recorder",
    "Remote",
    "RemoteRun",
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
    "cross_rank",
    "diff",
    "open",
    "replay",
    "verify",
]
