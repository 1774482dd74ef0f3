"""Per-tensor health stats, on the host (:func:`compute_stats`) and on the device
(:func:`device_stats`, no host sync).

Stats are computed over the *finite* elements (so one NaN does not turn min,
max, mean, std and norm into NaN); the NaN/+Inf/-Inf counts say how many
elements were left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# Tensors up to this many elements take the numpy path in compute_stats.
_SMALL = 4096

StatsTuple = tuple[int, int, int, int, float | None, float | None, float | None, float | None, float | None, float | None]


def compute_stats(t: torch.Tensor) -> StatsTuple:
    """numel, nan, +inf, -inf, min, max, mean, std, L2 norm, zero fraction."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return _sparse_stats(t)
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
        # training thread five times per tensor. The same code as a lean step's batch
        # (segment_sums, small_stats), so both give the same stats, bit for bit.
        xn = x.numpy()
        with np.errstate(all="ignore"):  # inf and NaN are handled below, without warnings
            vmin, vmax = float(xn.min()), float(xn.max())
            (vsum,), (vsq,) = segment_sums(xn, [0])
        got = small_stats(xn, vmin, vmax, vsum, vsq)
        return got if got is not None else _stats_nonfinite(x, n)
    mn, mx = torch.aminmax(x)
    total = x.sum()
    sumsq = torch.dot(x, x) if x.dtype in (torch.float32, torch.float64) else (x * x).sum()
    vmin, vmax, vsum, vsq = torch.stack([mn, mx, total, sumsq]).tolist()
    return stats_from_reads(x, vmin, vmax, vsum, vsq)


def stats_from_reads(x: torch.Tensor, vmin: float, vmax: float, vsum: float, vsq: float) -> StatsTuple:
    """The stats of ``x`` (1-d, as :func:`compute_stats` prepares it for its torch path) from its min,
    max, sum and sum of squares as that path reads them (``aminmax``, ``sum``, ``dot``): a caller that
    reads many tensors' four values back at once (capture/gradlog_rows.py) gets the same stats."""
    n = x.numel()
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


def segment_sums(x: np.ndarray, starts: list[int]) -> tuple[list[float], list[float]]:
    """The sum and the sum of squares of each segment of the 1-d array ``x`` (segments start at
    ``starts``, each runs to the next), accumulated in float64 in element order: a segment's
    results depend on its own elements only, wherever it sits in ``x``. One pass each over
    all of ``x``, whatever the number of segments (a lean step's small tensors, packed)."""
    sums, sqs = segment_sums_array(x, starts)
    return sums.tolist(), sqs.tolist()


def segment_sums_array(x: np.ndarray, starts: Sequence[int] | np.ndarray,
                       sums: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """:func:`segment_sums` as two float64 arrays (the same numbers, for vectorised use). Not
    ``sums``: the squares' sums alone (the sums zeros: a caller whose segments need no mean)."""
    x64 = x.astype(np.float64)
    got = np.add.reduceat(x64, starts) if sums else np.zeros(len(starts))
    np.multiply(x64, x64, out=x64)
    return got, np.add.reduceat(x64, starts)


def small_stats(xn: np.ndarray, vmin: float, vmax: float, vsum: float, vsq: float) -> StatsTuple | None:
    """The stats of a CPU fp32/fp64 tensor of at most 4096 elements (``xn``, 1-d) from its min,
    max, sum and sum of squares (:func:`segment_sums`); None when one of those is not finite
    (a NaN or Inf to count: :func:`compute_stats`'s slow path)."""
    if not (math.isfinite(vmin) and math.isfinite(vmax) and math.isfinite(vsum) and math.isfinite(vsq)):
        return None
    n = xn.size
    # Counting zeros is the costliest pass; a tensor of one sign has none (-0.0 == 0 in both tests).
    vnz = n if vmin > 0 or vmax < 0 else int(np.count_nonzero(xn))
    mean = vsum / n
    var = vsq / n - mean * mean
    if var < 1e-2 * mean * mean:
        # Cancellation regime (|mean| > 10 std, e.g. LayerNorm weights): two passes, in float64.
        d = xn.astype(np.float64) - mean
        var = float(np.add.reduceat(d * d, [0])[0]) / n
    return (n, 0, 0, 0, vmin, vmax, mean, math.sqrt(max(var, 0.0)), math.sqrt(vsq), (n - vnz) / n)


def _sparse_stats(t: torch.Tensor) -> StatsTuple:
    """Stats of a sparse COO tensor as of the dense tensor it stands for (duplicates summed,
    the elements no index names counted as zeros), without making it dense: the stats of its
    coalesced values, then min, max, mean, std and the zero fraction over its whole size.
    (FORMAT.md, "Sparse tensors"; the fingerprint is of the stored structure, not of this.)"""
    n = t.numel()
    if n == 0:
        return (0, 0, 0, 0, None, None, None, None, None, None)
    values = t.cpu().coalesce()._values().reshape(-1)
    k, nan, posinf, neginf, vmin, vmax, mean, std, norm, zero_frac = compute_stats(values)
    implicit = n - k  # elements no index names: zeros
    zeros = implicit + (round(zero_frac * k) if zero_frac is not None and k else 0)
    finite = k - nan - posinf - neginf  # the stored finite elements the value stats are over
    if not finite or vmin is None or vmax is None or mean is None or std is None:
        # No finite stored value: the stats are those of the implicit zeros, if there are any.
        return (n, nan, posinf, neginf, *((0.0,) * 5 if implicit else (None,) * 5), zeros / n)  # type: ignore[return-value]
    total = finite + implicit
    full_mean = mean * finite / total
    # Their sum of squares is (std^2 + mean^2) * finite; the implicit zeros add nothing to it.
    var = (std * std + mean * mean) * finite / total - full_mean * full_mean
    if implicit:
        vmin, vmax = min(vmin, 0.0), max(vmax, 0.0)
    return (n, nan, posinf, neginf, vmin, vmax, full_mean, math.sqrt(max(var, 0.0)), norm, zeros / n)


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


STATS_LEN = 10


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """The ten health stats as one float64 tensor, computed without a host sync.

    Same definitions as :func:`compute_stats` (stats over
    finite elements), written without data-dependent branches so it can be
    queued on a CUDA stream. Missing values (no finite element) are NaN.
    """
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = x.abs()
    x = x.to(torch.float64) if not x.dtype.is_floating_point or x.dtype == torch.float64 else x.to(torch.float32)
    n = x.numel()
    # No tensor is made from a Python value here (torch.tensor(..., device=cuda) is a host-to-device
    # copy, which syncs: torch.cuda.set_sync_debug_mode flags it); torch.full is a fill kernel.
    if n == 0:
        return torch.cat([torch.zeros(4, dtype=torch.float64, device=t.device),
                          torch.full((STATS_LEN - 4,), float("nan"), dtype=torch.float64, device=t.device)])
    finite = torch.isfinite(x)
    nfin = finite.sum()
    nan = torch.isnan(x).sum()
    posinf = torch.isposinf(x).sum()
    neginf = torch.isneginf(x).sum()
    zeros = (x == 0).sum()
    xz = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mn = torch.where(finite, x, torch.full((), float("inf"), dtype=x.dtype, device=x.device)).min()
    mx = torch.where(finite, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device)).max()
    cnt = nfin.to(torch.float64)
    mean = xz.sum(dtype=torch.float64) / cnt
    dev = torch.where(finite, x.to(torch.float64) - mean, torch.zeros((), dtype=torch.float64, device=x.device))
    std = torch.sqrt((dev * dev).sum() / cnt)
    norm = torch.linalg.vector_norm(xz.to(torch.float64))
    none = nfin == 0
    nanv = torch.full((), float("nan"), dtype=torch.float64, device=x.device)
    vals = [
        torch.full((), float(n), dtype=torch.float64, device=x.device),
        nan.to(torch.float64),
        posinf.to(torch.float64),
        neginf.to(torch.float64),
        torch.where(none, nanv, mn.to(torch.float64)),
        torch.where(none, nanv, mx.to(torch.float64)),
        torch.where(none, nanv, mean),
        torch.where(none, nanv, std),
        torch.where(none, nanv, norm),
        # A tensor divided by a tensor: on CUDA, torch divides by a Python scalar as a multiply by
        # its reciprocal (another rounding than the CPU's and the fused kernel's true division).
        zeros.to(torch.float64) / torch.full((), float(n), dtype=torch.float64, device=x.device),
    ]
    return torch.stack(vals)
