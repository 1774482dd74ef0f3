"""``stepdump.open``: pick the reader for what is at a path or URL.

* a directory with ``catalog.sqlite``: :class:`~stepdump.read.run.Run`;
* a directory with ``ranks.json`` (a multi-rank run): :class:`~stepdump.read.ranked.DistributedRun`;
* a directory with ``joint.json`` (several model/optimizer pairs): :class:`~stepdump.read.joint.JointRun`;
* a URL (``s3://``, ``gs://``, ``memory://``, ``file://``): the same two, read through fsspec
  (:class:`~stepdump.read.remote.RemoteRun` for a single store).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepdump.errors import ConfigError
from stepdump.read.reader import RunReader
from stepdump.read.run import Run
from stepdump.store.format import CATALOG_FILE
from stepdump.store.fsspec_storage import FsspecStorage, default_cache_dir, is_url
from stepdump.store.joint import JOINT_FILE
from stepdump.store.ranks import RANKS_FILE


def open_run(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None,
             cache_dir: str | os.PathLike[str] | None = None) -> RunReader:
    """Open a recorded run for reading; see :func:`stepdump.open`."""
    if is_url(path):
        url = str(path).rstrip("/")
        from stepdump.read.ranked import DistributedRun
        from stepdump.read.remote import RemoteRun

        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(url)
        storage = FsspecStorage(url, storage_options, cache)
        if storage.exists(RANKS_FILE) and not storage.exists(CATALOG_FILE):
            return DistributedRun(url, storage_options=storage_options, cache_dir=cache)
        return RemoteRun(url, cache_dir=cache, storage=storage)
    if storage_options is not None or cache_dir is not None:
        raise ConfigError("storage_options= and cache_dir= apply to URLs (s3://..., gs://...); "
                          f"{os.fspath(path)!r} is a local path")
    p = Path(path)
    # lexists: a layout file planted as a link is refused by its reader (store/inside.py), not skipped.
    if os.path.lexists(p / JOINT_FILE) and not (p / CATALOG_FILE).exists():
        from stepdump.read.joint import JointRun

        return JointRun(p)
    if os.path.lexists(p / RANKS_FILE) and not (p / CATALOG_FILE).exists():
        from stepdump.read.ranked import DistributedRun

        return DistributedRun(p)
    return Run(p)


def open(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,  # noqa: A001
         cache_dir: str | os.PathLike[str] | None = None) -> RunReader:
    """Open a recorded run for reading (it may still be being written).

    Args:
        path: A run directory, a multi-rank run directory (``ranks.json``: gives a
            :class:`~stepdump.read.ranked.DistributedRun`), or an fsspec URL
            (``s3://bucket/run``, ``gs://...``, ``memory://...``) of either.
        storage_options: fsspec options for a URL (endpoint, credentials).
        cache_dir: Local cache for a URL's catalog snapshot and fetched bytes.
    """
    return open_run(path, storage_options=storage_options, cache_dir=cache_dir)
