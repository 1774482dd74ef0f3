"""The writer lock: one Recorder per run at a time.

``flock`` locks die with the process that holds them, so a lock left by a
crashed or killed recorder never blocks a new one: a stale LOCK file is just a
file, and the pid written in it only serves the error message.

``LOCK`` is opened without following links and without blocking, and must be a
regular file with one name: the directory may be shared, and a ``LOCK`` planted
as a link would have the Recorder truncate the file it points at, a FIFO would
hang every Recorder and reader that opens it (``store/plainfile.py``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from stepdump.errors import ConfigError, RunLockedError, StepdumpError
from stepdump.store.format import LOCK_FILE
from stepdump.store.plainfile import open_plain

_ROLE = "the run's LOCK file (flock()ed by the Recorder writing the run)"


class RunLock:
    """The flock on a run's ``LOCK`` file, held by the Recorder writing the run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = open_plain(self.path, os.O_RDWR | os.O_CREAT, _ROLE)
        except OSError as e:
            if isinstance(e, StepdumpError) or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise ConfigError(
                f"cannot record into {self.path.parent}: {e.strerror}. A Recorder needs write access to its "
                "run directory; record into a writable directory (stepdump.open reads a read-only run)."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLockedError(
                f"{self.path.parent} is being written by another Recorder ({holder}). "
                "Close that Recorder first, or record into a different directory."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def is_locked(run_dir: Path) -> bool:
    """True while some Recorder holds the run's lock (a reader's hint that it is live).

    A ``LOCK`` that is not a regular file raises CorruptDataError (a reader only reads
    it, so a hard link is fine here)."""
    try:
        fd = open_plain(run_dir / LOCK_FILE, os.O_RDONLY, _ROLE, single_link=False)
    except FileNotFoundError:
        return False
    except PermissionError:  # another user's LOCK we may not read: no way to tell, say not live
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
