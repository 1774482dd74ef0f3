"""dmix64 (docs/cuda.md, FORMAT.md) in plain Python integers, word by word: the definition the
torch-ops reference (core/device_lean.py) and the fused kernel must equal bit for bit. Kept
apart from the library on purpose: a test comparing the library with itself would pass if both
drifted together."""

from __future__ import annotations

_M = (1 << 64) - 1
_K1, _C1, _C2, _K2 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xC2B2AE3D27D4EB4F


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * _C1) & _M
    x ^= x >> 33
    x = (x * _C2) & _M
    return x ^ (x >> 33)


def reference_dmix64(data: bytes) -> int:
    """dmix64 of ``data``, stored signed as xxh3 is (core.hashing.signed64)."""
    n = len(data)
    data += bytes(-n % 8)
    total = 0
    for i in range(len(data) // 8):
        word = int.from_bytes(data[8 * i:8 * i + 8], "little")
        total = (total + _fmix((word + (i + 1) * _K1) & _M)) & _M
    v = _fmix((total + n * _K2) & _M)
    return v - (1 << 64) if v >= 1 << 63 else v
