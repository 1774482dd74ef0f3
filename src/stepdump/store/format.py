"""Constants of the store format (see FORMAT.md); torch-free (dtypes are names here,
see :mod:`stepdump.core.dtypes` for the torch mapping).

``FORMAT_VERSION`` changes only when a reader of the previous version could no
longer read a store correctly; it is independent of the package version.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

FORMAT_VERSION = 1
CATALOG_FILE = "catalog.sqlite"
SEGMENT_DIR = "segments"
LOCK_FILE = "LOCK"

# Raw tensor bytes are little-endian; a big-endian writer would have to swap.
if sys.byteorder != "little":  # pragma: no cover - no such machine in CI
    raise ImportError("stepdump's store is little-endian; big-endian hosts are not supported yet")

# Kinds of recorded tensors. ``buffers`` come with ``params``; ``state`` holds the
# tensors found inside RNG / scheduler / scaler / optimizer-extra state.
TENSOR_KINDS = ("params", "grads", "optimizer", "activations", "activation_grads", "inputs")
INTERNAL_KINDS = ("buffers", "state")
ALL_KINDS = TENSOR_KINDS + INTERNAL_KINDS

# Step levels in the catalog.
LEVEL_NONE = 0  # only the step row and its scalars
LEVEL_STATS = 1  # stats and fingerprints, no tensor bytes
LEVEL_FULL = 2  # stats, fingerprints and tensor bytes


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse the catalog's shape column ("" for a 0-d tensor, else "2,3")."""
    return tuple(int(p) for p in text.split(",")) if text else ()


def format_shape(shape: Iterable[int]) -> str:
    return ",".join(str(int(d)) for d in shape)
