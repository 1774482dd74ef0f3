"""The report's ranks summary for a multi-rank run: one row per rank, and the outlier ranks.

Per rank: how many steps it recorded (and its last), its last logged loss, its last total gradient
norm, and how far that norm strays from the ranks' median (the largest relative deviation over
the steps every rank has, and where). Which ranks are *outliers* is not decided here: it is what
the run's own detectors say (no second detector):

* ``cross_rank`` (:meth:`stepdump.analysis.cross_rank.CrossRank.apart`): the ranks whose replicas
  hold other bytes than the largest group of agreeing ranks, at the first step where they part;
* the per-rank checks (:func:`stepdump.analysis.multirank.check_distributed`): findings that only
  some ranks raised (a loss spike, an exploding gradient on one rank), :func:`finding_ranks`.

Only reads the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from stepdump.analysis.cross_rank import CrossRank
from stepdump.analysis.findings import Finding
from stepdump.analysis.matrices import combined_norm, scalar_series
from stepdump.analysis.multirank import finding_ranks
from stepdump.read.reader import RunReader, ranked_stores

#: The scalar whose last value the summary shows.
LOSS = "loss"


def ranks_summary(run: RunReader, findings: Sequence[Finding]) -> dict[str, Any] | None:
    """The ranks table and outliers of a multi-rank ``run`` (None for a run of one store).

    Returns:
        ``{"rows": [{"rank", "steps", "last_step", "loss_last", "grad_norm_last",
        "grad_dev", "grad_dev_step", "outlier", "why"}], "outliers": [rank, ...],
        "split": cross_rank's first divergent step or None, "common_steps": int,
        "grad_spread": (max - min) / median of the ranks' total grad norm at the last common step}``.
    """
    stores = ranked_stores(run)
    if len(stores) < 2:
        return None
    ranks = [r for r, _ in stores]
    norms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    rows: list[dict[str, Any]] = []
    for r, store in stores:
        steps = store.all_steps
        loss = scalar_series(store).get(LOSS)
        last_loss = None
        if loss is not None:
            finite = np.isfinite(loss[1])
            last_loss = float(loss[1][finite][-1]) if finite.any() else float("nan")
        g_steps, g, n = combined_norm(store, "grads", "*") if "grads" in store.kinds() else (np.zeros(0, np.int64), np.zeros(0), 0)
        norms[r] = (g_steps, g)
        rows.append({"rank": r, "steps": len(steps), "last_step": steps[-1] if steps else None, "loss_last": last_loss,
                     "grad_norm_last": float(g[-1]) if g.size else None, "grad_dev": None, "grad_dev_step": None,
                     "outlier": False, "why": []})
    common = _common_steps([s for s, _ in norms.values()])
    spread = None
    if common.size:
        mat = np.stack([g[np.searchsorted(s, common)] for s, g in norms.values()])  # ranks x common steps
        med = np.median(mat, axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            dev = np.abs(mat - med) / med
        dev[~np.isfinite(dev)] = np.nan
        for row, d in zip(rows, dev):
            if np.isfinite(d).any():
                k = int(np.nanargmax(d))
                row["grad_dev"], row["grad_dev_step"] = float(d[k]), int(common[k])
        last = mat[:, -1]
        if med[-1] > 0:
            spread = float((last.max() - last.min()) / med[-1])
    by_rank = {row["rank"]: row for row in rows}
    apart = CrossRank().apart(run)
    if apart is not None:
        for r, count in apart["ranks"].items():
            if r in by_rank:
                by_rank[r]["why"].append(f"cross_rank: {count} tensor(s) differ from the other ranks' replicas at "
                                         f"step {apart['step']}")
    for f in findings:
        named = finding_ranks(f)
        if named is None or set(named) >= set(ranks):
            continue  # a finding of the whole run, or of every rank: no rank stands out
        for r in named:
            if r in by_rank:
                by_rank[r]["why"].append(f"{f.rule}" + (f" at step {f.step}" if f.step is not None else ""))
    for row in rows:
        row["outlier"] = bool(row["why"])
    return {"rows": rows, "outliers": [row["rank"] for row in rows if row["outlier"]],
            "split": apart["step"] if apart is not None else None, "common_steps": int(common.size),
            "grad_spread": spread}


def _common_steps(steps: list[np.ndarray]) -> np.ndarray:
    out = steps[0] if steps else np.zeros(0, np.int64)
    for s in steps[1:]:
        out = np.intersect1d(out, s)
    return out.astype(np.int64)


def json_ready(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """``summary`` with non-finite floats as their names (JSON has no NaN)."""
    if summary is None:
        return None
    rows = [{k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            for row in summary["rows"]]
    return dict(summary, rows=rows)
