"""Downsampling for drawing: fewer points, same extremes.

A chart about a thousand pixels wide cannot show 10,000 steps, and plain
decimation (every n-th step) drops exactly the spike a reader is looking for.
Both helpers cut the steps into contiguous buckets of (nearly) equal size and
keep what matters per bucket:

* :func:`minmax_downsample` (lines): the points where the series reaches its
  minimum and its maximum in the bucket, in step order, plus the first
  non-finite point if the bucket has one (drawn as a gap). Every spike and
  every dip survives, at its own step.
* :func:`bucket_max` (heatmaps, counts): the maximum of each row over the
  bucket's columns, ignoring NaN.

They return new arrays and never modify their inputs.
"""

from __future__ import annotations

import numpy as np


def bucket_edges(n: int, buckets: int) -> np.ndarray:
    """``min(n, buckets) + 1`` increasing indices from 0 to ``n``: bucket i is ``[e[i], e[i+1])``."""
    buckets = max(1, min(n, buckets))
    return np.linspace(0, n, buckets + 1).astype(np.int64)


def minmax_downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` of the points ``(x, y)``, keeping each bucket's min and max.

    Args:
        x: Steps, increasing.
        y: Values (NaN/Inf allowed) at those steps.
        max_points: Most points to return (at least 3).

    Returns:
        ``(x, y)`` copies, unchanged when there are already few enough points.
    """
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    if n <= max_points:
        return x.copy(), y.copy()
    finite = np.isfinite(y)
    per_bucket = 2 if finite.all() else 3
    edges = bucket_edges(n, max(1, max_points // per_bucket))
    keep: list[int] = []
    for a, b in zip(edges[:-1], edges[1:]):
        idx = set()
        fin = np.flatnonzero(finite[a:b])
        if fin.size:
            seg = y[a:b][fin]
            idx.add(a + int(fin[np.argmin(seg)]))
            idx.add(a + int(fin[np.argmax(seg)]))
        if fin.size < b - a:
            idx.add(a + int(np.flatnonzero(~finite[a:b])[0]))
        keep.extend(sorted(idx))
    k = np.array(keep, dtype=np.int64)
    return x[k], y[k]


def bucket_max(values: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduce the columns of a ``[rows, cols]`` matrix to at most ``max_columns`` by max.

    Returns:
        ``(first, last, reduced)``: the first and last column index of each
        bucket, and the ``[rows, buckets]`` maxima (NaN where a bucket holds
        only NaN for that row).
    """
    values = np.asarray(values, dtype=np.float64)
    cols = values.shape[1]
    if cols == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, values.copy()
    edges = bucket_edges(cols, max_columns)
    first, last = edges[:-1], edges[1:] - 1
    if first.size == cols:
        return first, last, values.copy()
    # fmax ignores NaN; a bucket that is all NaN stays NaN.
    return first, last, np.fmax.reduceat(values, first, axis=1)
