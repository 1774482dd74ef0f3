"""Re-execution of recorded steps (docs/reexecute.md): ``reexecute`` and its verdicts, one-step bundles.

This package sits above both ``read/`` (restore, replay, the gradient log) and ``capture/`` (how
``log_batch`` names a batch): it is the one place that uses both, so neither has to import the other.

Internal; public names are in stepdump/__init__.py (``reexecute``, ``localize``), stepdump.types
(``ReexecResult``) and stepdump.export (``bundle``).
"""

from __future__ import annotations

from stepdump.reexec.verdict import DIFFERS, NONDETERMINISTIC, REPRODUCES, ReexecResult, reexecute

__all__ = ["DIFFERS", "NONDETERMINISTIC", "REPRODUCES", "ReexecResult", "reexecute"]
