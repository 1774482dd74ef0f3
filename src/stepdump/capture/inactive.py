"""What ``Recorder(...)`` gives on a rank that ``ranks=`` leaves out.

The training script stays the same on every rank: the excluded ranks get an
object with the Recorder's interface that attaches nothing (no hooks, no
thread, no files) and records nothing, so ``rec.log(...)`` and ``with`` work
unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from stepdump.capture.recorder import Recorder
from stepdump.errors import ConfigError


class InactiveRecorder(Recorder):
    """A Recorder on a rank that is not recorded (``recording`` is False)."""

    recording = False

    def __init__(self, path: str | os.PathLike[str], model: Any, optimizer: Any, *args: Any,
                 start_step: int | None = None, **kwargs: Any) -> None:
        self.path = path  # type: ignore[assignment]
        self.model, self.optimizer = model, optimizer
        self._closed = False
        self._step = 0 if start_step is None else start_step
        # Count optimizer steps so that `rec.step` reads the same on every rank.
        self._hook = optimizer.register_step_post_hook(lambda o, a, k: self._count())

    def _count(self) -> None:
        self._step += 1

    def log(self, **scalars: Any) -> None:
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")

    def log_batch(self, batch: Any) -> None:
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hook.remove()

    @property
    def bytes_written(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<stepdump.Recorder (this rank is not recorded) {self.path!s}>"
