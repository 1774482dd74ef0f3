"""Recording under ``torch.distributed``: which ranks record, and how sharded tensors are described.

Each recording rank writes a complete single-process store of its own into
``RUN/rank{r:05d}`` (see :mod:`stepdump.store.ranks`), so recording needs no
collective and one slow rank never stalls another's writer. What a rank
records is what it holds: full replicas under DDP, its local shards under
FSDP2 / DTensor, described in the catalog's ``meta.distributed.sharding`` so
that a reader can put the full tensor back together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stepdump.core.dtensor import is_dtensor
from stepdump.errors import ConfigError

Ranks = Iterable[int] | str | None



@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job and the ranks chosen to record."""

    rank: int
    world_size: int
    ranks: tuple[int, ...]
    backend: str | None

    @property
    def records(self) -> bool:
        return self.rank in self.ranks

    def meta(self, params: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``meta.distributed`` of this rank's store."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "ranks": list(self.ranks),
            "backend": self.backend,
            "sharding": sharding_meta(params),
        }


def check_ranks(ranks: Ranks) -> None:
    """Validate the ``ranks=`` argument on its own (before knowing the world size)."""
    if ranks is None or ranks == "all":
        return
    if isinstance(ranks, (str, bytes)):
        raise ConfigError(f"ranks={ranks!r}: give 'all', None, or an iterable of rank numbers such as [0]")
    try:
        items = list(ranks)
    except TypeError:
        raise ConfigError(f"ranks={ranks!r}: give 'all', None, or an iterable of rank numbers such as [0]") from None
    if not items:
        raise ConfigError("ranks= is empty: name at least one rank to record, or pass ranks='all'")
    bad = [r for r in items if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ConfigError(f"ranks= must hold non-negative integers (rank numbers), got {bad[0]!r}")


def resolve(ranks: Ranks) -> RankInfo | None:
    """This process's RankInfo, or None when the run is recorded as a single process.

    None when ``ranks`` is None (record into the path itself, ignoring
    torch.distributed) or when no default process group is initialized.
    """
    check_ranks(ranks)
    if ranks is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    chosen: tuple[int, ...] = tuple(range(world)) if ranks == "all" else tuple(sorted({int(r) for r in ranks}))  # type: ignore[union-attr]
    outside = [r for r in chosen if r >= world]
    if outside:
        raise ConfigError(f"ranks= names rank {outside[0]}, but the job has world_size={world} (ranks 0..{world - 1})")
    try:
        backend = str(dist.get_backend())
    except (RuntimeError, ValueError):  # pragma: no cover - exotic process groups
        backend = None
    return RankInfo(rank=rank, world_size=world, ranks=chosen, backend=backend)


def this_rank_records(ranks: Ranks) -> bool:
    """False only on a rank of an initialized process group that ``ranks`` leaves out."""
    info = resolve(ranks)
    return info is None or info.records


# -- describing shards ---------------------------------------------------------


def placement_name(p: Any) -> str:
    """A version-independent spelling of a DTensor placement (FORMAT.md, multi-rank runs)."""
    cls = type(p).__name__
    if cls == "_StridedShard":  # FSDP2 over tensor parallel: not a contiguous block
        return f"strided_shard({p.dim},{getattr(p, 'split_factor', '?')})"
    if p.is_shard():
        return f"shard({p.dim})"
    if p.is_replicate():
        return "replicate"
    if p.is_partial():
        return f"partial({getattr(p, 'reduce_op', 'sum')})"
    return f"unknown({cls})"


def sharding_meta(params: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Parameter name -> where this rank's shard sits in the full tensor, for every DTensor parameter."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        if not is_dtensor(p):
            continue
        mesh = p.device_mesh  # type: ignore[attr-defined]
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        local = tuple(p.to_local().shape)  # type: ignore[attr-defined]
        offset = _global_offset(p, mesh, placements, local)
        names = [placement_name(pl) for pl in placements]
        contiguous = all(n.startswith(("shard(", "replicate")) for n in names)
        out[name] = {
            "global_shape": list(p.shape),
            "local_shape": list(local),
            # None: the shard is not one contiguous block of the full tensor (strided or partial
            # placements); readers then offer it only as the local tensor.
            "offset": list(offset) if contiguous and offset is not None else None,
            "placements": names,
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "mesh_coordinate": mesh.get_coordinate(),
        }
    return out


def _global_offset(p: Any, mesh: Any, placements: tuple[Any, ...], local: tuple[int, ...]) -> list[int] | None:
    """Offset of the local shard in the global tensor (torch's own computation when available)."""
    try:
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        shape, found = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        if tuple(shape) == local:
            return [int(o) for o in found]
    except Exception:  # noqa: BLE001 - a private helper; fall back to torch.chunk semantics below
        pass
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    size: list[int] = list(p.shape)
    offset = [0] * len(size)
    for i, pl in enumerate(placements):
        if type(pl).__name__ == "_StridedShard" or not pl.is_shard():
            continue
        d, n = pl.dim, mesh.size(i)
        chunk = math.ceil(size[d] / n) if size[d] else 0
        start = min(coord[i] * chunk, size[d])
        offset[d] += start
        size[d] = max(0, min(size[d], start + chunk) - start)
    return offset if tuple(size) == local else None
