"""Where a Recorder writes: a local directory, this rank's part of a multi-rank run, and/or a URL.

The Recorder itself always writes one single-process store into a local
directory (:attr:`Target.local`). This module decides which directory that
is and what happens around it:

* under ``torch.distributed`` (unless ``ranks=None``): ``path/rank{r:05d}``,
  with ``path/ranks.json`` describing the job (:mod:`stepdump.store.ranks`);
* for a URL: a local staging directory, published by an uploader thread
  (:mod:`stepdump.capture.upload`); both combine (``s3://b/run/rank00001``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stepdump.capture import sharding
from stepdump.capture.sharding import RankInfo, Ranks
from stepdump.capture.upload import Remote, Uploader
from stepdump.errors import ConfigError, RunExistsError
from stepdump.store import ranks as ranks_file
from stepdump.store.format import CATALOG_FILE
from stepdump.store.fsspec_storage import FsspecStorage, is_url


@dataclass
class Target:
    """The resolved destination of one Recorder."""

    local: Path
    url: str | None = None
    rank: RankInfo | None = None
    remote: Remote | None = None
    storage: FsspecStorage | None = None
    uploader: Uploader | None = None

    def meta(self, params: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Extra catalog meta: ``distributed`` (rank, world size, shards) and ``url``."""
        out: dict[str, Any] = {}
        if self.rank is not None:
            out["distributed"] = self.rank.meta(params)
        if self.url is not None:
            out["url"] = self.url
        return out

    def segment_bytes(self, requested: int) -> int:
        return requested if self.remote is None else min(requested, self.remote.segment_bytes)

    def start(self, progress: Callable[[], int]) -> None:
        """Start publishing (URL targets only); ``progress`` counts the steps written so far."""
        if self.storage is not None and self.remote is not None:
            self.uploader = Uploader(self.local, self.storage, self.remote, progress)
            self.uploader.start()

    def abandon(self) -> None:
        """Stop publishing without publishing anything more (the Recorder failed while being built)."""
        if self.uploader is not None:
            uploader, self.uploader = self.uploader, None
            uploader.stop()

    def finish(self) -> None:
        """Publish the final state (URL targets only); raises WriterError if the upload fails."""
        if self.uploader is not None:
            uploader, self.uploader = self.uploader, None
            uploader.finish()


def resolve(path: str | os.PathLike[str], *, ranks: Ranks, remote: Remote | Mapping[str, Any] | None,
            resume: bool) -> Target:
    """Work out the Target for ``Recorder(path, ..., ranks=, remote=, resume=)`` and prepare it."""
    info = sharding.resolve(ranks)
    if info is not None and not info.records:  # pragma: no cover - the Recorder stays inactive on excluded ranks
        raise ConfigError(f"rank {info.rank} is not among ranks={list(info.ranks)}")
    if is_url(path):
        doc = ranks_file.ranks_document(info.world_size, list(info.ranks), info.backend) if info else None
        return _remote_target(str(path), info, doc, Remote.coerce(remote), resume)
    if remote is not None:
        raise ConfigError(f"remote= applies to URLs (s3://..., gs://...); {os.fspath(path)!r} is a local path")
    root = Path(path)
    if info is None:
        return Target(local=root)
    if (root / CATALOG_FILE).exists():
        raise RunExistsError(
            f"{root} holds a single-process run; a distributed run needs its own directory (each rank "
            "records into DIR/rank00000, DIR/rank00001, ...)"
        )
    doc = ranks_file.ranks_document(info.world_size, list(info.ranks), info.backend)
    if os.path.lexists(root / ranks_file.RANKS_FILE):  # a link there is refused, not replaced
        ranks_file.check_same_job(ranks_file.read_local(root), doc, str(root / ranks_file.RANKS_FILE))
    local = ranks_file.local_rank_dir(root, info.rank)  # checked before ranks.json is written
    ranks_file.write_local(root, doc)
    return Target(local=local, rank=info)


def _remote_target(url: str, info: RankInfo | None, doc: dict[str, Any] | None, remote: Remote,
                   resume: bool) -> Target:
    if resume:
        raise ConfigError(
            f"resume=True is not supported for URLs ({url}): resume into a local copy of the run, "
            "then publish it again"
        )
    root = FsspecStorage(url, remote.storage_options)
    storage = root
    if info is not None and doc is not None:
        existing = root.get_bytes(ranks_file.RANKS_FILE)
        if existing is not None:
            ranks_file.check_same_job(ranks_file.parse(existing, f"{url}/ranks.json"), doc, f"{url}/ranks.json")
        else:
            root.put_bytes(ranks_file.RANKS_FILE, ranks_file.encode(doc))
        storage = root.child(ranks_file.rank_dir(info.rank))
    if storage.exists(CATALOG_FILE):
        raise RunExistsError(f"{storage.url} already holds a stepdump run; record to a new URL")
    if remote.staging is not None:
        local = Path(remote.staging)
        if info is not None:
            local = local / ranks_file.rank_dir(info.rank)
    else:
        local = Path(tempfile.mkdtemp(prefix="stepdump-staging-"))
    return Target(local=local, url=storage.url, rank=info, remote=remote, storage=storage)
