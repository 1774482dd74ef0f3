"""Runs in object storage (``s3://``, ``gs://``, ``memory://``, ``file://`` ...) through fsspec.

SQLite needs a local file and object stores cannot append, so a run bound for
a URL is written to a local staging directory first and published by an
uploader (:mod:`stepdump.capture.upload`): segment files, then a consistent
snapshot of the catalog (SQLite's backup API). Readers download that catalog
snapshot into a local cache and fetch blob byte ranges on demand
(``fs.cat_file(path, start, end)``), keeping each fetched range in the cache.

Every object a reader fetches is immutable in the part it reads: a segment
object is only ever replaced by a longer one with the same prefix, and a
catalog snapshot only points at bytes uploaded before it. So, within one run, a
cached range never goes stale and a reader never sees a step whose bytes are
missing. A URL can be emptied and recorded into again, though, and the cache
is shared by every reader of the URL: ranges are kept under the identity of the
run they were fetched for (:func:`run_tag`), and a cached range that fails its
checksum is fetched again before the blob is called damaged.

``file://`` URLs are read through :class:`~stepdump.store.storage.LocalStorage`,
with its checks (regular files inside the run, sizes checked before reading);
other backends check a range against the object's size before fetching it.

fsspec (and s3fs / gcsfs for their schemes) are optional: ``pip install
'stepdump[remote]'``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.catalog import (
    snapshot_catalog as snapshot_catalog,  # re-exported: it moved there
)
from stepdump.store.format import CATALOG_FILE
from stepdump.store.storage import LocalStorage, check_span, safe_key


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (fsspec URLs); paths and Path objects are local."""
    return isinstance(path, str) and "://" in path


def default_cache_dir(url: str) -> Path:
    """Where a reader keeps the catalog snapshot and fetched ranges of ``url``."""
    base = os.environ.get("STEPDUMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stepdump"
    )
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:20]
    return Path(base) / "remote" / digest


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise ConfigError(
            "reading or writing a run at a URL needs fsspec (and s3fs for s3://, gcsfs for gs://): "
            "pip install 'stepdump[remote]'"
        ) from None
    return fsspec


class FsspecStorage:
    """:class:`~stepdump.store.storage.ReadStorage` over an fsspec URL, plus whole-object I/O.

    Reading only: segments are never appended to here (object stores cannot
    append); the uploader replaces whole objects with :meth:`put_file`.

    Args:
        url: The run's location (``s3://bucket/runs/exp1``).
        storage_options: Passed to fsspec (``{"endpoint_url": ..., "key": ...}``
            for s3fs, ``{"token": ...}`` for gcsfs).
        cache_dir: Local directory for fetched byte ranges (none: no cache; ranges are
            cached once a reader says which run they belong to, :meth:`use_run`).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if not is_url(url):
            raise ConfigError(f"{url!r} is not a URL (scheme://...); use a local path for local runs")
        fsspec = _fsspec()
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"cannot open {self.url}: {e} (for s3:// pip install s3fs, for gs:// gcsfs)") from None
        self.root = self.root.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        # Which run the cached ranges belong to (set by the reader from the catalog):
        # ranges are only cached, and only served, under a known run identity.
        self.run_tag: str | None = None
        self._sizes: dict[str, int] = {}  # object sizes seen, to check ranges before fetching them

    def __repr__(self) -> str:
        return f"<FsspecStorage {self.url}>"

    def path(self, key: str) -> str:
        """The fsspec path of ``key`` (keys are checked: no absolute paths, no ``..``)."""
        return f"{self.root}/{safe_key(key)}"

    def child(self, name: str, cache_dir: str | os.PathLike[str] | None = None) -> FsspecStorage:
        """The storage of a sub-location (a rank's store under a multi-rank run)."""
        return FsspecStorage(f"{self.url}/{safe_key(name)}", self.storage_options, cache_dir)

    # -- ReadStorage protocol ----------------------------------------------------
    def read(self, key: str, offset: int, length: int, *, cached: bool = True) -> bytes:
        """``length`` bytes of ``key`` from ``offset``: from the range cache, else one ranged GET
        (``cached=False``: always from the object, refreshing the cache)."""
        for what, v in (("offset", offset), ("length", length)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CorruptDataError(f"refusing to read segment {key!r}: {what} {v!r} is not a byte count")
        if self._local_fs:  # the local checks (links, FIFOs, sizes) hold for file:// too
            local = LocalStorage(self.root)  # opened per read: the uploader replaces files as they grow
            try:
                return local.read(key, offset, length)
            finally:
                local.close()
        if length == 0:
            return b""
        cache = self._range_path(key, offset, length)
        if cache is not None and cached:
            try:
                data = cache.read_bytes()
                if len(data) == length:
                    return data
            except FileNotFoundError:
                pass
        self._check_size(key, offset, length)
        try:
            data = self.fs.cat_file(self.path(key), start=offset, end=offset + length)
        except FileNotFoundError:
            raise CorruptDataError(f"segment {key!r} is missing from {self.url}; the upload is incomplete") from None
        if len(data) != length:
            raise CorruptDataError(
                f"segment {key!r} of {self.url} is short: wanted {length} bytes at offset {offset}, got {len(data)}"
            )
        if cache is not None:
            _write_atomic(cache, data)
        return bytes(data)

    def use_run(self, tag: str) -> None:
        """Read for the run ``tag`` (:func:`run_tag` of the catalog just fetched): cache ranges
        under it, and look object sizes up afresh (the objects may have been replaced)."""
        self.run_tag = tag
        self._sizes.clear()

    def refetch(self, key: str, offset: int, length: int) -> bytes | None:
        """Read a range again from the object, not the cache: a cached copy failed its checksum
        (a cache entry damaged, or left by another run at this URL). None where ranges are not
        cached (file:// URLs, no cache directory or run yet): the object itself was read."""
        if self._local_fs or self._range_path(key, offset, length) is None:
            return None
        return self.read(key, offset, length, cached=False)

    def _check_size(self, key: str, offset: int, length: int) -> None:
        """Refuse a range the object does not hold (and anything that is not a file) before
        fetching it; sizes are looked up once per object, again when a range goes past."""
        size = self._sizes.get(key)
        if size is None or offset + length > size:
            self.invalidate(key)  # a listing cached by fsspec may predate the object's last upload
            try:
                info = self.fs.info(self.path(key))
            except FileNotFoundError:
                raise CorruptDataError(
                    f"segment {key!r} is missing from {self.url}; the upload is incomplete"
                ) from None
            if info.get("type", "file") != "file":
                raise CorruptDataError(f"refusing segment {key!r} of {self.url}: it is not a regular file")
            if not isinstance(info.get("size"), int):  # a server that does not say: the GET is checked after
                return
            size = self._sizes[key] = int(info["size"])
        check_span(key, offset, length, size, f" of {self.url}")

    # -- whole objects ---------------------------------------------------------
    def exists(self, key: str) -> bool:
        self.invalidate(key)
        return bool(self.fs.exists(self.path(key)))

    def get_bytes(self, key: str) -> bytes | None:
        """The whole object ``key``, or None if there is none."""
        self.invalidate(key)
        if self._local_fs:  # a regular file inside the run: no FIFO, no link out of it
            return LocalStorage(self.root).read_file(key)
        try:
            return bytes(self.fs.cat_file(self.path(key)))
        except FileNotFoundError:
            return None

    def put_bytes(self, key: str, data: bytes) -> None:
        """Create or replace the object ``key`` with ``data``, atomically for readers."""
        path = self._prepare(key)
        if self._local_fs:
            tmp = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
            self.fs.pipe_file(tmp, bytes(data))
            self.fs.mv(tmp, path)
        else:  # an object store PUT replaces the object atomically
            self.fs.pipe_file(path, bytes(data))
        self.invalidate(key)

    def put_file(self, key: str, local: str | os.PathLike[str]) -> None:
        """Create or replace the object ``key`` with the local file ``local``, atomically for readers."""
        path = self._prepare(key)
        if self._local_fs:  # copying over a file in place would show readers a half-written one
            tmp = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
            self.fs.put_file(os.fspath(local), tmp)
            self.fs.mv(tmp, path)
        else:
            self.fs.put_file(os.fspath(local), path)
        self.invalidate(key)

    def _prepare(self, key: str) -> str:
        path = self.path(key)
        parent = path.rsplit("/", 1)[0]
        if parent and self._local_fs:
            self.fs.makedirs(parent, exist_ok=True)
        return path

    @property
    def _local_fs(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return bool({"file", "local"} & set(protocols))

    def invalidate(self, key: str | None = None) -> None:
        """Forget fsspec's listing cache, so sizes and existence are read afresh."""
        try:
            self.fs.invalidate_cache(self.path(key) if key else self.root)
        except Exception:  # noqa: BLE001 - not every filesystem caches listings
            pass

    def close(self) -> None:
        """Nothing to release: every read is one request (file:// reads close their file)."""

    # -- local files -------------------------------------------------------------
    def _range_path(self, key: str, offset: int, length: int) -> Path | None:
        if self.cache_dir is None or self.run_tag is None:
            return None
        return self.cache_dir / "ranges" / self.run_tag / safe_key(key) / f"{int(offset)}-{int(length)}"


def run_tag(meta: Mapping[str, Any], catalog_file: Path) -> str:
    """A name for the run a catalog snapshot belongs to, that differs for a run recorded
    again at the same URL: its ``run_id`` if the catalog has one, else its creation time
    (``time.time()`` at creation, to the microsecond) and host, else a hash of the catalog
    itself (its ranges are then cached per snapshot)."""
    run_id, created = meta.get("run_id"), meta.get("created")
    if isinstance(run_id, str) and run_id:
        basis: list[Any] = ["run_id", run_id]
    elif isinstance(created, (int, float)) and not isinstance(created, bool):
        basis = ["created", repr(created), str(meta.get("host"))]
    else:
        basis = ["catalog", hashlib.sha256(catalog_file.read_bytes()).hexdigest()]
    return hashlib.sha256(json.dumps(basis).encode()).hexdigest()[:20]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_catalog(storage: FsspecStorage, cache_dir: Path) -> Path:
    """Download the catalog snapshot of ``storage`` into ``cache_dir``; return the directory."""
    from stepdump.errors import NotARunError

    data = storage.get_bytes(CATALOG_FILE)
    if data is None:
        raise NotARunError(
            f"{storage.url} holds no stepdump run (no {CATALOG_FILE}); give the URL a Recorder wrote to, and "
            "check storage_options (endpoint, credentials)"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(cache_dir / CATALOG_FILE, data)
    return cache_dir
