"""Per-tensor health stats and fingerprints.

Stats are computed over the *finite* elements (so one NaN does not turn min,
max, mean, std and norm into NaN); the NaN/+Inf/-Inf counts say how many
elements were left out. The fingerprint is xxh3-64 of the exact little-endian
bytes, so equal fingerprints mean bitwise-equal tensors (to 2**-64).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

# Tensors up to this many elements take the numpy path in compute_stats.
_SMALL = 4096

StatsTuple = tuple[int, int, int, int, float | None, float | None, float | None, float | None, float | None, float | None]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, C-contiguous, little-endian, without a copy when possible."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def signed64(u: int) -> int:
    """SQLite integers are signed 64-bit; store unsigned hashes in that range."""
    return u - (1 << 64) if u >= (1 << 63) else u


def fingerprint_bytes(data: memoryview | bytes) -> int:
    return signed64(xxhash.xxh3_64_intdigest(data))


def fingerprint(t: torch.Tensor) -> int:
    """Fingerprint of a tensor's exact bytes (dtype and shape are compared separately)."""
    return fingerprint_bytes(raw_bytes(t))


def compute_stats(t: torch.Tensor) -> StatsTuple:
    """numel, nan, +inf, -inf, min, max, mean, std, L2 norm, zero fraction."""
    t = t.detach()
    n = t.numel()
    if n == 0:
        return (0, 0, 0, 0, None, None, None, None, None, None)
    if t.dtype == torch.bool:
        x = t.reshape(-1).to(torch.float32)
    elif t.is_complex():
        x = t.reshape(-1).abs().to(torch.float64)
    elif t.dtype.is_floating_point:
        x = t.reshape(-1)
        if x.dtype in (torch.float16, torch.bfloat16) or x.dtype.itemsize == 1:
            x = x.to(torch.float32)
    else:
        x = t.reshape(-1).to(torch.float64)
    # Fast path: four cheap passes (aminmax, sum, dot, count_nonzero). A NaN makes
    # the sum NaN and an Inf makes min or max infinite, so finite results prove
    # there is nothing to count. std and norm come from the sum and the sum of
    # squares; torch.std_mean is ~20x slower than sum + dot on CPU, and this
    # runs on every tensor of every step. (Relative error of std is ~1e-7 times
    # (mean/std)^2, so below |mean| = 10 std it is recomputed in two passes.)
    if n <= _SMALL and x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu":
        # Biases and norm weights (most of a transformer's tensors): numpy's calls cost
        # a fraction of torch's dispatch, and do not hand the GIL to and fro with the
        # training thread five times per tensor.
        xn = x.numpy()
        with np.errstate(all="ignore"):  # inf and NaN are handled below, without warnings
            vmin, vmax, vsum, vsq = float(xn.min()), float(xn.max()), float(xn.sum()), float(np.dot(xn, xn))
        vnz = n if vmin > 0 or vmax < 0 else int(np.count_nonzero(xn))
    else:
        mn, mx = torch.aminmax(x)
        total = x.sum()
        sumsq = torch.dot(x, x) if x.dtype in (torch.float32, torch.float64) else (x * x).sum()
        vmin, vmax, vsum, vsq = torch.stack([mn, mx, total, sumsq]).tolist()
        # Counting zeros is the costliest pass; a tensor of one sign has none (Adam's
        # exp_avg_sq, most norms and scales). -0.0 == 0 in both tests, as in the count.
        vnz = n if vmin > 0 or vmax < 0 else int(torch.count_nonzero(x))
    if all(math.isfinite(v) for v in (vmin, vmax, vsum, vsq)):
        mean = vsum / n
        var = vsq / n - mean * mean
        if var < 1e-2 * mean * mean:
            # Cancellation regime (|mean| > 10 std, e.g. LayerNorm weights): the
            # two-pass result is worth its cost here, and such tensors are rare.
            std = float(torch.std_mean(x.double(), correction=0)[0])
        else:
            std = math.sqrt(var)
        return (n, 0, 0, 0, vmin, vmax, mean, std, math.sqrt(vsq), (n - vnz) / n)
    return _stats_nonfinite(x, n)


def _stats_nonfinite(x: torch.Tensor, n: int) -> StatsTuple:
    """Slow path: count NaN/Inf and compute the stats over the finite elements."""
    zeros = int((x == 0).sum())
    finite = torch.isfinite(x)
    nfinite = int(finite.sum())
    nan = int(torch.isnan(x).sum())
    posinf = int(torch.isposinf(x).sum())
    neginf = n - nfinite - nan - posinf
    x = x[finite]
    if x.numel() == 0:
        return (n, nan, posinf, neginf, None, None, None, None, None, zeros / n)
    mn, mx = torch.aminmax(x)
    std, mean = torch.std_mean(x, correction=0)
    norm = torch.linalg.vector_norm(x.double())
    return (n, nan, posinf, neginf, float(mn), float(mx), float(mean), _clean(float(std)), float(norm), zeros / n)


def _clean(v: float) -> float:
    # std of a constant tensor can come out as nan on some backends; it is 0.
    return 0.0 if math.isnan(v) else v
