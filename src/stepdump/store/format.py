"""Constants of the store format (see FORMAT.md) and the dtype table.

``FORMAT_VERSION`` changes only when a reader of the previous version could no
longer read a store correctly; it is independent of the package version.
"""

from __future__ import annotations

import sys

import torch

FORMAT_VERSION = 1
CATALOG_FILE = "catalog.sqlite"
SEGMENT_DIR = "segments"
LOCK_FILE = "LOCK"

# Names are part of the format: a store written on one machine must read on any
# other, so dtypes are spelled out rather than taken from ``str(torch.dtype)``.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

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


def dtype_name(dtype: torch.dtype) -> str:
    """Return the format's name for ``dtype``."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        from stepdump.errors import ConfigError

        raise ConfigError(f"stepdump cannot store tensors of dtype {dtype}") from None


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse the catalog's shape column ("" for a 0-d tensor, else "2,3")."""
    return tuple(int(p) for p in text.split(",")) if text else ()


def format_shape(shape: tuple[int, ...] | torch.Size) -> str:
    return ",".join(str(int(d)) for d in shape)
