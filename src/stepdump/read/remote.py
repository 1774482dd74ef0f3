"""``RemoteRun``: a run read from a URL (``s3://``, ``gs://``, ``memory://``, ``file://``).

The catalog snapshot is downloaded into a local cache directory once (again
on :meth:`RemoteRun.refresh`); tensors are fetched as byte ranges of the
segment objects when asked for, and each fetched range is kept in the cache.
Everything else is :class:`~stepdump.read.run.Run`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepdump.read.run import Run
from stepdump.read.state import check_meta
from stepdump.store.format import CATALOG_FILE
from stepdump.store.fsspec_storage import (
    FsspecStorage,
    default_cache_dir,
    fetch_catalog,
    run_tag,
)
from stepdump.store.queries import CatalogReader


class RemoteRun(Run):
    """A :class:`~stepdump.read.run.Run` whose store lives at a URL.

    Args:
        url: Where the run was published (``s3://bucket/runs/exp1``).
        storage_options: fsspec options (endpoint, credentials, ...).
        cache_dir: Local directory for the catalog snapshot and fetched byte
            ranges (default ``$STEPDUMP_CACHE`` or ``~/.cache/stepdump``, then
            ``remote/<hash of the URL>``).

    ``path`` is the local cache directory; ``url`` the remote location.
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, storage: FsspecStorage | None = None) -> None:
        self.url = url.rstrip("/")
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.url)
        self._remote = storage if storage is not None else FsspecStorage(self.url, storage_options, cache)
        self._remote.cache_dir = cache
        fetch_catalog(self._remote, cache)
        super().__init__(cache, storage=self._remote)
        self._tag_ranges()

    def _tag_ranges(self) -> None:
        # The range cache is shared by every reader of the URL, and the URL may have been
        # emptied and recorded into again: keep ranges per run, never serve another run's.
        self._remote.use_run(run_tag(self.meta, self.path / CATALOG_FILE))

    def refresh(self) -> None:
        """Download the latest published catalog snapshot (steps uploaded since opening become visible)."""
        fetch_catalog(self._remote, self.path)
        new = CatalogReader(self.path)
        try:
            meta = new.meta()
            check_meta(meta, self.path)
        except BaseException:
            new.close()
            raise
        old, self._catalog, self.meta = self._catalog, new, meta
        self._blobs.con = new
        self._series_checked = False  # the new snapshot's series are checked again
        self._tag_ranges()
        old.close()

    @property
    def live(self) -> bool:
        """Unknown for a URL (no lock to look at): False. Call :meth:`refresh` to see new steps."""
        return False

    def __repr__(self) -> str:
        return f"<stepdump.types.RemoteRun {self.url!r}: {len(self.all_steps)} steps>"
