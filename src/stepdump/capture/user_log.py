"""What the user logs into a recording: scalars (``Recorder.log``) and the batch (``Recorder.log_batch``).

:class:`UserLog` is the Recorder's collaborator that holds them until the record of their step
takes them. Where a logged scalar lands (the iteration in progress, or the update that just
ended) follows docs/concepts.md. Its time on the training thread is the recorder's
(``sys/recorder_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from stepdump.capture.scalars import checked_scalar, scalar_rows
from stepdump.capture.unstepped import UnsteppedScalars
from stepdump.errors import ConfigError

if TYPE_CHECKING:
    from stepdump.capture.activations import ModuleCapture


class UserLog:
    """The scalars and the batch logged into one Recorder, held until their step's record is taken.

    Args:
        accepting: Whether a logged value is still kept (recording has not stepped aside, the
            writer has not failed).
        spent: Adds seconds to the Recorder's own time in the iteration.
        fail: The Recorder's failure handling (``on_error``), with where it happened.
    """

    def __init__(self, accepting: Callable[[], bool], spent: Callable[[float], None],
                 fail: Callable[[BaseException, str], None]) -> None:
        self._accepting, self._spent, self._fail = accepting, spent, fail
        self.pending: dict[int, dict[str, Any]] = {}  # scalars by step, until the step's record is sent
        # True from an update's end to the next record: a name the step that just ended has not got
        # yet, logged before the next training forward, still goes to that step.
        self.after_update = False
        # Until a step is recorded: where the loop's iterations begin (unstepped.py)
        self.unstepped: UnsteppedScalars | None = UnsteppedScalars()
        self.batch: Any = None  # the skeleton of the batch logged in the iteration (what replay hands back)

    def log(self, scalars: Mapping[str, Any], step: int, forward_seen: bool, event: Callable[[], None]) -> None:
        """Keep ``scalars`` logged in iteration ``step`` (``forward_seen``: its training forward
        ran); ``event`` tells the Recorder's step watch that the loop is logging."""
        started = time.perf_counter()  # this call's time is the recorder's (sys/recorder_ms)
        try:
            values = {name: checked_scalar(name, value) for name, value in scalars.items()}  # all, before any is kept
            if not self._accepting():
                return
            event()
            for name, value in values.items():
                at = step
                if self.after_update and not forward_seen and name not in self.pending.get(step - 1, {}):
                    at -= 1
                slot = self.pending.setdefault(at, {})
                if self.unstepped is not None:  # no step recorded yet: where the loop's iterations begin
                    self.unstepped.logging(slot, name)
                slot[name] = value
        finally:
            self._spent(time.perf_counter() - started)

    def log_batch(self, batch: Any, modules: ModuleCapture) -> None:
        """Keep ``batch`` (any nest of tensors) as the iteration's ``inputs``, through ``modules``."""
        started = time.perf_counter()  # this call's time is the recorder's (sys/recorder_ms)
        try:
            skeleton = modules.log_batch(batch)
        except ConfigError:  # the caller's mistake (no tensors in it): say so
            raise
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "log_batch()")
            return
        finally:
            self._spent(time.perf_counter() - started)
        if skeleton is not None:  # what replay hands back to train_step
            self.batch = skeleton

    def step_recorded(self, t: int) -> list[tuple[int, str, Any]]:
        """Step ``t``'s record is being taken: the rows of step ``t-1``'s scalars still held (its
        update ended; nothing more goes to it), and scalars follow the recorded steps from now on."""
        self.unstepped = None
        if not self.after_update:
            return []
        self.after_update = False
        return scalar_rows(t - 1, self.pending.pop(t - 1, {}))

    def final_rows(self, step: int) -> list[tuple[int, str, Any]]:
        """Every scalar still held, as rows, at ``close()`` (``step``: the iteration in progress).
        With no step recorded, every value logged is kept, a row per iteration."""
        if self.unstepped is not None:
            rows = self.unstepped.rows(self.pending.pop(step, {}))
            self.pending.update({step + i: row for i, row in enumerate(rows)})
        scalars = [r for s in sorted(self.pending) for r in scalar_rows(s, self.pending[s])]
        self.pending.clear()
        return scalars
