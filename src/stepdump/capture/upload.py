"""Publishing a run to a URL while it is recorded: the :class:`Remote` config and the uploader thread.

The writer never waits for the network: it writes the run to a local staging
directory exactly as it would a local run. An uploader thread publishes it
every ``upload_every`` steps (or ``upload_interval`` seconds) and once more at
``close()``, in an order that keeps the remote copy readable at every moment:

1. snapshot the catalog (SQLite backup API: one committed state);
2. upload every segment file whose size changed since its last upload (the
   bytes the snapshot points at were on local disk before it committed);
3. upload the snapshot as ``catalog.sqlite``, replacing the previous one.

At ``close()`` the run's ``stats.parquet`` (core/stats_file.py) goes up too, before the catalog
whose meta describes it.

A reader therefore sees the steps of the last published snapshot, all of
whose bytes are already there. Sealed segments are uploaded once; the
segment being written is uploaded again, whole, at each publish in which it
grew, so keep ``segment_bytes`` near what a few publishes add (default 64 MiB
for remote runs).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepdump.core.stats_file import STATS_FILE
from stepdump.errors import ConfigError, WriterError
from stepdump.store.format import CATALOG_FILE, SEGMENT_DIR
from stepdump.store.fsspec_storage import FsspecStorage, snapshot_catalog

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Remote:
    """How a Recorder publishes a run to a URL (``Recorder("s3://bucket/run", ..., remote=Remote(...))``).

    Attributes:
        storage_options: fsspec options for the URL's filesystem
            (``{"endpoint_url": ..., "key": ..., "secret": ...}`` for s3fs).
        upload_every: Publish after this many recorded steps.
        upload_interval: Also publish when this many seconds passed and
            something new was recorded (None: steps only).
        staging: Local directory the run is written to before upload (default:
            a new temporary directory). It must be new or empty.
        keep_staging: Keep the staging directory after a successful close
            (it is always kept when the last upload failed).
        segment_bytes: Largest segment file; the Recorder uses the smaller of
            this and its own ``segment_bytes``.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    upload_every: int = 10
    upload_interval: float | None = 60.0
    staging: str | os.PathLike[str] | None = None
    keep_staging: bool = False
    segment_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"Remote.storage_options must be a mapping, got {type(self.storage_options).__name__}")
        if isinstance(self.upload_every, bool) or not isinstance(self.upload_every, int) or self.upload_every < 1:
            raise ConfigError(f"Remote.upload_every={self.upload_every!r}: give a positive number of steps")
        if self.upload_interval is not None and (
            isinstance(self.upload_interval, bool) or not isinstance(self.upload_interval, (int, float))
            or not self.upload_interval > 0
        ):
            raise ConfigError(f"Remote.upload_interval={self.upload_interval!r}: give seconds > 0, or None")
        if isinstance(self.segment_bytes, bool) or not isinstance(self.segment_bytes, int) or self.segment_bytes < 1:
            raise ConfigError(f"Remote.segment_bytes={self.segment_bytes!r}: give a positive number of bytes")

    @classmethod
    def coerce(cls, value: Remote | Mapping[str, Any] | None) -> Remote:
        if value is None:
            return cls()
        if isinstance(value, Remote):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(**value)
            except TypeError as e:
                raise ConfigError(f"remote=: {e}; see stepdump.options.Remote for the options") from None
        raise ConfigError(f"remote= must be a stepdump.options.Remote or a dict of its options, got {type(value).__name__}")


class Uploader(threading.Thread):
    """Publishes a staging directory to a URL in the background; :meth:`finish` publishes the end."""

    def __init__(self, local: Path, storage: FsspecStorage, config: Remote, progress: Callable[[], int]) -> None:
        super().__init__(name="stepdump-uploader", daemon=True)
        self.local = local
        self.storage = storage
        self.config = config
        self.progress = progress
        self.error: BaseException | None = None
        self._uploaded: dict[str, int] = {}
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        last_steps, last_time = self.progress(), time.monotonic()
        while not self._stop_event.wait(0.05):
            steps = self.progress()
            due = steps - last_steps >= self.config.upload_every
            if not due and self.config.upload_interval is not None and steps != last_steps:
                due = time.monotonic() - last_time >= self.config.upload_interval
            if not due:
                continue
            try:
                self.publish()
                self.error = None
            except Exception as e:  # noqa: BLE001 - retried at the next publish; finish() raises
                self.error = e
                log.warning("stepdump: upload to %s failed (will retry): %s", self.storage.url, e)
            last_steps, last_time = steps, time.monotonic()

    def publish(self) -> None:
        """Snapshot the catalog, upload changed segments, then the snapshot."""
        with self._lock:
            fd, tmp = tempfile.mkstemp(prefix="stepdump-catalog-", suffix=".sqlite")
            os.close(fd)
            try:
                snapshot_catalog(self.local, Path(tmp))
                seg_dir = self.local / SEGMENT_DIR
                segments = sorted(seg_dir.glob("*.seg")) if seg_dir.is_dir() else []
                for path in segments:
                    # Measured after the snapshot: at least every byte it points at.
                    size = path.stat().st_size
                    key = f"{SEGMENT_DIR}/{path.name}"
                    if self._uploaded.get(key) != size:
                        self.storage.put_file(key, path)
                        self._uploaded[key] = size
                stats = self.local / STATS_FILE  # written by close(), before the last publish
                if stats.is_file():  # before the catalog whose meta describes it
                    self.storage.put_file(STATS_FILE, stats)
                self.storage.put_file(CATALOG_FILE, tmp)
            finally:
                Path(tmp).unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop the thread; nothing more is published."""
        self._stop_event.set()
        if self.is_alive():
            self.join()

    def finish(self) -> None:
        """Stop the thread and publish the final state; raise WriterError if that fails."""
        self.stop()
        try:
            self.publish()
        except Exception as e:
            raise WriterError(
                f"stepdump could not upload the run to {self.storage.url}: {e}. Everything is still in the "
                f"staging directory {self.local}; copy it there by hand (every file, catalog.sqlite last)."
            ) from e
        if not self.config.keep_staging:
            shutil.rmtree(self.local, ignore_errors=True)
