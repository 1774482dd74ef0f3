"""The device fingerprint (dmix64) and the stats of a lean step computed where the tensors are.

A stats-only step on a GPU must not copy the record to the host: what it keeps of each tensor
is ten health stats and a fingerprint, a few numbers. xxh3 (the host fingerprint,
:mod:`stepdump.core.hashing`) is sequential over a tensor's bytes, so the device cannot
compute it at memory speed; **dmix64** is a sum over the tensor's 8-byte words, so any
reduction order gives the same bits (docs/cuda.md, "The device fingerprint"; FORMAT.md):

    w_i = little-endian word i of the bytes zero-padded to a multiple of 8, i = 0..m-1
    S   = sum_i fmix(w_i + (i + 1) * K1)   (mod 2**64)
    fp  = fmix(S + L * K2)                 (L: the byte length), stored as a signed int64

with ``fmix`` murmur3's 64-bit finalizer. The functions here are the reference: plain torch
ops, on any device, with no host synchronisation. The fused kernel
(:mod:`stepdump.core.device_lean_triton`, where Triton and a GPU are there) must give the same
bits; a reader computes the fingerprint of a stored blob with the same code on the CPU.

torch int64 arithmetic wraps modulo 2**64 on the CPU and CUDA, which is what the definition
needs; a logical right shift of a signed int64 is an arithmetic shift with the sign bits masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stepdump.core.sparse import sparse_raw_bytes
from stepdump.core.stats import STATS_LEN, device_stats

HOST_FP_KIND = "xxh3"
DEVICE_FP_KIND = "dmix64"
FP_KINDS = (HOST_FP_KIND, DEVICE_FP_KIND)

_MASK64 = (1 << 64) - 1
K1 = 0x9E3779B97F4A7C15
C1 = 0xFF51AFD7ED558CCD
C2 = 0xC4CEB9FE1A85EC53
K2 = 0xC2B2AE3D27D4EB4F
_LOW31 = (1 << 31) - 1  # what a logical shift by 33 leaves of a 64-bit word


def _signed(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 64-bit finalizer on int64 tensors (wrapping multiply, logical shifts)."""
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _signed(C1)
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _signed(C2)
    return x ^ ((x >> 33) & _LOW31)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's raw bytes as int64 words (zero-padded to a multiple of 8), and the byte length."""
    t = t.detach()
    if t.layout == torch.sparse_coo:  # header, indices and values: FORMAT.md "Sparse tensors"
        data = torch.frombuffer(bytearray(sparse_raw_bytes(t)), dtype=torch.uint8).to(t.device)
    else:
        if t.is_complex():
            t = torch.view_as_real(t)
        data = t.contiguous().reshape(-1).view(torch.uint8)
    length = data.numel()
    pad = -length % 8
    if pad or data.storage_offset() % 8 or data.untyped_storage().data_ptr() % 8:
        data = torch.cat([data, data.new_zeros(pad)]) if pad else data.clone()
    return data.view(torch.int64), length


def device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """dmix64 of ``t``'s bytes (C-contiguous, little-endian: those :func:`hashing.raw_bytes`
    gives) as a 0-dim int64 tensor on ``t``'s device; queued, never waited for."""
    words, length = _words(t)
    m = words.numel()
    index = torch.arange(1, m + 1, dtype=torch.int64, device=words.device)
    total = _fmix(words + index * _signed(K1)).sum(dtype=torch.int64)
    return _fmix(total + _signed(length * K2))


def fused_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ten health stats of each tensor, ``(n, STATS_LEN)`` float64 on their device (the
    definitions of :func:`stepdump.core.stats.device_stats`), with no host synchronisation."""
    if not tensors:
        return torch.empty((0, STATS_LEN), dtype=torch.float64)
    fused = _fused_pack(list(tensors))
    if fused is not None:  # the same numbers a lean step records (its sums may differ from device_stats' in the last bits)
        return fused[:, :STATS_LEN].view(torch.float64)
    return _reference_stats(tensors)


def _reference_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([device_stats(t) for t in tensors])


def lean_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What a lean step copies to the host: ``(n, STATS_LEN + 1)`` int64, each row the tensor's
    stats as float64 bits, then its dmix64 fingerprint. The fused kernel when it takes the list,
    else the torch-ops reference (same bits for counts, min, max and the fingerprint)."""
    fused = _fused_pack(list(tensors)) if tensors else None
    if fused is not None:
        return fused
    return reference_pack(tensors)


def _fused_pack(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The fused kernel's pack, or None where it does not take the list (no Triton, no GPU)."""
    fused = fused_module()
    result: torch.Tensor | None = None if fused is None else fused.fused_pack(tensors)
    return result


def fused_module() -> Any:
    """:mod:`stepdump.core.device_lean_triton`, imported on first use (``import stepdump`` does not
    pay for Triton's import), then kept (an import statement costs Python calls every step);
    None where it cannot be imported."""
    global _triton_module
    if _triton_module is None:
        try:
            from stepdump.core import device_lean_triton  # type: ignore[attr-defined,unused-ignore]
        except ImportError:
            return None
        _triton_module = device_lean_triton
    return _triton_module


_triton_module: Any = None


def reference_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`lean_pack` by plain torch ops (any device)."""
    if not tensors:
        return torch.empty((0, STATS_LEN + 1), dtype=torch.int64)
    stats = _reference_stats(tensors)
    fps = torch.stack([device_fingerprint(t) for t in tensors]).to(stats.device)
    return torch.cat([stats.view(torch.int64), fps.unsqueeze(1)], dim=1)
