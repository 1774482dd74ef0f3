"""stepdump: a flight recorder and time machine for PyTorch training.

Record every optimizer step (params, grads, optimizer state, scalars, RNG...)
with :class:`Recorder`, read it back with :func:`open`, and restore any step.

The public API is what ``__all__`` lists here, plus two documented submodules
for extension: :mod:`stepdump.checks` (rules and findings) and
:mod:`stepdump.export` (checkpoints, safetensors, TensorBoard). Every other
package (``capture``, ``store``, ``read``, ``analysis``, ``render``, ``core``,
``cli``) is internal and may change without notice.

Names are loaded on first use (PEP 562 ``__getattr__``): ``import stepdump``
stays cheap for the CLI and for code that only wants the errors, and torch,
pandas and the analysis stack load when a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The errors and the format version are light (no torch), so they load eagerly:
# ``except stepdump.StepdumpError`` must not pay for an import.
from stepdump.errors import (
    ConfigError,
    CorruptDataError,
    FormatVersionError,
    InterruptedWriteError,
    NotARunError,
    ReadBudgetError,
    RebuildError,
    ReplayDiverged,
    RestoreMismatchError,
    RunExistsError,
    RunLockedError,
    StepdumpError,
    StepNotFoundError,
    TensorNotFoundError,
    WriterError,
)
from stepdump.store.format import FORMAT_VERSION

__version__ = "0.1.0"

# Public name -> the module that defines it. Keep in step with the TYPE_CHECKING
# block below (tests/test_public_api.py checks that both agree with __all__).
_LAZY: dict[str, str] = {
    # recording
    "Recorder": "stepdump.capture.recorder",
    "Remote": "stepdump.capture.upload",
    # the Recorder's grouped options (docs/concepts.md, "Recorder options")
    "RecordOptions": "stepdump.capture.options",
    "StepSchedule": "stepdump.capture.options",
    "KeyframeSchedule": "stepdump.capture.options",
    "GradientLogSchedule": "stepdump.capture.options",
    "RingSchedule": "stepdump.capture.options",
    "StoreOptions": "stepdump.capture.options",
    "RecorderOptions": "stepdump.capture.options",
    # reading: stepdump.open returns a RunReader: a Run, DistributedRun or RemoteRun
    "open": "stepdump.read.run",
    "RunReader": "stepdump.read.reader",
    "Run": "stepdump.read.run",
    "DistributedRun": "stepdump.read.ranked",
    "RemoteRun": "stepdump.read.remote",
    # analysis; check comes through stepdump.checks so that every rule
    # (cross_rank included) is registered and selectable by name
    "check": "stepdump.checks",
    "Finding": "stepdump.analysis.findings",
    "Severity": "stepdump.analysis.findings",
    "diff": "stepdump.analysis.diff",
    "DiffResult": "stepdump.analysis.diff",
    "verify": "stepdump.analysis.verify",
    "VerifyReport": "stepdump.analysis.verify",
    "localize": "stepdump.analysis.localize",
    "Localization": "stepdump.analysis.localize",
    "Setup": "stepdump.analysis.localize",
    # replay
    "replay": "stepdump.read.replay",
    "ReplayResult": "stepdump.read.replay",
    # re-execution of one step, with a verdict (docs/reexecute.md)
    "reexecute": "stepdump.reexec.verdict",
    "ReexecResult": "stepdump.reexec.verdict",
}

# Documented public submodules, reachable as attributes after a bare ``import stepdump``.
_SUBMODULES = ("checks", "export")

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from stepdump import checks as checks
    from stepdump import export as export
    from stepdump.analysis.diff import DiffResult, diff
    from stepdump.analysis.findings import Finding, Severity
    from stepdump.analysis.localize import Localization, Setup, localize
    from stepdump.analysis.verify import VerifyReport, verify
    from stepdump.capture.options import (
        GradientLogSchedule,
        KeyframeSchedule,
        RecorderOptions,
        RecordOptions,
        RingSchedule,
        StepSchedule,
        StoreOptions,
    )
    from stepdump.capture.recorder import Recorder
    from stepdump.capture.upload import Remote
    from stepdump.checks import check
    from stepdump.read.ranked import DistributedRun
    from stepdump.read.reader import RunReader
    from stepdump.read.remote import RemoteRun
    from stepdump.read.replay import ReplayResult, replay
    from stepdump.read.run import Run, open
    from stepdump.reexec.verdict import ReexecResult, reexecute

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "CorruptDataError",
    "DiffResult",
    "DistributedRun",
    "Finding",
    "FormatVersionError",
    "InterruptedWriteError",
    "Localization",
    "NotARunError",
    "Recorder",
    "RecordOptions",
    "StepSchedule",
    "GradientLogSchedule",
    "KeyframeSchedule",
    "RingSchedule",
    "StoreOptions",
    "RecorderOptions",
    "Remote",
    "RemoteRun",
    "ReadBudgetError",
    "RebuildError",
    "ReplayDiverged",
    "ReexecResult",
    "ReplayResult",
    "RestoreMismatchError",
    "Run",
    "RunExistsError",
    "RunLockedError",
    "RunReader",
    "Setup",
    "Severity",
    "StepNotFoundError",
    "StepdumpError",
    "TensorNotFoundError",
    "VerifyReport",
    "WriterError",
    "__version__",
    "check",
    "diff",
    "localize",
    "open",
    "reexecute",
    "replay",
    "verify",
]


def __getattr__(name: str) -> Any:
    """Load a public name (or public submodule) on first access, then cache it."""
    # Only names from the constant tables above are imported (never a computed
    # one): tests/test_reliability_security.py allows exactly these two calls.
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"stepdump.{name}")
    else:
        raise AttributeError(f"module 'stepdump' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
