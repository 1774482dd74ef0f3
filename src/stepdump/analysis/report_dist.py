"""Distributions of a tensor's values over time, for the report's per-tensor view.

Two sources, both what the run already holds:

* **Stats, at every recorded step** (full and lean): min, max, mean and std of every tensor.
  :func:`stat_bands` returns them per tensor over steps; long runs are bucketed for drawing
  (min of the minima, max of the maxima, so the envelope is exact; mean and std are the bucket's
  averages, said in the note). Where lean steps left mean/std unmeasured (large tensors) there is
  no value, never a 0.
* **Stored tensors, at full steps**: :func:`sample_quantiles` reads up to ``max_steps`` full steps
  and takes the 5/25/50/75/95 % quantiles of each tensor: exact for tensors of at most
  ``sample`` elements, else of an evenly strided sample of that many elements (the note says
  which). Reading is bounded by ``budget`` elements in all.

Both only read the run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stepdump.analysis.downsample import bucket_edges
from stepdump.analysis.matrices import StatMatrix, stat_matrices
from stepdump.read.run import Run

log = logging.getLogger(__name__)

#: Quantiles drawn from stored tensors.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
DIST_KINDS = ("params", "grads")
#: The stat columns the bands are drawn from.
BAND_COLUMNS = ("min", "max", "mean", "std")


def stat_bands(store: Run, kind: str, max_points: int,
               cols: Mapping[str, StatMatrix] | None = None) -> dict[str, Any] | None:
    """min/max/mean/std of every ``kind`` tensor over steps, bucketed to ``max_points`` columns.

    ``cols``: those four matrices when the caller has already read them
    (:func:`~stepdump.analysis.matrices.stat_matrices`, one pass with the norms); else read here.

    Returns:
        ``{"names", "x0", "x1", "steps", "min", "max", "mean", "std"}`` with each stat a
        ``[tensors][columns]`` list of floats (None: no value), or None without stats.
    """
    if cols is None:
        cols = stat_matrices(store, kind, BAND_COLUMNS)
    cols = {c: cols[c] for c in BAND_COLUMNS}
    m = cols["min"]
    if m.empty:
        return None
    edges = bucket_edges(m.steps.size, max_points)
    first, last = edges[:-1], edges[1:] - 1
    out: dict[str, Any] = {"names": m.names, "x0": m.steps[first].tolist(), "x1": m.last_steps[last].tolist(),
                           "steps": m.recorded}
    with np.errstate(all="ignore"):
        for c, mat in cols.items():
            v = mat.values
            if first.size == v.shape[1]:
                red = v
            elif c == "min":
                red = np.fmin.reduceat(v, first, axis=1)
            elif c == "max":
                red = np.fmax.reduceat(v, first, axis=1)
            else:  # average of the measured values in the bucket (none measured: no value)
                ok = np.isfinite(v)
                red = np.add.reduceat(np.where(ok, v, 0.0), first, axis=1) / np.add.reduceat(ok.astype(np.float64), first, axis=1)
            out[c] = red
    return out


def sample_quantiles(store: Run, kind: str, max_steps: int = 64, sample: int = 65536,
                     budget: int = 20_000_000) -> dict[str, Any] | None:
    """Quantiles (:data:`QUANTILES`) of every stored ``kind`` tensor at up to ``max_steps`` full steps.

    Returns:
        ``{"names", "steps", "q": [len(QUANTILES)][tensors][steps], "sample", "sampled"}``
        (``sampled``: names of tensors larger than ``sample``, whose quantiles are of a strided
        sample), or None when no full step holds ``kind``.
    """
    if kind not in store.kinds():
        return None
    full = store.steps
    final = store.meta.get("final_step")
    if full and full[-1] == final and not store.fingerprints(final, (kind,)):
        full = full[:-1]  # the final record has no grads (no update ran there): not a column of blanks
    names = store.names(kind)
    if not full or not names or max_steps < 1:
        return None
    per_step = 0
    first: dict[str, torch.Tensor] = {}  # the first full step's tensors: read once, also a column below
    for t in full[:1]:
        first = store.tensors(t, kind)
        per_step = sum(min(int(x.numel()), sample) for x in first.values())
    k = min(len(full), max_steps, budget // max(1, per_step))
    if k < 1:
        log.info("report: quantiles skipped, one step of %s has %d sampled elements (budget %d)", kind, per_step, budget)
        return None
    chosen = sorted({full[i] for i in np.linspace(0, len(full) - 1, k).round().astype(int)})
    q = np.full((len(QUANTILES), len(names), len(chosen)), np.nan)
    sampled: set[str] = set()
    probs = torch.tensor(QUANTILES, dtype=torch.float64)
    for j, t in enumerate(chosen):
        tensors = first if t == full[0] else store.tensors(t, kind)
        for i, name in enumerate(names):
            x = tensors.get(name)
            if x is None or x.is_sparse or not (x.is_floating_point() or x.is_complex()) or x.numel() == 0:
                continue
            flat = x.detach().reshape(-1)
            if flat.is_complex():
                flat = flat.abs()
            if flat.numel() > sample:
                flat = flat[:: -(-flat.numel() // sample)]
                sampled.add(name)
            flat = flat.double()
            flat = flat[torch.isfinite(flat)]
            if flat.numel():
                q[:, i, j] = torch.quantile(flat, probs).numpy()
    return {"names": names, "steps": chosen, "q": q, "sample": sample, "sampled": sorted(sampled)}
