"""Storages that fail or stall on purpose, passed to a Recorder as ``storage=``.

The writer appends segment bytes through whatever :class:`~stepdump.store.storage.Storage`
the Recorder builds (``storage=`` takes a callable from the run directory to a
Storage), so a test injects a full or slow disk by handing it one of these, with
no patching of stepdump's modules.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from pathlib import Path

from stepdump.store.storage import LocalStorage


class HookedStorage(LocalStorage):
    """Files under the run directory, with ``before_append(key, nbytes)`` called before each
    append: it may raise (a failing disk) or sleep (a slow one)."""

    def __init__(self, root: Path, before_append: Callable[[str, int], None]) -> None:
        super().__init__(root)
        self._before_append = before_append

    def append(self, key: str, data: bytes | bytearray | memoryview) -> int:
        self._before_append(key, memoryview(data).nbytes)
        return super().append(key, data)


def full_disk_error() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


class FullDisk:
    """A disk that fills up: appends fail with ``OSError(ENOSPC)``.

    Two ways to fill it, usable together: ``armed`` (set it at any time) makes every
    append fail after ``room`` more appends succeed; ``budget`` is a number of bytes
    appends may still write, and an append that does not fit fails. ``calls`` counts
    the appends refused. Pass ``storage=disk.storage`` to the Recorder.
    """

    def __init__(self, *, armed: bool = False, room: int = 0, budget: int | None = None) -> None:
        self.armed = armed
        self.room = room
        self.budget = budget
        self.calls = 0

    def storage(self, root: Path) -> HookedStorage:
        return HookedStorage(root, self._before_append)

    def _before_append(self, key: str, nbytes: int) -> None:
        if self.armed:
            if self.room > 0:
                self.room -= 1
            else:
                self.calls += 1
                raise full_disk_error()
        if self.budget is not None:
            if nbytes > self.budget:
                self.calls += 1
                raise full_disk_error()
            self.budget -= nbytes


def slow_disk(seconds: float) -> Callable[[Path], HookedStorage]:
    """A ``storage=`` whose every append first waits ``seconds`` (a disk slower than training)."""
    return lambda root: HookedStorage(root, lambda key, nbytes: time.sleep(seconds))
