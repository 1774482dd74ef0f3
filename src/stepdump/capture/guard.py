"""What a failure inside the Recorder does to the training it records: nothing.

Do no harm (DESIGN.md): a failure inside one of the Recorder's hooks (an
unsupported tensor, an internal bug, a full disk, a dead writer) must not raise
out of the user's ``optimizer.step()``, ``backward()`` or ``forward()``. By default
(``on_error="warn"``) the first failure is logged once with its cause, the run
is marked (``run.meta["recording_stopped"]``: the step, where, why, and the last
step that was committed) and the Recorder steps aside; the training goes on
exactly as it would without it. ``on_error="raise"`` lets the failure through,
for tests and debugging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ON_ERROR = ("warn", "raise")
MARK_KEY = "recording_stopped"  # the catalog meta key (FORMAT.md)


@dataclass(frozen=True)
class Failure:
    """The first failure of a Recorder, as stored in the run."""

    step: int
    where: str
    error: str
    last_committed: int | None

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "where": self.where, "error": self.error, "last_committed": self.last_committed}


def describe(err: BaseException) -> str:
    """``Type: message``, one line, short enough for a warning and the run's meta."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:500]}" if text else type(err).__name__


class Guard:
    """Runs the Recorder's hook bodies; on the first failure, steps aside (or re-raises when strict).

    ``on_stop`` is called once, with the :class:`Failure`, so the Recorder can
    remove its hooks, free what it holds and mark the run.
    """

    def __init__(self, on_error: str, path: Path, on_stop: Callable[[Failure], None]) -> None:
        self.strict = on_error == "raise"
        self.path = path
        self.failure: Failure | None = None
        self._on_stop = on_stop

    @property
    def stopped(self) -> bool:
        return self.failure is not None

    def fail(self, err: BaseException, where: str, step: int, last_committed: int | None) -> None:
        """Handle ``err`` raised ``where``: re-raise when strict, else stop recording once."""
        if self.strict:
            raise err
        if self.failure is not None:
            return
        self.failure = Failure(step, where, describe(err), last_committed)
        kept = "no step was committed" if last_committed is None else f"steps up to {last_committed} are intact"
        log.warning("stepdump: recording into %s stopped at step %d (%s; training goes on unrecorded; %s): %s",
                    self.path, step, where, kept, self.failure.error)
        log.debug("stepdump: the failure's traceback", exc_info=err)
        self._on_stop(self.failure)


def mark_run(path: Path, failure: Failure) -> None:
    """Store the failure in the run's meta (``recording_stopped``), so ``stepdump info``, ``run.meta``,
    ``stepdump check`` and the report show it. Best effort: the disk may be what failed."""
    from stepdump.store.catalog import CatalogWriter

    try:
        cat = CatalogWriter(path)
        try:
            cat.set_meta(MARK_KEY, failure.to_meta())
        finally:
            cat.close()
    except Exception as e:  # noqa: BLE001 - the one warning already named the cause (often this full disk)
        log.info("stepdump: could not mark %s as stopped at step %d: %s", path, failure.step, describe(e))


def close_quietly(ref: Callable[[], Any]) -> None:
    """Close a Recorder the user forgot to close, at interpreter exit: nowhere to raise to."""
    rec = ref()
    if rec is not None:
        try:
            rec.close()
        except Exception as e:  # noqa: BLE001 - interpreter exit
            log.error("stepdump: closing at exit failed: %s", describe(e))
