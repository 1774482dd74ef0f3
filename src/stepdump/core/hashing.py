"""Fingerprints: xxh3-64 of a tensor's exact little-endian bytes.

Equal fingerprints mean bitwise-equal bytes (to 2**-64); dtype and shape are
compared separately. A sparse COO tensor's bytes include its structure (indices in their
order, the coalesced flag): FORMAT.md, "Sparse tensors". Used by the writer, every reader and ``verify``.
"""

from __future__ import annotations

import torch
import xxhash

from stepdump.core.sparse import sparse_raw_bytes


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, C-contiguous, little-endian, without a copy when possible. A sparse
    COO tensor's are its header, indices and values (:mod:`stepdump.core.sparse`), a copy."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return sparse_raw_bytes(t)
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def signed64(u: int) -> int:
    """SQLite integers are signed 64-bit; store unsigned hashes in that range."""
    return u - (1 << 64) if u >= (1 << 63) else u


def fingerprint_bytes(data: memoryview | bytes) -> int:
    return signed64(xxhash.xxh3_64_intdigest(data))


def fingerprint(t: torch.Tensor) -> int:
    """Fingerprint of a tensor's exact bytes (dtype and shape are compared separately)."""
    return fingerprint_bytes(raw_bytes(t))
