"""The data behind ``stepdump report``: a pure function from a Run to JSON-able dicts.

:func:`build_report_data` reads the run (stats, scalars, and for exact update
ratios a bounded number of full steps) and returns plain lists and numbers that
``stepdump.render.html`` draws. Long series are downsampled *for drawing only*
(see :mod:`stepdump.analysis.downsample`): lines keep each bucket's minimum and
maximum point, heatmaps and counts keep each bucket's maximum, so spikes
survive. The run is only read, never changed.

A multi-rank run is reported over every rank's store: its heatmap rows,
scalar curves and moment lines are named ``rank<r>/...``, its NaN/Inf counts
summed over ranks, and its findings are ``stepdump.check``'s over every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from stepdump.analysis import rank_pool
from stepdump.analysis.downsample import bucket_max, minmax_downsample
from stepdump.analysis.findings import Finding
from stepdump.analysis.matrices import (
    StatMatrix,
    bucketed_matrices,
    combined_norm,
    nonfinite_counts,
    stat_matrices,
    stat_matrix,
)
from stepdump.analysis.report_dist import BAND_COLUMNS, DIST_KINDS, QUANTILES, sample_quantiles, stat_bands
from stepdump.analysis.report_groups import tensor_groups
from stepdump.analysis.report_heatmaps import floats as _floats
from stepdump.analysis.report_heatmaps import PerStore, heatmap, stack, update_ratio
from stepdump.analysis.report_heatmaps import ints as _ints
from stepdump.analysis.report_ranks import json_ready, ranks_summary
from stepdump.analysis.report_scalars import scalar_order
from stepdump.analysis.scalar_charts import scalar_charts
from stepdump.errors import ConfigError, StepdumpError
from stepdump.read.joint import is_joint
from stepdump.read.activations import reexecutions
from stepdump.read.reader import RunReader, ranked_stores
from stepdump.read.run import Run

log = logging.getLogger(__name__)

#: Optimizer state keys whose norms the report plots (Adam(W), SGD momentum, ...).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum")

REPORT_DATA_VERSION = 1


def build_report_data(
    run: RunReader,
    findings: Sequence[Finding] | None = None,
    max_points: int = 2000,
    *,
    exact_steps: int = 256,
    exact_budget: int = 50_000_000,
    dist_points: int = 256,
    quantile_steps: int = 64,
) -> dict[str, Any]:
    """Everything a report shows, as JSON-able data.

    Args:
        run: The run to report on.
        findings: Check findings to mark; None runs ``stepdump.check(run)``
            when that exists, else reports none.
        max_points: Most points per drawn series (and columns per heatmap).
            Downsampling keeps each bucket's extremes, see module docstring.
        exact_steps: Most steps at which exact update/weight ratios are computed
            from full tensors (consecutive full steps t, t+1 are needed).
        exact_budget: Most tensor elements read for exact ratios; beyond it the
            report falls back to the stats-based lower bound.
        dist_points: Most columns of each tensor's min/max/mean/std bands (the
            distribution view; :mod:`stepdump.analysis.report_dist`).
        quantile_steps: Most full steps whose stored tensors give sample quantiles (0: none).

    Returns:
        A dict with keys ``summary``, ``domain``, ``scalars``, ``grad_norms``,
        ``param_norms``, ``update_ratio``, ``moments``, ``nonfinite``, ``findings``,
        ``checks``, ``times`` (step -> commit time), ``groups`` (tensors by block and kind,
        :mod:`stepdump.analysis.report_groups`) and ``dist`` (value distributions over time). A scalar entry stands for every name logged with the same values
        (``aliases``, ``shifted``: :mod:`stepdump.analysis.report_scalars`). Several runs:
        :func:`stepdump.analysis.report_overlay.build_overlay_data`.
    """
    if max_points < 10:
        raise ConfigError(f"max_points={max_points} is too small to draw; give at least 10")
    found, checks = _resolve_findings(run, findings)
    all_steps = run.all_steps
    domain = [all_steps[0], all_steps[-1]] if all_steps else [0, 0]
    stores = _stores(run)
    per_store = _per_store(run, stores)
    kinds = {k for _, store in stores for k in store.kinds()}
    # Each kind's norms (heatmaps, update ratio) and band columns (distributions) in one pass per store;
    # a run with more stats steps than max_points is bucketed inside the catalog (bucketed_matrices).
    tables = {kind: [(prefix, _kind_matrices(store, kind, max_points)) for prefix, store in stores]
              for kind in DIST_KINDS if kind in kinds}
    params = stack([(p, t["norm"]) for p, t in tables["params"]]) if "params" in tables else None
    change = stack([(p, t["norm_change"]) for p, t in tables["params"]]) \
        if "params" in tables and all("norm_change" in t for _, t in tables["params"]) else None
    grads = stack([(p, t["norm"]) for p, t in tables["grads"]]) if "grads" in tables else None
    bad = {k: stack([(p, t["nonfinite"]) for p, t in tables[k]]) for k in ("params", "grads") if k in tables}
    return {
        "version": REPORT_DATA_VERSION,
        "summary": summarize(run),
        "domain": domain,
        "max_points": max_points,
        "scalars": _scalars(stores, max_points),
        "grad_norms": heatmap(grads, max_points, "grad L2 norm", bad=bad.get("grads")) if grads is not None else None,
        "param_norms": heatmap(params, max_points, "weight L2 norm", bad=bad.get("params")) if params is not None else None,
        "update_ratio": update_ratio(stores, params, max_points, exact_steps, exact_budget, change, per_store=per_store),
        "moments": _moments(stores, max_points) if "optimizer" in kinds else [],
        "nonfinite": _nonfinite(run, stores, max_points),
        "findings": [_finding_dict(f) for f in found],
        "checks": checks,
        "times": _times(stores),
        "groups": tensor_groups(_all_names(stores), _embeddings(stores)),
        "dist": _dist(stores, tables, dist_points, quantile_steps, per_store),
        "ranks": json_ready(ranks_summary(run, found)),
        "reexecutions": reexecution_rows(run),
    }


def _kind_matrices(store: Run, kind: str, max_points: int) -> dict[str, StatMatrix]:
    """norm and band columns of ``kind``: bucketed in the catalog for a long run, else exact; and
    ``nonfinite``: per tensor and column, the steps with a NaN/±Inf element (exact: 0 or 1)."""
    bucketed = bucketed_matrices(store, kind, max_points)
    if bucketed is not None:
        return bucketed
    m = stat_matrices(store, kind, ("norm", *BAND_COLUMNS, *_NONFINITE_COLUMNS))
    counts = sum(np.nan_to_num(m[c].values) for c in _NONFINITE_COLUMNS)
    m["nonfinite"] = StatMatrix(m["norm"].names, m["norm"].steps, (counts > 0).astype(np.float64))
    return m


_NONFINITE_COLUMNS = ("nan", "posinf", "neginf")


def stores_of(run: RunReader) -> list[tuple[str, Run]]:
    """(label prefix, store) of each store of ``run``: ``("", run)`` or ``("rank<r>/", store)``."""
    return _stores(run)


def stacked_norms(run: RunReader, kind: str) -> StatMatrix:
    """The L2 norms of every ``kind`` tensor of ``run`` over steps (rows of ranks prefixed)."""
    return _stacked(_stores(run), kind)


def _all_names(stores: list[tuple[str, Run]]) -> list[str]:
    seen: dict[str, None] = {}
    for prefix, store in stores:
        for kind in ("params", "grads"):
            if kind in store.kinds():
                seen.update((prefix + n, None) for n in store.names(kind))
    return list(seen)


def _embeddings(stores: list[tuple[str, Run]]) -> list[str]:
    out = []
    for prefix, store in stores:
        layout = store.meta.get("layout")
        emb = layout.get("embeddings") if isinstance(layout, dict) else None
        out += [prefix + str(n) for n in emb or []]
    return out


def _times(stores: list[tuple[str, Run]], max_points: int = 2000) -> dict[str, Any] | None:
    """When each step was committed (the catalog's step time), evenly thinned to ``max_points``:
    what the page's wall-clock and relative-time axes map steps through. Rank 0 for several ranks."""
    try:
        rows = stores[0][1].catalog.step_times()
    except StepdumpError as e:  # times are for the axis only; without them the page offers steps
        log.info("report: no step times: %s", e)
        return None
    pairs = sorted((s, float(t)) for s, t in rows
                   if isinstance(s, int) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t))
    if not pairs:
        return None
    idx = np.unique(np.linspace(0, len(pairs) - 1, min(len(pairs), max_points)).round().astype(int))
    t = np.maximum.accumulate(np.array([pairs[i][1] for i in idx]))  # the axis needs time not going back
    return {"s": [pairs[i][0] for i in idx], "t": [round(float(v), 3) for v in t]}


def _per_store(run: RunReader, stores: list[tuple[str, Run]]) -> PerStore:
    """``per_store(fn, *args)``: ``fn(store, *args)`` of each of ``stores`` (what :func:`_stores`
    lists), in their order; for a run of many ranks, done by worker processes
    (:func:`~stepdump.analysis.rank_pool.map_ranks`: a rank's tensors read and reduced there)."""
    def here(fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(store, *args) for _, store in stores]

    if is_joint(run) or rank_pool.workers(run) < 2:
        return here
    ranks = [r for r, _ in ranked_stores(run)]  # the order of stores
    if len(ranks) != len(stores):
        return here

    def forked(fn: Callable[..., Any], *args: Any) -> list[Any]:
        done = dict(rank_pool.map_ranks(run, fn, *args))
        return [done[r] for r in ranks]

    return forked


def _dist(stores: list[tuple[str, Run]], tables: dict[str, list[tuple[str, dict[str, StatMatrix]]]],
          points: int, q_steps: int, per_store: PerStore | None = None) -> dict[str, Any]:
    """Per kind (params, grads): stats bands of every tensor and sample quantiles at full steps.
    ``tables``: each kind's stat matrices per store, as :func:`build_report_data` read them."""
    out: dict[str, Any] = {}
    for kind in DIST_KINDS:
        if kind not in tables:
            continue
        bands = [(prefix, stat_bands(store, kind, points, cols))
                 for (prefix, store), (_, cols) in zip(stores, tables[kind])]
        found = (per_store or _here(stores))(sample_quantiles, kind, q_steps) if q_steps else [None] * len(stores)
        quants = [(prefix, q) for (prefix, _), q in zip(stores, found, strict=True)]
        entry: dict[str, Any] = {"bands": [], "quantiles": [], "probs": list(QUANTILES)}
        for prefix, b in bands:
            if b is not None:
                entry["bands"].append({"names": [prefix + n for n in b["names"]], "x0": b["x0"], "x1": b["x1"],
                                       "steps": b["steps"], **{c: [_floats(r) for r in b[c]] for c in
                                                               ("min", "max", "mean", "std")}})
        for prefix, q in quants:
            if q is not None:
                entry["quantiles"].append({"names": [prefix + n for n in q["names"]], "steps": q["steps"],
                                           "q": [[_floats(r) for r in level] for level in q["q"]],
                                           "sample": q["sample"], "sampled": [prefix + n for n in q["sampled"]]})
        out[kind] = entry
    return out


def _here(stores: list[tuple[str, Run]]) -> PerStore:
    return lambda fn, *args: [fn(store, *args) for _, store in stores]


def _stores(run: RunReader) -> list[tuple[str, Run]]:
    """(label prefix, store) of each store: ``("", run)`` for one store, ``("rank<r>/", rank's store)``,
    ``("<pair>/", pair's store)`` for a joint run."""
    if is_joint(run):
        return [(f"{pair}/", store) for pair, store in run.pair_stores()]
    return [("" if r is None else f"rank{r}/", store) for r, store in run.stores()]


def _stacked(stores: list[tuple[str, Run]], kind: str) -> StatMatrix:
    """The norms of every store's ``kind`` tensors in one matrix: rows named with each store's
    prefix, columns the union of their steps (NaN where a store has no row)."""
    return stack([(prefix, stat_matrix(store, kind)) for prefix, store in stores])


def _disk_bytes(run: RunReader) -> int:
    """Bytes of the run's files; for a URL (nothing local to walk) the stored tensor bytes."""
    if isinstance(run.path, str):
        return run.blob_bytes()[0]
    return sum(p.stat().st_size for p in run.path.rglob("*") if p.is_file())


def summarize(run: RunReader) -> dict[str, Any]:
    """The run's identity and size: what the report's summary table shows."""
    meta = run.meta
    steps, skipped = run.all_steps, run.skipped_steps
    tensors = {k: len(run.names(k)) for k in run.kinds()}
    created = meta.get("created")
    return {
        "path": str(run.path),
        "model_class": meta.get("model_class"),
        "optimizer_class": meta.get("optimizer_class"),
        "scheduler_class": meta.get("scheduler_class"),
        "steps_recorded": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "full_steps": len(run.steps),
        "stats_steps": len(run.stats_steps),
        "skipped_steps": len(skipped),
        "skipped_list": skipped[:200],
        "bytes": _disk_bytes(run),
        "ranks": [r for r, _ in ranked_stores(run)] or None,
        "tensors": tensors,
        "tensors_total": sum(tensors.values()),
        "created": _iso(created) if isinstance(created, (int, float)) else created,
        "stepdump_version": meta.get("stepdump_version"),
        "torch_version": meta.get("torch_version"),
        "python_version": meta.get("python_version"),
        "format_version": run.format_version,
        "codec": meta.get("codec"),
        "capture": meta.get("capture"),
        "every": meta.get("every"),
        "stats_every": meta.get("stats_every"),
        "live": run.live,
    }


# -- sections -------------------------------------------------------------------
def _scalars(stores: list[tuple[str, Run]], max_points: int) -> list[dict[str, Any]]:
    """One chart per group of equal series (:mod:`stepdump.analysis.report_scalars`); ranks side by side."""
    out: list[tuple[Any, dict[str, Any]]] = []
    for prefix, store in stores:
        # a series longer than max_points is shrunk inside the catalog (same points as in Python)
        for chart in scalar_charts(store, max_points):
            g, x, y = chart.group, chart.x, chart.y
            out.append(((scalar_order(g.name), prefix), {
                "name": prefix + g.name,
                "aliases": [prefix + n for n in g.aliases],
                "shifted": [prefix + n for n in g.shifted],
                "title": g.title(prefix),
                "note": g.note,
                "x": _ints(x),
                "y": _floats(y),
                "points": chart.points,
                "nonfinite_steps": _ints(chart.nonfinite_steps),
                "log": chart.log,
            }))
    # loss first, then learning rates, then the rest alphabetically; ranks side by side
    return [d for _, d in sorted(out, key=lambda kd: kd[0])]


def _moments(stores: list[tuple[str, Run]], max_points: int) -> list[dict[str, Any]]:
    out = []
    for key in MOMENT_KEYS:
        for prefix, store in stores:
            steps, norms, n = combined_norm(store, "optimizer", f"*.{key}")
            if not n or not steps.size:
                continue
            x, y = minmax_downsample(steps, norms, max_points)
            out.append({"key": prefix + key, "tensors": n, "x": _ints(x), "y": _floats(y), "log": True,
                        "label": f"‖{prefix}{key}‖ over {n} tensors"})
    return out


def _nonfinite(run: RunReader, stores: list[tuple[str, Run]], max_points: int) -> dict[str, Any]:
    per_store = [nonfinite_counts(store) for _, store in stores]
    steps = np.unique(np.concatenate([s for s, _ in per_store]))
    counts = np.zeros(steps.size, dtype=np.int64)
    for s, c in per_store:  # summed over ranks: tensors with NaN/Inf on any rank
        np.add.at(counts, np.searchsorted(steps, s), c)
    all_steps = np.array(run.all_steps, dtype=np.int64)
    skipped = np.isin(all_steps, np.array(run.skipped_steps, dtype=np.int64)).astype(np.float64)
    first, last, reduced = bucket_max(counts[None, :].astype(np.float64), max_points)
    sf, sl, sk = bucket_max(skipped[None, :], max_points)
    return {
        "x0": _ints(steps[first]),
        "x1": _ints(steps[last]),
        "count": _floats(reduced[0]),
        "steps_with_nonfinite": int((counts > 0).sum()),
        "max_count": int(counts.max()) if counts.size else 0,
        "skipped_x0": [int(all_steps[a]) for a, v in zip(sf, sk[0]) if v > 0],
        "skipped_x1": [int(all_steps[b]) for b, v in zip(sl, sk[0]) if v > 0],
    }


def reexecution_rows(run: RunReader) -> list[dict[str, Any]]:
    """The verdicts of re-executions written back into the run (docs/reexecute.md), one per step."""
    rows = []
    for step, mark in reexecutions(run).items():
        if isinstance(mark, dict):
            first = mark.get("first")
            nan = mark.get("nan_op")
            rows.append({"step": step, "verdict": str(mark.get("verdict", "?")), "cause": mark.get("cause") or "",
                         "first": " ".join(map(str, first)) if isinstance(first, list) else "",
                         "nan_op": nan.get("where") if isinstance(nan, dict) else "",
                         "captured": sum(len(v) for v in (mark.get("captured") or {}).values()
                                         if isinstance(v, list))})
    return rows


# -- findings -------------------------------------------------------------------
def _resolve_findings(run: RunReader, findings: Sequence[Finding] | None) -> tuple[list[Finding], str]:
    if findings is not None:
        return list(findings), "given"
    # Imported here: the rules that checks loads are not needed when findings are given.
    from stepdump.analysis.checks import check

    return list(check(run)), "ran"


def _finding_dict(f: Finding) -> dict[str, Any]:
    d = f.to_dict() if hasattr(f, "to_dict") else dict(vars(f))
    for k in ("value", "threshold"):
        v = d.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = repr(v)  # "nan", "inf": JSON has no NaN
    if "severity" in d and not isinstance(d["severity"], str):
        d["severity"] = getattr(d["severity"], "name", str(d["severity"])).lower()
    return d


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds")
