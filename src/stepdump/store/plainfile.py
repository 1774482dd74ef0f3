"""Opening the files of a run directory that may be shared with someone else.

A run directory can be writable by others (a shared file system, a directory
received from someone). Whatever a Recorder writes into it (``LOCK``, the
catalog and SQLite's files beside it, segments) must be a regular file that
the directory itself holds: a symbolic or hard link would aim the write (and a
``LOCK``'s truncation) at a file outside the run, and opening a FIFO blocks
forever. ``open_plain`` refuses all of these before and after opening, with
``O_NOFOLLOW`` (no link is followed) and ``O_NONBLOCK`` (a FIFO cannot block
the open) and an ``fstat`` of what was really opened.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from stepdump.errors import CorruptDataError


def describe(st: os.stat_result) -> str:
    """What a file that is not a plain, single-named file is, for an error message."""
    mode = st.st_mode
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    if st.st_nlink > 1:
        return f"a hard link ({st.st_nlink} names for one file)"
    return "a regular file"


def refusal(path: str | os.PathLike[str], what: str, role: str,
            expected: str = "a regular file with one name") -> CorruptDataError:
    """The error for a run file that is not what a Recorder makes."""
    return CorruptDataError(
        f"refusing {os.fspath(path)}: it is {what}, not {expected}, which is what stepdump "
        f"keeps as {role}. A link would aim stepdump's writes at another file, a FIFO would block. If the "
        "directory is yours, "
        "remove it and try again; if not, do not record into (or trust) this directory"
    )


def is_plain(st: os.stat_result, single_link: bool) -> bool:
    return stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or not single_link)


def check_plain(path: Path, role: str, *, single_link: bool = True) -> bool:
    """Raise unless ``path`` is absent or a regular file (with one name); True if it exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not is_plain(st, single_link):
        raise refusal(path, describe(st), role)
    return True


def open_plain(name: str | os.PathLike[str], flags: int, role: str, *, mode: int = 0o644,
               dir_fd: int | None = None, shown: str | os.PathLike[str] | None = None,
               single_link: bool = True) -> int:
    """``os.open`` for a file a Recorder owns: a regular file (one name unless ``single_link``
    is False), never through a link, never blocking; else CorruptDataError naming ``role``.

    A missing file raises FileNotFoundError unless ``flags`` has ``O_CREAT``. Existing
    files are looked at with ``lstat`` first, so a device or FIFO is not even opened.
    """
    shown = shown if shown is not None else name
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        if not is_plain(st, single_link):
            raise refusal(shown, describe(st), role)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link (made since the lstat)
            raise refusal(shown, "a symbolic link", role) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise refusal(shown, "a FIFO", role) from None
        raise
    try:
        st = os.fstat(fd)  # what was opened, whatever the lstat saw
        if not is_plain(st, single_link):
            raise refusal(shown, describe(st), role)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
