"""Where segment bytes live, behind a protocol small enough to re-implement.

The catalog is always a local SQLite file; segment files, which hold nearly all
of the bytes, go through :class:`Storage` so that other backends (object stores
through fsspec) can be plugged in without touching the writer or the reader.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol

from stepdump.errors import CorruptDataError, NotARunError


class Storage(Protocol):
    """Append-only byte files addressed by string keys.

    Four methods because that is all an append-only log needs: append returns the
    offset so the catalog can point at the bytes; ``sync`` is separate from
    append so the writer decides when durability is paid for; ``read`` takes an
    explicit range so readers never load a whole segment.
    """

    def append(self, key: str, data: bytes | memoryview) -> int:
        """Append ``data`` to ``key`` (created if missing); return its start offset."""

    def sync(self, key: str, durable: bool) -> None:
        """Hand buffered bytes to the OS; with ``durable`` also fsync them."""

    def read(self, key: str, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes of ``key`` from ``offset``."""

    def size(self, key: str) -> int:
        """Current length of ``key`` in bytes (0 if missing)."""


def safe_key(key: str) -> str:
    """Refuse keys that would leave the run directory (catalogs are untrusted input)."""
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
    """Files under a run directory. Appends are buffered per key; reads use pread."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._writers: dict[str, object] = {}
        self._readers: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / safe_key(key)

    def append(self, key: str, data: bytes | memoryview) -> int:
        f = self._writers.get(key)
        if f is None:
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open for the run
            self._writers[key] = f
        offset = f.seek(0, os.SEEK_END)  # type: ignore[attr-defined]
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # raw file objects may write short
            written += f.write(view[written:])  # type: ignore[attr-defined]
        return offset

    def sync(self, key: str, durable: bool) -> None:
        f = self._writers.get(key)
        if f is not None and durable:
            os.fsync(f.fileno())  # type: ignore[attr-defined]

    def read(self, key: str, offset: int, length: int) -> bytes:
        with self._lock:
            fd = self._readers.get(key)
            if fd is None:
                try:
                    fd = os.open(self._path(key), os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptDataError(
                        f"segment file {key!r} is missing from the run; the store is incomplete"
                    ) from None
                self._readers[key] = fd
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CorruptDataError(
                f"segment {key!r} is truncated: wanted {length} bytes at offset {offset}, "
                f"got {len(data)}; run `stepdump verify` on the run"
            )
        return data

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


def open_storage(root: str | os.PathLike[str]) -> LocalStorage:
    path = Path(root)
    if not path.is_dir():
        raise NotARunError(f"{path} is not a directory")
    return LocalStorage(path)
