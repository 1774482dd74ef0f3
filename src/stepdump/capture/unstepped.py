"""Scalars logged while no step has been recorded: kept, one row per iteration.

``rec.log`` files a scalar under the iteration in progress, and a name logged again in one
iteration keeps its last value (docs/concepts.md). A loop that never steps the optimizer given
to the Recorder (SAM's ``first_step`` / ``second_step``, a hand-written update) never ends an
iteration, so every value would land on the first step and all but the last would be lost.
Until the first step is recorded, :class:`UnsteppedScalars` notes where a name comes again (the
loop's next iteration); a run that ends with no step keeps every value, one row per iteration
(numbered on from the first step; ``meta.no_step`` says the run holds no step). Once a step is
recorded it is dropped and nothing changes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NO_STEP_KEY = "no_step"  # the run's meta key (FORMAT.md)
LIMIT = 100_000  # rows kept at most (scalars only: a few MB); later values share the last row


class UnsteppedScalars:
    """Where each iteration's scalars began, while no step is recorded (module docstring)."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._names: dict[str, None] = {}  # the names logged in the iteration in progress, in order

    def logging(self, slot: dict[str, Any], name: str) -> None:
        """``name`` is about to be logged into ``slot`` (the first step's pending scalars): a name
        this iteration has already logged starts the next iteration (the values so far make a row)."""
        if name in self._names and len(self._rows) < LIMIT:
            self._rows.append({n: slot[n] for n in self._names if n in slot})
            self._names = {}
        self._names[name] = None

    def rows(self, slot: dict[str, Any]) -> list[dict[str, Any]]:
        """Every iteration's scalars, the one in progress (its values in ``slot``) last."""
        last = {n: slot[n] for n in self._names if n in slot}
        return [*self._rows, *([last] if last else [])]

    @property
    def iterations(self) -> int:
        """Iterations seen so far (a name logged again starts one)."""
        return len(self._rows) + bool(self._names)


def mark_no_step(path: Path, iterations: int, stepped_instead: str | None) -> None:
    """Say in the run's meta (``no_step``, FORMAT.md) that it holds no step: how many iterations
    logged scalars, and the optimizer seen stepping the params instead (capture/stepwatch.py).
    Best effort, as the mark of a stopped recording."""
    from stepdump.store.catalog import CatalogWriter

    try:
        cat = CatalogWriter(path)
        try:
            cat.set_meta(NO_STEP_KEY, {"iterations": iterations, "stepped_instead": stepped_instead})
        finally:
            cat.close()
    except Exception as e:  # noqa: BLE001 - the StepWatch's warning already said it; check says it again
        log.info("stepdump: could not mark %s as holding no step: %s", path, e)
