"""The points each scalar chart draws, shrunk inside SQLite when a series is longer than the budget.

The report draws at most ``max_points`` points per series (:func:`~stepdump.analysis.downsample.minmax_downsample`:
per bucket the first minimum, the first maximum and the first NaN/Inf, so spikes and NaNs survive).
Reading every scalar row of a 100k-step run into Python to keep two thousand of them is what
:func:`scalar_charts` avoids: when any series is longer than the budget, the catalog does the
work (:mod:`stepdump.store.queries_scale`) and hands back the kept points, per-name counts, the
middle values for the log-axis choice, and the duplicate test (:func:`~stepdump.analysis.report_scalars.fold_groups`)
as one count per pair of names. Both paths give the same charts, point for point
(tests/test_scale_reads.py), so which one ran is invisible on the page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stepdump.analysis.downsample import bucket_edges, minmax_downsample
from stepdump.analysis.report_scalars import LOG_SPAN, LOG_SPIKE, ScalarGroup, fold_groups, group_scalars, wants_log
from stepdump.errors import CorruptDataError
from stepdump.store import queries_scale as q


@dataclass
class ScalarChart:
    """One scalar chart: its group (names drawn together) and the points drawn."""

    group: ScalarGroup
    x: np.ndarray  # steps drawn (int64)
    y: np.ndarray  # values drawn (float64, NaN for a logged NaN)
    points: int  # points the series has
    nonfinite_steps: np.ndarray  # the first ``max_points`` steps logged NaN/±Inf
    log: bool  # a log axis by default (:func:`wants_log` of the whole series)


def scalar_charts(run: Any, max_points: int, *, in_sql: bool | None = None) -> list[ScalarChart]:
    """Every scalar chart of ``run`` (a single store), in chart order.

    ``in_sql``: True shrinks the series in SQLite, False reads every row (the reference path);
    None (the default) picks SQLite when some series has more than ``max_points`` rows.
    """
    summary = {str(r.name): r for r in q.scalar_summary(run.catalog)}
    if in_sql is None:
        in_sql = any(int(r.rows) > max_points for r in summary.values())
    if not in_sql:
        return _python_charts(run, max_points)
    return _sql_charts(run, summary, max_points)


def _python_charts(run: Any, max_points: int) -> list[ScalarChart]:
    from stepdump.analysis.matrices import scalar_series

    series = scalar_series(run)
    out = []
    for g in group_scalars(series):
        steps, values = series[g.name]
        x, y = minmax_downsample(steps, values, max_points)
        out.append(ScalarChart(g, x, y, int(steps.size), steps[~np.isfinite(values)][:max_points], wants_log(values)))
    return out


def _sql_charts(run: Any, summary: dict[str, q.ScalarSummary], max_points: int) -> list[ScalarChart]:
    cat = run.catalog
    sizes = {n: int(r.rows) for n, r in summary.items()}

    def same_at(a: str, b: str, shift: int) -> bool:
        considered, differ = q.scalar_same_at(cat, a, b, shift)
        if considered == 0 or (shift and considered < 2):  # one coincidence is no shifted copy
            return False
        return differ == 0

    medians: dict[str, list[float]] = {}
    for name, value in q.scalar_median_rows(cat):
        medians.setdefault(str(name), []).append(_number(run, value))
    out = []
    for g in fold_groups(sizes, same_at):
        row = summary[g.name]
        n, bad = int(row.rows), int(row.nonfinite or 0)
        if n <= max_points:
            pts = np.array(q.scalar_rows_of(cat, g.name), dtype=object).reshape(-1, 2)
        else:
            per_bucket = 2 if bad == 0 else 3
            buckets = max(1, min(n, max_points // per_bucket))
            later, earlier = edge_moves(n, buckets)
            pts = np.array([(step, value) for _index, step, value in
                            q.scalar_minmax_buckets(cat, g.name, n, buckets, later, earlier)],
                           dtype=object).reshape(-1, 2)
        x, y = _arrays(run, pts)
        nonfinite = np.array(q.scalar_nonfinite_steps(cat, g.name, max_points), dtype=np.int64) if bad else \
            np.zeros(0, dtype=np.int64)
        out.append(ScalarChart(g, x, y, n, nonfinite, _wants_log(row, medians.get(g.name, []))))
    return out


def edge_moves(n: int, buckets: int) -> tuple[list[int], list[int]]:
    """Indices whose bucket by :func:`bucket_edges` (float edges) is one after (``later``) or one
    before (``earlier``) their bucket by exact integer edges ``k * n // buckets`` (the SQL's)."""
    edges = bucket_edges(n, buckets)
    exact = np.arange(edges.size, dtype=np.int64) * n // (edges.size - 1)
    later: list[int] = []
    earlier: list[int] = []
    for f, e in zip(edges[1:-1].tolist(), exact[1:-1].tolist()):
        if f < e:
            later.extend(range(f, e))
        elif f > e:
            earlier.extend(range(e, f))
    return later, earlier


def _wants_log(row: q.ScalarSummary, middle: list[float]) -> bool:
    """:func:`wants_log` from the catalog's aggregates (finite count, min, max, count <= 0, median)."""
    finite, lo, hi, nonpositive = int(row.finite or 0), row.min, row.max, int(row.nonpositive or 0)
    if finite < 2 or nonpositive:
        return False
    med = middle[0] if len(middle) == 1 else (middle[0] + middle[1]) / 2
    return bool(float(hi) / float(lo) >= LOG_SPAN or float(hi) / med >= LOG_SPIKE)


def _number(run: Any, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CorruptDataError(f"a scalar in the catalog of {run.path} is not a number ({value!r}): the catalog is "
                               "damaged (`stepdump verify` checks a run)")
    return float(value)


def _arrays(run: Any, pts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    try:
        values = np.array([np.nan if v is None else v for v in pts[:, 1]], dtype=np.float64)
        return pts[:, 0].astype(np.int64), values
    except (ValueError, TypeError) as e:
        raise CorruptDataError(f"the scalars in the catalog of {run.path} are not all numbers ({e}): the catalog "
                               "is damaged (`stepdump verify` checks a run)") from e
