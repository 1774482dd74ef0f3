"""Sparse COO tensors as stored: exact copies, their raw bytes, their stats, and back.

A sparse gradient (``nn.Embedding(sparse=True)``) is recorded exactly as the optimizer
is handed it. Its indices may repeat (a row looked up twice in a batch) and come in the
order autograd appended them; an update adds the duplicates one by one, so summing them
first (``to_dense()``, ``coalesce()``) gives a gradient that differs in the last bits from
the one applied. The raw bytes of such a tensor are therefore its own structure
(FORMAT.md, "Sparse tensors")::

    header (32 bytes, little-endian): b"COO1", uint32 flags (bit 0: coalesced),
                                      uint64 sparse_dim, uint64 nnz, uint64 0
    indices: int64 [sparse_dim, nnz], C order
    values:  [nnz, *size[sparse_dim:]] in the tensor's dtype, C order

and its fingerprint is the xxh3-64 of those bytes, as for any tensor. The dense size and
the values' dtype are in the catalog row (``shape``, ``dtype = "sparse_coo:<dtype>"``).
"""

from __future__ import annotations

import math
import struct

import torch

from stepdump.errors import CorruptDataError
from stepdump.store.format import (
    SPARSE_COO_COALESCED,
    SPARSE_COO_HEADER,
    SPARSE_COO_HEADER_BYTES,
    SPARSE_COO_MAGIC,
    SPARSE_KINDS,
)


def as_recorded(kind: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a ``kind`` series records it: sparse COO as it is for the kinds stored sparse
    (``SPARSE_KINDS``), dense (``to_dense()``) for any other non-strided tensor."""
    if t.layout == torch.strided or (t.layout == torch.sparse_coo and kind in SPARSE_KINDS):
        return t
    return t.to_dense()


def exact_copy(t: torch.Tensor) -> torch.Tensor:
    """A private copy on the CPU with the same indices (order and duplicates kept), values,
    size and coalesced flag (``clone()`` keeps them too, but says nothing about it)."""
    t = t.detach()
    # check_invariants=False: the parts come from a valid tensor (and saying so keeps torch
    # from warning in the user's training loop that checks are off).
    return torch.sparse_coo_tensor(t._indices().to("cpu", copy=True), t._values().to("cpu", copy=True),
                                   tuple(t.shape), is_coalesced=t.is_coalesced(), check_invariants=False)


def _plain_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def sparse_raw_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a sparse COO tensor: header, indices, values (see the module docstring)."""
    indices, values = t._indices(), t._values()
    flags = SPARSE_COO_COALESCED if t.is_coalesced() else 0
    head = struct.pack(SPARSE_COO_HEADER, SPARSE_COO_MAGIC, flags, t.sparse_dim(), t._nnz(), 0)
    return memoryview(head + _plain_bytes(indices) + _plain_bytes(values))


def from_raw_bytes(raw: bytes | bytearray | memoryview, dtype: torch.dtype, size: tuple[int, ...]) -> torch.Tensor:
    """The sparse COO tensor whose raw bytes are ``raw`` (values of ``dtype``, dense ``size``),
    checked: a header that does not describe exactly these bytes, or indices outside ``size``
    (or that contradict the coalesced flag), are a CorruptDataError, never a tensor."""
    data = memoryview(raw).cast("B")
    if len(data) < SPARSE_COO_HEADER_BYTES:
        raise CorruptDataError(f"a sparse tensor's bytes ({len(data)}) are shorter than its header")
    magic, flags, sparse_dim, nnz, reserved = struct.unpack_from(SPARSE_COO_HEADER, data)
    if magic != SPARSE_COO_MAGIC or flags & ~SPARSE_COO_COALESCED or reserved:
        raise CorruptDataError(f"a sparse tensor's header is malformed ({bytes(data[:SPARSE_COO_HEADER_BYTES]).hex()})")
    if not 0 <= sparse_dim <= len(size):
        raise CorruptDataError(f"a sparse tensor claims {sparse_dim} sparse dims, its size {size} has {len(size)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    dense = size[sparse_dim:]
    per = 8 * sparse_dim + math.prod(dense) * itemsize  # bytes per stored element
    body = len(data) - SPARSE_COO_HEADER_BYTES
    if (nnz * per != body) if per else (body or nnz > 1):
        raise CorruptDataError(f"a sparse tensor's header says {nnz} elements of {per} bytes, it holds {body} bytes")
    start = SPARSE_COO_HEADER_BYTES
    cut = start + 8 * sparse_dim * nnz
    indices = _tensor(data[start:cut], torch.int64, (sparse_dim, nnz))
    values = _tensor(data[cut:], dtype, (nnz, *dense))
    try:  # check_invariants: indices inside the size, and a coalesced claim that holds
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=bool(flags & SPARSE_COO_COALESCED),
                                       check_invariants=True)
    except (RuntimeError, ValueError, TypeError) as e:
        raise CorruptDataError(f"a stored sparse tensor is malformed: {e}") from None


def _tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
