"""The multi-rank layout: one ordinary store per rank under a directory with ``ranks.json``.

A run recorded by several processes of one ``torch.distributed`` job is::

    RUN/
      ranks.json        {"format": "stepdump-ranks", "format_version": 1, "world_size": W, "ranks": [...], ...}
      rank00000/        a complete single-process store (FORMAT.md), written by rank 0 alone
      rank00001/        ... one per recorded rank

Every rank writes only its own directory, so the single-writer rules of a store
(one flock, one SQLite writer) hold unchanged and no rank waits for another.
``ranks.json`` is written by every recording rank with identical bytes (write
to a temporary name, then rename), so it never needs a collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stepdump.errors import ConfigError, CorruptDataError, FormatVersionError
from stepdump.store import bounded_json, inside

RANKS_FILE = "ranks.json"
RANKS_FORMAT = "stepdump-ranks"
RANKS_FORMAT_VERSION = 1
# Refuse absurd files before parsing them (a 1,000,000-rank job is ~8 MB of JSON).
_MAX_RANKS_BYTES = 64 << 20
_ROLE = "the multi-rank run's ranks.json"


def rank_dir(rank: int) -> str:
    """The directory name of ``rank``'s store: ``rank00000``, ``rank00001``, ..."""
    return f"rank{int(rank):05d}"


def ranks_document(world_size: int, ranks: list[int], backend: str | None) -> dict[str, Any]:
    return {
        "format": RANKS_FORMAT,
        "format_version": RANKS_FORMAT_VERSION,
        "world_size": int(world_size),
        "ranks": sorted(int(r) for r in ranks),
        "backend": backend,
    }


def encode(doc: dict[str, Any]) -> bytes:
    """Canonical bytes (sorted keys), so every rank writes the same file."""
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check a ``ranks.json``; ``where`` names it in error messages."""
    doc = bounded_json.loads(data, where, max_bytes=_MAX_RANKS_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != RANKS_FORMAT:
        raise CorruptDataError(f"{where} is not a stepdump ranks.json (no \"format\": \"{RANKS_FORMAT}\")")
    version = doc.get("format_version")
    if version != RANKS_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} uses multi-rank layout version {version!r}; this stepdump reads version "
            f"{RANKS_FORMAT_VERSION}. Install a stepdump release that reads it."
        )
    world = doc.get("world_size")
    ranks = doc.get("ranks")
    if (
        isinstance(world, bool) or not isinstance(world, int) or world < 1
        or not isinstance(ranks, list) or not ranks
        or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world for r in ranks)
        or len(set(ranks)) != len(ranks)
    ):
        raise CorruptDataError(f"{where} has an invalid world_size or ranks list")
    return doc


def read_local(root: Path) -> dict[str, Any]:
    """``root/ranks.json``, parsed and checked (a link or a FIFO there is refused: store/inside.py)."""
    data = inside.read_file(root, RANKS_FILE, _ROLE, _MAX_RANKS_BYTES)
    return parse(data, str(root / RANKS_FILE))


def local_rank_dir(root: Path, rank: int) -> Path:
    """``rank``'s store under ``root``: a directory of the run, never a link out of it."""
    return inside.inside(root, rank_dir(rank), f"rank {rank}'s store (a multi-rank run's rank directory)")


def write_local(root: Path, doc: dict[str, Any]) -> None:
    """Write ``root/ranks.json`` atomically (several ranks may do it at once, with the same bytes;
    each through a fresh temporary file, then rename: store/inside.py)."""
    inside.write_atomic(root, RANKS_FILE, encode(doc), _ROLE)


def check_same_job(existing: dict[str, Any], doc: dict[str, Any], where: str) -> None:
    """Refuse to mix two jobs (other world size or other recorded ranks) in one run directory."""
    if existing.get("world_size") != doc["world_size"] or existing.get("ranks") != doc["ranks"]:
        raise ConfigError(
            f"{where} holds a run recorded by world_size={existing.get('world_size')} ranks={existing.get('ranks')}, "
            f"but this job has world_size={doc['world_size']} and records ranks {doc['ranks']}. Pass the same "
            "ranks= on every rank, or record into a new directory."
        )
