"""Several runs in one report: where they part, by how much, and which settings differ.

:func:`comparison` adds to the overlaid page data (:mod:`stepdump.analysis.report_overlay`):

* ``divergence``: for each run after the first, :func:`stepdump.analysis.diff.diff` of the first
  run against it: the first divergent step, its earliest cause and the diff's one-line reading
  (or why the runs could not be compared). The page marks that step on every chart.
* per scalar chart, ``diff``: A − B and the relative error |A − B| / max(|A|, |B|) at the steps
  both runs logged, computed on the full series and then downsampled (min/max per bucket).
* ``norm_diff``: per run after the first, the relative error of each tensor's gradient and
  weight L2 norm against the first run's, as tensors x steps heatmaps (0: equal norms).
* ``run_table``: the settings of every run side by side (optimizer hyperparameters, the lr at
  the first step, the user's metadata such as batch size and seed, torch build, CPU capability
  and BLAS, recorder options), with ``differs`` set on the rows whose values are not all equal.

Everything here only reads the runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from stepdump.analysis.downsample import minmax_downsample
from stepdump.analysis.matrices import StatMatrix, scalar_series
from stepdump.errors import CorruptDataError, StepdumpError
from stepdump.read.reader import RunReader

log = logging.getLogger(__name__)

#: Recorded settings (catalog meta) shown in the run table, in this order.
META_ROWS = ("model_class", "optimizer_class", "scheduler_class", "scaler", "torch_version", "python_version",
             "stepdump_version", "cpu_capability", "blas", "num_threads", "device", "host", "capture", "every",
             "stats_every", "keyframe_every", "gradient_log", "codec", "format_version")


def comparison(runs: Sequence[RunReader], page: dict[str, Any], max_points: int,
               *, diff_runs: bool = True) -> dict[str, Any]:
    """``page`` (combined data of ``runs``) with the comparison added (see the module docstring)."""
    from stepdump.analysis.report import stores_of

    page["run_table"] = run_table(runs)
    if len(runs) < 2:
        page["divergence"], page["norm_diff"] = [], []
        return page
    page["divergence"] = [divergence(runs[0], r, i) for i, r in enumerate(runs) if i] if diff_runs else []
    raws = []
    for r in runs:
        raw: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for prefix, store in stores_of(r):
            raw.update({prefix + k: v for k, v in scalar_series(store).items()})
        raws.append(raw)
    for chart in page["scalars"]:
        chart["diff"] = _scalar_diffs(chart, raws, max_points)
    out = []
    for i in range(1, len(runs)):
        for kind, what in (("grads", "gradient L2 norm"), ("params", "weight L2 norm")):
            hm = norm_diff(runs[0], runs[i], kind, max_points, f"relative difference of {what}")
            if hm is not None:
                out.append({"run": i, "kind": kind, "heatmap": hm})
    page["norm_diff"] = out
    return page


def divergence(a: RunReader, b: RunReader, run: int) -> dict[str, Any]:
    """What ``stepdump.diff(a, b)`` says about where they part, for the page."""
    from stepdump.analysis.diff import diff

    try:
        res = diff(a, b)
    except StepdumpError as e:
        return {"run": run, "step": None, "error": str(e), "headline": f"not compared: {e}"}
    cause = res.cause
    return {
        "run": run,
        "step": res.first_step,
        "identical": res.identical,
        "comparable": res.comparable,
        "headline": res.headline(),
        "reading": res.reading,
        "cause": cause.describe() if cause is not None else None,
        "tensor_step": res.first_tensor_step,
        "rank": res.rank,
    }


def _scalar_diffs(chart: dict[str, Any], raws: list[dict[str, tuple[np.ndarray, np.ndarray]]],
                  max_points: int) -> list[dict[str, Any]]:
    base = next((s for s in chart["series"] if s["run"] == 0), None)
    if base is None or base["name"] not in raws[0]:
        return []
    sa, va = raws[0][base["name"]]
    out = []
    for s in chart["series"]:
        if s["run"] == 0 or s["name"] not in raws[s["run"]]:
            continue
        sb, vb = raws[s["run"]][s["name"]]
        got = scalar_difference(sa, va, sb, vb)
        if got is None:
            continue
        steps, d, rel, first = got
        dx, dy = minmax_downsample(steps, d, max_points)
        rx, ry = minmax_downsample(steps, rel, max_points)
        out.append({"run": s["run"], "x": _ints(dx), "y": _floats(dy), "rx": _ints(rx), "ry": _floats(ry),
                    "first_differs": first, "common": int(steps.size)})
    return out


def scalar_difference(sa: np.ndarray, va: np.ndarray, sb: np.ndarray,
                      vb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None] | None:
    """A − B and |A − B| / max(|A|, |B|) of one scalar of two runs (steps ``sa``/``sb``, values
    ``va``/``vb``) at the steps both logged: ``(steps, a_minus_b, relative, first step where they
    differ)``, or None when no step is common. Both 0: relative 0; NaN in both: NaN, but not a
    difference. Also what the TensorBoard export writes (``render/tensorboard_compare``)."""
    steps, ia, ib = np.intersect1d(sa, sb, assume_unique=False, return_indices=True)
    if not steps.size:
        return None
    a, b = va[ia], vb[ib]
    with np.errstate(all="ignore"):
        d = a - b
        scale = np.maximum(np.abs(a), np.abs(b))
        rel = np.where(scale > 0, np.abs(d) / scale, np.where(d == 0, 0.0, np.nan))
    differ = steps[~(a == b) & ~(np.isnan(a) & np.isnan(b))]
    return steps, d, rel, int(differ[0]) if differ.size else None


def norm_diff(a: RunReader, b: RunReader, kind: str, max_points: int, label: str,
              *, in_sql: bool | None = None) -> dict[str, Any] | None:
    """The ``norm_diff`` heatmap of ``kind`` between runs ``a`` and ``b`` (None: nothing in common).

    Two single-store runs sharing more than ``max_points`` steps are compared inside SQLite
    (:func:`~stepdump.store.queries_scale.norm_diff_buckets`: the second catalog attached to the
    first, tensors x buckets rows come back); the values are those of reading every norm and taking
    each bucket's maximum (:func:`_norm_diff`). ``in_sql``: True forces the catalog path, False the
    reading of every norm; None picks. Multi-rank runs, and a catalog that cannot be attached, are
    read in full.
    """
    from stepdump.analysis.report import stacked_norms, stores_of

    sa, sb = stores_of(a), stores_of(b)
    if in_sql is not False and len(sa) == 1 and len(sb) == 1 and not sa[0][0] and not sb[0][0]:
        try:
            got = _norm_diff_sql(sa[0][1], sb[0][1], kind, max_points, label, force=bool(in_sql))
        except StepdumpError as e:  # e.g. the second catalog is only readable as an immutable snapshot
            log.info("report: %s compared in Python, the catalogs could not be joined: %s", kind, e)
        else:
            if got is not _IN_PYTHON:
                return got  # type: ignore[return-value]
    return _norm_diff(stacked_norms(a, kind), stacked_norms(b, kind), max_points, label)


_IN_PYTHON = object()  # _norm_diff_sql: few enough common steps to read them all
_NORM_NOTE = ("|‖A‖ − ‖B‖| / max(‖A‖, ‖B‖) per tensor and step; black: equal norms. Norms can agree "
              "while tensors differ: stepdump diff compares the tensors bit for bit.")


def _norm_diff_sql(a: Any, b: Any, kind: str, max_points: int, label: str, *, force: bool) -> object:
    from stepdump.analysis.report_heatmaps import heatmap_data
    from stepdump.analysis.scalar_charts import edge_moves
    from stepdump.store import queries_scale as q

    names_b = {str(n) for _, _, n in b.catalog.matching_series(kind, None)}
    names = [str(n) for _, _, n in a.catalog.matching_series(kind, None) if str(n) in names_b]
    if not names:
        return None
    with q.attached(a.catalog, b.catalog):
        common = q.common_step_count(a.catalog, kind)
        if not common:
            return None
        if common <= max_points and not force:
            return _IN_PYTHON
        buckets = max(1, min(common, max_points))
        later, earlier = edge_moves(common, buckets)
        rows, ranges = q.norm_diff_buckets(a.catalog, kind, common, buckets, later, earlier)
    at = {n: i for i, n in enumerate(names)}
    values = np.full((len(names), buckets), np.nan)
    try:
        for name, col, v in rows:
            values[at[str(name)], int(col)] = np.nan if v is None else float(v)
        span = np.array([r[1:] for r in ranges], dtype=np.int64).reshape(-1, 2)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise CorruptDataError(f"the norms in the catalogs of {a.path} and {b.path} are not all numbers ({e!r}): "
                               "a catalog is damaged (`stepdump verify` checks a run)") from e
    return heatmap_data(StatMatrix(names, span[:, 0], values, ends=span[:, 1], count=common), max_points, label,
                        _NORM_NOTE)


def _norm_diff(a: StatMatrix, b: StatMatrix, max_points: int, label: str) -> dict[str, Any] | None:
    from stepdump.analysis.report_heatmaps import heatmap_data

    names = [n for n in a.names if n in set(b.names)]
    steps = np.intersect1d(a.steps, b.steps)
    if not names or not steps.size:
        return None
    ra = a.values[[a.names.index(n) for n in names]][:, np.searchsorted(a.steps, steps)]
    rb = b.values[[b.names.index(n) for n in names]][:, np.searchsorted(b.steps, steps)]
    with np.errstate(all="ignore"):
        scale = np.maximum(np.abs(ra), np.abs(rb))
        rel = np.where(scale > 0, np.abs(ra - rb) / scale, np.where(ra == rb, 0.0, np.nan))
    return heatmap_data(StatMatrix(names, steps, rel), max_points, label, _NORM_NOTE)


# -- the run table ---------------------------------------------------------------------------
def run_table(runs: Sequence[RunReader]) -> list[dict[str, Any]]:
    """Rows ``{"key", "values": [one text per run], "differs"}`` of the settings of ``runs``."""
    cols = [_settings(r) for r in runs]
    keys: list[str] = []
    for c in cols:
        keys += [k for k in c if k not in keys]
    rows = []
    for k in keys:
        vals = [c.get(k, "—") for c in cols]
        rows.append({"key": k, "values": vals, "differs": len(set(vals)) > 1})
    return rows


def _settings(run: RunReader) -> dict[str, str]:
    meta = run.meta
    out: dict[str, str] = {}
    steps = run.all_steps
    out["steps recorded"] = f"{len(steps)} ({steps[0]}–{steps[-1]})" if steps else "0"
    from stepdump.store.queries_scale import scalar_ends

    lr = scalar_ends(next(iter(run.stores()))[1].catalog, "lr")  # two rows, however long the run
    if len(lr) == 2:  # first and last: a schedule or a change mid-run shows here
        first, last = (float("nan") if v is None else float(v) for v in lr)
        out["lr (first, last)"] = f"{_text(first)}, {_text(last)}"
    for g, group in enumerate(_groups(run)):
        for k, v in (group.get("hyper") or {}).items():
            out[f"param group {g} {k}"] = _text(v)
    user = meta.get("user")
    if isinstance(user, dict):
        for k, v in user.items():
            out[f"metadata {k}"] = _text(v)
    for k in META_ROWS:
        if k in meta:
            out[k] = _text(meta[k])
    return out


def _groups(run: RunReader) -> list[dict[str, Any]]:
    """The param groups' hyperparameters at the first full step ([] when none is stored)."""
    full = run.steps
    if not full:
        return []
    try:
        groups = run.step_state(full[0]).get("groups")
    except StepdumpError as e:  # a damaged state leaves the rows out; the table says what it has
        log.info("report: no hyperparameters from step %d of %s: %s", full[0], run.path, e)
        return []
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v, default=str, separators=(", ", ": "))
    except (TypeError, ValueError):
        return str(v)


def _floats(a: Any) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, dtype=np.float64).tolist()]


def _ints(a: Any) -> list[int]:
    return [int(v) for v in np.asarray(a).tolist()]
