"""dmix64 (docs/cuda.md, FORMAT.md) in plain Python integers, word by word: the definition the
torch-ops reference (core/device_lean.py) and the fused kernel must equal bit for bit. Kept
apart from the library on purpose: a test comparing the library with itself would pass if both
drifted together. With it, the cases the CPU tests (tests/) and the GPU suite (tests_gpu/) hold
the device fingerprint and the kind rules to, said once."""

from __future__ import annotations

from typing import Any

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


# -- one change of the bytes or their length: each must change the fingerprint -------------------
CHANGES = ["first bit", "middle bit", "last bit", "sign of last element", "swap two words", "one zero byte more",
           "one zero byte less", "-0.0 for 0.0", "another NaN payload"]


def changed_pair(data: bytes, change: str) -> tuple[bytearray, bytearray]:
    """(a, b): ``data`` (float32 bytes, at least 16) and the same with one ``change`` of CHANGES
    (for the last three, ``a`` is changed too, to the value the change is about)."""
    a = bytearray(data)
    b = bytearray(a)
    if change == "first bit":
        b[0] ^= 1
    elif change == "middle bit":
        b[len(b) // 2] ^= 0x10
    elif change == "last bit":
        b[-1] ^= 0x80
    elif change == "sign of last element":
        a[-1] &= 0x7F  # float32 little-endian: the sign is the top bit of the last byte
        b[-1] = a[-1] | 0x80
    elif change == "swap two words":
        b[0:8], b[8:16] = a[8:16], a[0:8]
    elif change == "one zero byte more":
        b += b"\0"
    elif change == "one zero byte less":
        a += b"\0"
    elif change == "-0.0 for 0.0":
        a[0:4] = bytes(4)
        b[0:4] = bytes([0, 0, 0, 0x80])
    else:
        a[0:4] = bytes([0, 0, 0xC0, 0x7F])
        b[0:4] = bytes([1, 0, 0xC0, 0x7F])
    return a, b


def sprinkle_nonfinite(ts: Any) -> None:
    """NaN at every 7th, +Inf at every 13th (from 1), -Inf at every 17th (from 2) element of each
    floating-point tensor over 20 elements, in place."""
    for t in ts:
        if t.dtype.is_floating_point and t.numel() > 20:
            t.view(-1)[::7] = float("nan")
            t.view(-1)[1::13] = float("inf")
            t.view(-1)[2::17] = float("-inf")


# -- the kind rules: same_fingerprint(kind_a, fp_a, kind_b, fp_b) -> want --------------------------
COMPARE_ROWS = [
    ("xxh3", 7, "xxh3", 7, True),
    ("xxh3", 7, "xxh3", 8, False),
    ("dmix64", -3, "dmix64", -3, True),
    ("dmix64", -3, "dmix64", 3, False),
    ("xxh3", 7, "dmix64", 7, None),  # same number, other kind: not "identical", not comparable
    ("dmix64", 7, "xxh3", 7, None),
    ("xxh3", 7, "dmix64", 8, None),  # nor "different": the bytes may still be equal
]
