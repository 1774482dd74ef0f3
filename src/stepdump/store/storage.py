"""Where segment bytes live, behind a protocol small enough to re-implement.

The catalog is always a local SQLite file; segment files, which hold nearly all
of the bytes, go through a storage object that the code using it is given, not
one it builds: the writer appends through a :class:`Storage`, a reader reads
through a :class:`ReadStorage`. :class:`LocalStorage` (files under the run
directory) is the default for both. Readers of a run at a URL get
:class:`~stepdump.store.fsspec_storage.FsspecStorage` (byte ranges of objects);
a run bound for a URL is still *written* through :class:`LocalStorage` into a
staging directory and uploaded, because object stores cannot append. Tests
pass a storage that fails (a full disk, a slow one) instead of patching this
module.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from stepdump.errors import CorruptDataError
from stepdump.store.inside import inside
from stepdump.store.plainfile import open_plain, refusal


class ReadStorage(Protocol):
    """Immutable byte ranges of segment files addressed by string keys: what a reader needs.

    ``read`` takes an explicit range so readers never load a whole segment. Keys and
    ranges come from the catalog, which is untrusted input: an implementation checks
    the key (:func:`safe_key`) and that the object holds the range (:func:`check_span`)
    before it allocates ``length`` bytes. ``read`` may be called from several threads.
    """

    def read(self, key: str, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes of ``key`` from ``offset`` (CorruptDataError if it cannot)."""
        ...

    def refetch(self, key: str, offset: int, length: int) -> bytes | None:
        """Read a range again, bypassing any cache, after the bytes ``read`` gave failed their
        checksum; None for a storage without a cache (the file itself was read)."""
        ...

    def close(self) -> None:
        """Release what reads (and, for a :class:`Storage`, writes) hold open."""
        ...


class Storage(ReadStorage, Protocol):
    """Append-only segment files addressed by string keys: what the writer needs.

    Call order, per key, as the writer makes the calls:

    1. ``size(key)`` when the writer picks a new segment: it only starts keys that
       are missing or empty, so that offsets start at 0 (a crashed session may have
       left a segment with garbage at its end, and append-only means it is never
       rewritten).
    2. ``append(key, data)`` any number of times, in order, from one thread at a
       time (the appender thread). It returns the offset the bytes start at. The
       writer knows that offset beforehand (appends run behind it, and the catalog
       rows are built first) and the appender checks the two agree, so bytes that
       land elsewhere fail the step rather than being pointed at wrongly.
    3. ``sync(key, durable)`` after every append of a step has returned and before
       the catalog transaction that points at the bytes commits: the bytes must then
       be readable by another process, and with ``durable`` survive power loss.
       Separate from ``append`` so the writer decides when durability is paid for.
    4. ``close_writer(key)`` once the writer moves on to the next segment: no more
       appends to ``key`` follow.

    ``close()`` ends it all. Any of these may raise (``OSError(ENOSPC)`` for a full
    disk): the step in flight is then not committed, and the writer stops.
    """

    def size(self, key: str) -> int:
        """Current length of ``key`` in bytes (0 if missing)."""
        ...

    def append(self, key: str, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` to ``key`` (created if missing); return its start offset."""
        ...

    def sync(self, key: str, durable: bool) -> None:
        """Make the appended bytes readable by other processes; with ``durable`` also fsync them."""
        ...

    def close_writer(self, key: str) -> None:
        """No more appends to ``key``: release what appending to it holds open."""
        ...


# Builds the Storage a Recorder writes a run directory with (default: LocalStorage).
StorageFactory = Callable[[Path], Storage]


def safe_key(key: str) -> str:
    """Refuse keys that would leave the run directory (catalogs are untrusted input)."""
    if not isinstance(key, str):
        raise CorruptDataError(f"refusing storage key {key!r}: not a string")
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise CorruptDataError(f"refusing storage key {key!r}: it would leave the run directory")
    return key


class LocalStorage:
    """Files under a run directory (:class:`Storage`). Appends are unbuffered writes to the
    file, so ``sync`` has only the fsync left to do; reads use pread."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._writers: dict[str, object] = {}
        self._readers: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / safe_key(key)

    def append(self, key: str, data: bytes | bytearray | memoryview) -> int:
        f = self._writers.get(key)
        if f is None:
            f = os.fdopen(self._open_for_append(key), "ab", buffering=0)
            self._writers[key] = f
        offset = f.seek(0, os.SEEK_END)  # type: ignore[attr-defined]
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # raw file objects may write short
            written += f.write(view[written:])  # type: ignore[attr-defined]
        return offset

    def _open_for_append(self, key: str) -> int:
        """Create or open ``key`` for appending, inside the run directory and nowhere else.

        The run directory may be shared: each folder of the key is entered with
        ``O_NOFOLLOW`` relative to the one before (a ``segments`` that is a link
        would put segment files elsewhere), and the file must be a regular file
        with one name (``open_plain``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        parts = safe_key(key).split("/")
        dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    os.mkdir(part, 0o755, dir_fd=dir_fd)
                except FileExistsError:
                    pass
                try:
                    sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError as e:  # a link (ELOOP or ENOTDIR) is refused; a file there is an OSError as ever
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not stat.S_ISLNK(
                            os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        raise
                    where = self.root / "/".join(parts[: i + 1])
                    raise refusal(where, "a symbolic link", "the folder of segment files", "a directory") from None
                os.close(dir_fd)
                dir_fd = sub
            return open_plain(parts[-1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, "segment files", dir_fd=dir_fd,
                              shown=self.root / key)
        finally:
            os.close(dir_fd)

    def sync(self, key: str, durable: bool) -> None:
        # Unbuffered appends are in the page cache already: readable by others, and a
        # killed process loses nothing. Only power loss needs the fsync.
        f = self._writers.get(key)
        if f is not None and durable:
            os.fsync(f.fileno())  # type: ignore[attr-defined]

    def read(self, key: str, offset: int, length: int) -> bytes:
        fd = self._span(key, offset, length)
        try:
            data = os.pread(fd, length, offset)
        except OSError as e:
            raise CorruptDataError(f"segment {key!r} cannot be read at offset {offset}: {e}") from e
        self._check_got(key, offset, length, len(data))
        return data

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` (a writable byte buffer) from ``offset`` of ``key``, with the checks of
        :meth:`read`: for a reader that reuses its memory (no bytes object per read, no copy)."""
        length = buf.nbytes
        fd = self._span(key, offset, length)
        got = 0
        try:
            while got < length:  # preadv may return less than asked (a signal, a huge read)
                n = os.preadv(fd, [buf[got:]], offset + got)
                if n <= 0:
                    break
                got += n
        except OSError as e:
            raise CorruptDataError(f"segment {key!r} cannot be read at offset {offset}: {e}") from e
        self._check_got(key, offset, length, got)

    def _span(self, key: str, offset: int, length: int) -> int:
        """The segment's read descriptor, once the range is checked to lie inside it."""
        for what, v in (("offset", offset), ("length", length)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CorruptDataError(f"refusing to read segment {key!r}: {what} {v!r} is not a byte count")
        with self._lock:
            fd = self._readers.get(key)
            if fd is None:
                fd = self._open_segment(key)
                self._readers[key] = fd
        # Checked before reading: pread allocates ``length`` bytes up front, and a
        # damaged or hostile catalog may claim any length.
        check_span(key, offset, length, os.fstat(fd).st_size)
        return fd

    @staticmethod
    def _check_got(key: str, offset: int, length: int, got: int) -> None:
        if got != length:
            raise CorruptDataError(
                f"segment {key!r} is truncated: wanted {length} bytes at offset {offset}, "
                f"got {got}; run `stepdump verify` on the run"
            )

    def refetch(self, key: str, offset: int, length: int) -> None:
        """No cache to bypass: what :meth:`read` returned is what the file holds."""
        return None

    def _open_segment(self, key: str, what: str = "segment") -> int:
        """Open a segment for reading: a regular file inside the run directory, nothing else.

        Keys come from the catalog, which is untrusted input: ``safe_key`` refuses
        ``..`` and absolute paths, and here symlinks that lead out of the run
        directory, devices, FIFOs (which would block) and directories are refused.
        """
        path = self._path(key)
        root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise CorruptDataError(f"refusing {what} {key!r}: it leads outside the run directory (to {real})")
        inside(self.root, safe_key(key), f"the run's {what} file {key!r}", kind="file")  # no link at all
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CorruptDataError(
                f"{what} file {key!r} is missing from the run; the store is incomplete"
            ) from None
        except OSError as e:
            raise CorruptDataError(f"{what} {key!r} cannot be opened: {e}") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptDataError(f"refusing {what} {key!r}: it is not a regular file")
        return fd

    def read_file(self, key: str) -> bytes | None:
        """The whole file ``key`` (None if there is none), with the checks of :meth:`read`:
        a regular file inside the root, so a FIFO cannot block and a link cannot lead out."""
        if not os.path.lexists(self._path(key)):
            return None
        fd = self._open_segment(key, "file")
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        except OSError as e:
            raise CorruptDataError(f"file {key!r} cannot be read: {e}") from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return 0

    def close_writer(self, key: str) -> None:
        f = self._writers.pop(key, None)
        if f is not None:
            f.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        for key in list(self._writers):
            self.close_writer(key)
        with self._lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()


def check_span(key: str, offset: int, length: int, size: int, where: str = "") -> None:
    """Refuse a read of ``length`` bytes at ``offset`` from a segment of ``size`` bytes that does
    not hold them, before anything of ``length`` is allocated (every backend checks this)."""
    if offset + length > size:
        raise CorruptDataError(
            f"segment {key!r}{where} is truncated, too short: wanted {length} bytes at offset {offset}, "
            f"it has {size}; run `stepdump verify` on the run"
        )

