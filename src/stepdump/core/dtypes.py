"""The format's dtype names and their torch dtypes.

Names are part of the format: a store written on one machine must read on any
other, so dtypes are spelled out rather than taken from ``str(torch.dtype)``.
"""

from __future__ import annotations

import torch

from stepdump.errors import ConfigError
from stepdump.store.format import SPARSE_COO_PREFIX

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


def dtype_name(dtype: torch.dtype) -> str:
    """Return the format's name for ``dtype``."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ConfigError(f"stepdump cannot store tensors of dtype {dtype}") from None


def stored_dtype(t: torch.Tensor) -> str:
    """The ``tensors.dtype`` text of ``t``: its dtype's name, or for a sparse COO tensor
    ``sparse_coo:`` and its values' dtype name (FORMAT.md, "Sparse tensors")."""
    name = dtype_name(t.dtype)
    return SPARSE_COO_PREFIX + name if t.layout == torch.sparse_coo else name
