"""The Recorder's link to its writer thread: handing messages over, hearing of its failure, the last flush.

The writer (capture/writer.py) runs on its own thread; the Recorder reaches it only through a
:class:`WriterLink`:

* :meth:`WriterLink.put` hands a message over. A full queue makes the training thread wait
  (backpressure, never unbounded memory), checking the writer is still alive; then it waits
  until the writer no longer reads the step's live tensors (the optimizer changes them next).
* :meth:`WriterLink.failed` turns a failure the writer met into the Recorder's: with
  ``on_error="warn"`` one warning and the Recorder stepping aside (the guard), else
  :class:`stepdump.WriterError`; :meth:`WriterLink.fail` does the same for a failure in a hook.
* :meth:`WriterLink.finish` (``close()``) sends the end mark, waits until everything queued is
  committed, and marks the run if recording stopped, with the last step really committed;
  :meth:`WriterLink.publish` then raises what the writer met (strict) and publishes a URL run.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stepdump.capture.guard import Guard, mark_run
from stepdump.capture import mailbox
from stepdump.capture.mailbox import MAIL
from stepdump.capture.staging import StagingPool
from stepdump.capture import writer as writer_mod
from stepdump.capture.writer import StepMessage, Writer
from stepdump.errors import WriterError

log = logging.getLogger(__name__)


class WriterLink:
    """One Recorder's writer thread, started, and the calls that cross to it (module docstring)."""

    def __init__(self, path: Path, pool: StagingPool, guard: Guard, step: Callable[[], int], *,
                 in_flight: int = 2, **writer: Any) -> None:
        """Start a :class:`Writer` for ``path`` (``writer``: its other arguments) and wait until it is
        ready; a failure to start ends it and raises :class:`stepdump.WriterError`. ``step``: the
        Recorder's current step (where a failure is reported). ``in_flight``: with
        ``durability="fsync"``, how many messages may be unwritten when :meth:`put` returns
        (``queue_depth``)."""
        self.path, self._pool, self._guard, self._step = path, pool, guard, step
        self._in_flight = max(1, in_flight)
        self._posted = 0  # messages put (the training thread's count, beside the writer's ``written``)
        self.writer = Writer(path, pool, **writer)
        self._woken = -math.inf  # when a put last woke the writer (monotonic)
        self.writer.start()
        try:
            self.writer.wait_ready()
            self.failed(starting=True)
        except BaseException:
            self.stop()
            raise

    @property
    def error(self) -> BaseException | None:
        """What the writer met (None: nothing), as it stands; :meth:`failed` acts on it."""
        return self.writer.error

    @property
    def last_step(self) -> int | None:
        """The last step the writer committed (None: none yet)."""
        return self.writer.last_step

    @property
    def steps_written(self) -> int:
        """Steps the writer has committed."""
        return self.writer.steps_written

    @property
    def bytes_written(self) -> int:
        """Bytes of tensor data the writer has appended to segment files."""
        return self.writer.bytes_written

    def is_alive(self) -> bool:
        """Whether the writer thread still runs (it takes messages)."""
        return self.writer.is_alive()

    @property
    def threads(self) -> tuple[threading.Thread | None, ...]:
        """The writer's threads (its own and its appender's), for sys/recorder_bg_ms."""
        return self.writer, getattr(self.writer, "_appender", None)

    def put(self, msg: StepMessage) -> None:
        """Hand ``msg`` to the writer; return once it no longer needs the live tensors of ``msg.slot``.
        A stats-only step with nothing left to read waits for the writer's own wake-up, posted
        without waking it (capture/mailbox.py); anything else wakes it now."""
        w, box = self.writer, self.writer.mailbox
        now = time.monotonic()
        mail = w.can_mail(msg)
        self._posted += 1
        # Woken at least once a COMMIT_WINDOW by the steps themselves (the first at once): a steady
        # loop's steps commit within a window of being taken; the writer's own wake-up is for a loop that stopped.
        if not box.post(msg, not mail or now - self._woken >= writer_mod.COMMIT_WINDOW,
                        mailbox.mail_bytes(msg) if mail else 0):
            return
        self._woken = now
        while True:
            try:
                w.queue.put(MAIL, timeout=0.05)
                break
            except queue.Full:
                if self.failed():
                    return
        self._pool.wait_live(msg.slot, self.writer.is_alive)  # the optimizer changes live tensors next
        if w.durable:  # every step durable once step() returns, but for the last in_flight (docs/reliability.md)
            while not w.written.wait_for(self._posted - self._in_flight, 0.05):
                if self.failed() or not w.is_alive():
                    return
        # A writer that does not keep up (a slow disk): copies past the stall mark wait for it.
        while box.waiting_bytes > mailbox.MAILBOX_STALL * mailbox.MAILBOX_BYTES and w.is_alive():
            if self.failed():
                return
            time.sleep(0.001)

    def failed(self, starting: bool = False) -> bool:
        """Raise WriterError if the writer failed; with on_error="warn" (once recording has
        started) stop recording instead and return True. False: all is well."""
        err = self.writer.error
        if err is None:
            return False
        if not self._guard.strict and not starting:
            at = self.writer.failed_step
            self._guard.fail(err, "writing the run", self._step() if at is None else at, self.writer.last_step)
            return True
        raise WriterError(f"stepdump could not write {self.path}: {err}") from err

    def fail(self, err: BaseException, where: str) -> None:
        """A failure inside a hook: strict re-raises (a write failure as WriterError), else step aside."""
        if self._guard.strict:
            self.failed()
            raise err
        if self.writer.error is not None:  # the writer failed first: that is the cause
            self.failed()
            return
        self._guard.fail(err, where, self._step(), self.writer.last_step)

    def stop(self) -> None:
        """The end mark, then wait until the writer has committed everything queued before it."""
        if self.writer.is_alive():
            self.writer.queue.put(None)
            self.writer.join()

    def finish(self) -> None:
        """:meth:`stop`, and mark the run if recording stopped (with the last step really committed)."""
        self.stop()
        if self._guard.failure is not None:
            mark_run(self.path, replace(self._guard.failure, last_committed=self.writer.last_step))

    def publish(self, target: Any) -> None:
        """After :meth:`finish`: raise the writer's failure (strict), then publish a URL run's final
        state (``target``: capture/target.py); a failure to publish is a warning unless strict (the
        complete run is still in the local staging directory)."""
        try:
            self.failed()
        finally:
            try:
                target.finish()
            except WriterError as e:
                if self._guard.strict:
                    raise
                log.warning("stepdump: %s", e)
        log.info("stepdump: closed %s (%d steps, %d bytes)", self.path, self.writer.steps_written,
                 self.writer.bytes_written)
