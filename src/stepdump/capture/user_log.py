"""What the user logs into a recording: scalars (``Recorder.log``) and the batch (``Recorder.log_batch``).

A mixin of :class:`stepdump.Recorder` (split from capture/recorder.py to keep it one idea a
file); the attributes below are the Recorder's own. Where a logged scalar lands (the
iteration in progress, or the update that just ended) follows docs/concepts.md.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from stepdump.capture.scalars import checked_scalar
from stepdump.errors import ConfigError
from stepdump.store.format import LEVEL_NONE

if TYPE_CHECKING:
    from stepdump.capture.activations import ModuleCapture
    from stepdump.capture.guard import Guard
    from stepdump.capture.handoff import WriterLink
    from stepdump.capture.selection import Levels
    from stepdump.capture.stepwatch import StepWatch
    from stepdump.capture.unstepped import UnsteppedScalars


class UserLog:
    """``log`` and ``log_batch`` of the Recorder."""

    recording: bool
    _closed: bool
    _step: int
    _prev_open: bool
    _forward_seen: bool
    _pending: dict[int, dict[str, Any]]
    _overhead: float
    _batch: Any
    _guard: Guard
    _link: WriterLink
    _watch: StepWatch
    _level: Levels
    _modules: ModuleCapture
    _unstepped: UnsteppedScalars | None

    def _fail(self, err: BaseException, where: str) -> None:
        raise NotImplementedError  # the Recorder's

    def log(self, **scalars: Any) -> None:
        """Record scalars (loss, accuracy, ...) for the current iteration.

        Once the model has run forward (with grad) in this iteration, scalars go to
        it. Before that, a name logged right after ``optimizer.step()`` that the
        just-finished step has not got yet is given to that step, so
        ``rec.log(loss=loss)`` after the step lands on the step that computed it.
        A value that is not one real number raises :class:`stepdump.ConfigError`.
        """
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        if not self.recording:
            return
        started = time.perf_counter()  # this call's time is the recorder's (sys/recorder_ms)
        try:
            values = {name: checked_scalar(name, value) for name, value in scalars.items()}  # all, before any is kept
            if self._guard.stopped or self._link.failed():
                return
            self._watch.event()
            for name, value in values.items():
                step = self._step
                if self._prev_open and not self._forward_seen and name not in self._pending.get(step - 1, {}):
                    step -= 1
                slot = self._pending.setdefault(step, {})
                if self._unstepped is not None:  # no step recorded yet: where the loop's iterations begin
                    self._unstepped.logging(slot, name)
                slot[name] = value
        finally:
            self._overhead += time.perf_counter() - started

    def log_batch(self, batch: Any) -> None:
        """Record the batch of the current iteration (any nest of tensors) as kind ``inputs``.

        Stored under ``batch/<path>`` (``batch/0``, ``batch/1`` for ``(x, y)``) so a
        step can be replayed; call it once per iteration (again for micro-batches:
        later calls get ``#1``, ``#2``...).
        """
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        if not self.recording or self._guard.stopped or self._link.failed():
            return
        if self._level(self._step) == LEVEL_NONE:
            return
        started = time.perf_counter()  # this call's time is the recorder's (sys/recorder_ms)
        try:
            skeleton = self._modules.log_batch(batch)
        except ConfigError:  # the caller's mistake (no tensors in it): say so
            raise
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "log_batch()")
            return
        finally:
            self._overhead += time.perf_counter() - started
        if skeleton is not None:  # what replay hands back to train_step
            self._batch = skeleton
