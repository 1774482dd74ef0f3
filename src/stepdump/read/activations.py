"""Activations of a step, recorded or re-executed: ``run.activations(step)``.

A re-execution written back into the run (``stepdump.reexecute(..., write_back=True)``,
docs/reexecute.md) stores the activations it captured as kinds of their own
(``reexec_activations``, ``reexec_activation_grads``, FORMAT.md) and its verdict under
``meta.reexecutions``; this reads either kind back and says which one it is.
"""

from __future__ import annotations

from typing import Any

import torch

from stepdump.errors import ConfigError
from stepdump.store.format import META_REEXECUTIONS, REEXEC_KINDS


class Activations(dict[str, torch.Tensor]):
    """Module name -> tensor at one step, with where the values come from.

    Attributes:
        step: The step.
        reexecuted: True when they were captured by a re-execution written back into the run,
            not by the recording.
        verdict: For re-executed ones, that re-execution's verdict and evidence as stored
            (``meta.reexecutions[str(step)]``: ``verdict``, ``cause``, ``first``, ``nan_op``, ...);
            None for recorded ones.
    """

    def __init__(self, values: dict[str, torch.Tensor], step: int, reexecuted: bool,
                 verdict: dict[str, Any] | None) -> None:
        super().__init__(values)
        self.step, self.reexecuted, self.verdict = step, reexecuted, verdict


def reexecutions(run: Any) -> dict[int, dict[str, Any]]:
    """Step -> the verdict record of the re-execution written back at that step (none: empty)."""
    marks = run.meta.get(META_REEXECUTIONS)
    if not isinstance(marks, dict):
        return {}
    out = {}
    for key, mark in marks.items():
        try:
            out[int(key)] = mark
        except (TypeError, ValueError):
            continue  # not a step: a damaged entry is skipped, as check's rules skip bad meta
    return dict(sorted(out.items()))


def activations(run: Any, step: int, *, grads: bool = False, reexecuted: bool | None = None) -> Activations:
    """See :meth:`stepdump.types.Run.activations`."""
    if reexecuted not in (None, True, False):
        raise ConfigError(f"reexecuted={reexecuted!r}: give None (recorded ones, else re-executed), True or False")
    recorded_kind = "activation_grads" if grads else "activations"
    reexec_kind = REEXEC_KINDS[1] if grads else REEXEC_KINDS[0]
    if reexecuted is not True:
        names = run.catalog.stored_names(step, recorded_kind)
        if names or reexecuted is False:
            return Activations({n: run.tensor(n, step, recorded_kind) for n in names}, step, False, None)
    names = run.catalog.stored_names(step, reexec_kind)
    values = {n: run.tensor(n, step, reexec_kind) for n in names}
    verdict = reexecutions(run).get(step)
    return Activations(values, step, bool(values) or verdict is not None, verdict)
