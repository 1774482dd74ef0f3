"""Stats as (tensor x step) numpy matrices, read straight from one store's catalog.

``Run.stats()`` builds a 17-column DataFrame sorted by step; that is the right
general tool, but for a long run it is the slow part of a report (about 19 s
for 2,000,000 rows, against 2.5 s for the three columns read here). These
helpers ask the catalog (``run.catalog``, :class:`~stepdump.store.queries.CatalogReader`)
for exactly the column they need and pivot it with numpy. They only read.

Each takes one store (a Run or RemoteRun; for a multi-rank run, each of
``run.stores()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stepdump.errors import CorruptDataError
from stepdump.read.run import Run
from stepdump.store.catalog import STAT_COLUMNS


@dataclass(frozen=True)
class StatMatrix:
    """One stat of many tensors over steps.

    Attributes:
        names: Tensor names, in recording order (rows).
        steps: Sorted steps at which any of them has stats (columns).
        values: float64 array ``[len(names), len(steps)]``; NaN where a tensor
            has no row at a step, or the stat is undefined (all elements
            non-finite, empty tensor).
    """

    names: list[str]
    steps: np.ndarray
    values: np.ndarray

    @property
    def empty(self) -> bool:
        return not self.names or self.steps.size == 0


def _floats(run: Run, rows: Sequence[Sequence[object]], width: int, what: str) -> np.ndarray:
    """Catalog rows as a float64 array ``[n, width]`` (None -> NaN). A value that is not a
    number (text or a blob where SQLite stored whatever it was given) is damage."""
    try:
        return np.array(rows, dtype=np.float64).reshape(-1, width)
    except (ValueError, TypeError) as e:
        raise CorruptDataError(f"the {what} in the catalog of {run.path} are not all numbers ({e}): the catalog "
                               "is damaged (`stepdump verify` checks a run)") from e


def stat_matrix(run: Run, kind: str, column: str = "norm", name_glob: str | None = None) -> StatMatrix:
    """``column`` of every ``kind`` tensor (optionally matching ``name_glob``) over steps."""
    return stat_matrices(run, kind, (column,), name_glob)[column]


def stat_matrices(run: Run, kind: str, columns: Sequence[str],
                  name_glob: str | None = None) -> dict[str, StatMatrix]:
    """Several stat ``columns`` of every ``kind`` tensor over steps, read in one pass.

    Each matrix is what :func:`stat_matrix` gives for its column (same rows, same steps: the
    steps where a tensor of ``kind`` has a row, whichever columns are NULL there). One query
    instead of one per column: the rows are walked and converted once (a report's five columns
    of a long stats-only run: five times less catalog work).
    """
    unknown = [c for c in columns if c not in STAT_COLUMNS]
    if unknown or not columns:
        raise ValueError(f"unknown stat column(s) {unknown or list(columns)!r}; columns are {', '.join(STAT_COLUMNS)}")
    series = [(sid, name) for sid, _, name in run.catalog.matching_series(kind, name_glob)]
    if not series:
        empty = np.zeros(0, dtype=np.int64)
        return {c: StatMatrix([], empty, np.zeros((0, 0))) for c in columns}
    rows = run.catalog.stat_columns(kind, columns, name_glob)
    table = _floats(run, rows, 2 + len(columns), f"{'/'.join(columns)} stats")  # None -> NaN
    del rows  # the Python rows are the big part of memory for a long run
    ids = np.array([sid for sid, _ in series], dtype=np.float64)  # sorted: ORDER BY id
    steps = np.unique(table[:, 1]).astype(np.int64)
    names = [n for _, n in series]
    r = np.searchsorted(ids, table[:, 0])
    c = np.searchsorted(steps, table[:, 1].astype(np.int64))
    out = {}
    for j, column in enumerate(columns):
        values = np.full((len(series), steps.size), np.nan)
        if table.shape[0]:
            values[r, c] = table[:, 2 + j]
        out[column] = StatMatrix(names, steps, values)
    return out


def scalar_series(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (steps, values) for every logged scalar, only at steps it was logged.

    A NaN logged as a scalar is stored as SQL NULL and comes back as NaN; a
    step where the scalar was not logged is simply absent (unlike the wide
    ``Run.scalars()`` frame, where both read NaN).
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    by_name: dict[str, list[tuple[int, float | None]]] = {}
    for step, name, value in run.scalar_rows():  # checked: integer steps, text names, numbers
        by_name.setdefault(name, []).append((step, value))
    for name, pairs in by_name.items():
        arr = np.array(pairs, dtype=np.float64).reshape(-1, 2)
        out[name] = (arr[:, 0].astype(np.int64), arr[:, 1])
    return out


def combined_norm(run: Run, kind: str, name_glob: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The L2 norm of all matching tensors together at each step: sqrt(sum of their norms squared).

    Aggregated inside SQLite (one row per step comes back, not one per tensor).

    Returns:
        ``(steps, norms, tensors)``: steps where any matching tensor has a norm,
        the combined norm there, and how many tensors matched.
    """
    n = len(run.catalog.matching_series(kind, name_glob))
    rows = run.catalog.norm_squares(kind, name_glob)
    arr = _floats(run, rows, 2, f"{kind} norms")  # sqrt here: SQLite may lack math functions
    return arr[:, 0].astype(np.int64), np.sqrt(arr[:, 1]), int(n)


def nonfinite_counts(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(steps with stats, number of tensors with any NaN/+Inf/-Inf element at each)."""
    steps = np.array(run.stats_steps, dtype=np.int64)
    counts = np.zeros(steps.size, dtype=np.int64)
    rows = run.catalog.nonfinite_counts()
    for step, n in rows:
        i = np.searchsorted(steps, step)
        if i < steps.size and steps[i] == step:
            counts[i] = n
    return steps, counts


def total_numel(run: Run, kind: str, step: int) -> int:
    """Elements of all ``kind`` tensors at ``step`` (what reading them in full costs)."""
    return int(run.catalog.total_numel(kind, step))
