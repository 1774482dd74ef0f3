"""The types the API returns (and the one localize takes), for annotations and ``isinstance``.

* readers, what :func:`stepdump.open` returns: :class:`Run` (a local store), :class:`RemoteRun`
  (a URL), :class:`DistributedRun` (one store per rank), :class:`JointRun` (several model /
  optimizer pairs); all but JointRun implement the :class:`RunReader` protocol;
* results: :class:`DiffResult` (:func:`stepdump.diff`), :class:`Finding` and :class:`Severity`
  (:func:`stepdump.check`; also in :mod:`stepdump.checks`), :class:`VerifyReport`
  (:func:`stepdump.verify`), :class:`ReplayResult` (:func:`stepdump.replay`),
  :class:`ReexecResult` (:func:`stepdump.reexecute`), :class:`Localization` and
  :class:`OpLocalization` (:func:`stepdump.localize`, ``level="module"`` / ``level="op"``);
* :class:`LocalizeSetup`: one side given to :func:`stepdump.localize` (a model, its optimizer,
  one iteration's code).
"""

from __future__ import annotations

from stepdump.analysis.diff import DiffResult
from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.localize import Localization
from stepdump.analysis.localize import Setup as LocalizeSetup
from stepdump.analysis.verify import VerifyReport
from stepdump.read.joint import JointRun
from stepdump.read.ranked import DistributedRun
from stepdump.read.reader import RunReader
from stepdump.read.remote import RemoteRun
from stepdump.read.replay import ReplayResult
from stepdump.read.run import Run
from stepdump.reexec.ops import OpLocalization
from stepdump.reexec.verdict import ReexecResult

__all__ = [
    "DiffResult",
    "DistributedRun",
    "Finding",
    "JointRun",
    "Localization",
    "LocalizeSetup",
    "OpLocalization",
    "ReexecResult",
    "ReplayResult",
    "RemoteRun",
    "Run",
    "RunReader",
    "Severity",
    "VerifyReport",
]
