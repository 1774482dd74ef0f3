"""stepdump: a flight recorder and time machine for PyTorch training.

Record every optimizer step (params, grads, optimizer state, scalars, RNG...)
with :class:`Recorder`, read it back with :func:`open`, and restore any step.

The top level holds what a user types in the first hour: ``Recorder``, ``open``,
``check``, ``diff``, ``verify``, ``replay``, ``reexecute``, ``localize`` and the
errors (``__all__``; ``open`` is left out of ``__all__`` so that
``from stepdump import *`` does not shadow the builtin). Four documented
submodules hold the rest: :mod:`stepdump.options` (the Recorder's option
groups), :mod:`stepdump.types` (the readers and result types),
:mod:`stepdump.checks` (rules and findings) and :mod:`stepdump.export`
(checkpoints, safetensors, TensorBoard, the HTML report, one-step bundles).
:mod:`stepdump.integrations` (framework callbacks) and :mod:`stepdump.demo`
(the demo job, ``--entry stepdump.demo:make_step``) are public too. Every other
package (``capture``, ``store``, ``read``, ``analysis``, ``render``, ``core``,
``reexec``, ``cli``) is internal and may change without notice; the docs send
users only to public names (tests/test_public_api.py checks them).

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
    BatchMismatchError,
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

# The one list of the top level's lazily loaded names: public name -> the module that defines
# it. __all__ is derived from it and the eager names below; the TYPE_CHECKING block must name the
# same modules (tests/test_public_api.py checks it, since a type checker cannot read a loop).
_LAZY: dict[str, str] = {
    "Recorder": "stepdump.capture.recorder",
    "open": "stepdump.read.opener",  # returns a stepdump.types.RunReader (or JointRun)
    # check comes through stepdump.checks so that every rule (cross_rank included) is registered
    "check": "stepdump.checks",
    "diff": "stepdump.analysis.diff",
    "verify": "stepdump.analysis.verify",
    "replay": "stepdump.read.replay",
    "reexecute": "stepdump.reexec.verdict",
    "localize": "stepdump.reexec.localize",  # level="module" is analysis.localize, level="op" reexec.ops
}

# Documented public submodules, reachable as attributes after a bare ``import stepdump``.
_SUBMODULES = ("checks", "export", "options", "types")

_ERRORS = (
    "StepdumpError", "BatchMismatchError", "ConfigError", "CorruptDataError", "FormatVersionError", "InterruptedWriteError",
    "NotARunError", "ReadBudgetError", "RebuildError", "ReplayDiverged", "RestoreMismatchError",
    "RunExistsError", "RunLockedError", "StepNotFoundError", "TensorNotFoundError", "WriterError",
)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from stepdump import checks as checks
    from stepdump import export as export
    from stepdump import options as options
    from stepdump import types as types
    from stepdump.analysis.diff import diff
    from stepdump.analysis.verify import verify
    from stepdump.capture.recorder import Recorder
    from stepdump.checks import check
    from stepdump.read.replay import replay
    from stepdump.read.opener import open
    from stepdump.reexec.localize import localize
    from stepdump.reexec.verdict import reexecute

# ``open`` stays out: ``from stepdump import *`` must leave the builtin alone (use stepdump.open).
__all__ = sorted([*(n for n in _LAZY if n != "open"), *_ERRORS, "FORMAT_VERSION", "__version__"])


def __getattr__(name: str) -> Any:
    """Load a public name (or public submodule) on first access, then cache it."""
    # Only names from the constant tables above are imported (never a computed
    # one): tests/test_reliability_security.py allows these calls for that reason.
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"stepdump.{name}")
    else:
        raise AttributeError(f"module 'stepdump' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY) | set(_SUBMODULES))
