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
        ends: For a matrix bucketed in the catalog (:func:`bucketed_matrices`), the last step
            each column covers (``steps`` then holds each column's first step); None when every
            column is one step.
        count: Recorded steps the columns stand for (None: ``steps.size``).
    """

    names: list[str]
    steps: np.ndarray
    values: np.ndarray
    ends: np.ndarray | None = None
    count: int | None = None

    @property
    def last_steps(self) -> np.ndarray:
        """The last step each column covers (``steps`` itself when not bucketed)."""
        return self.steps if self.ends is None else self.ends

    @property
    def recorded(self) -> int:
        """How many recorded steps the columns stand for."""
        return int(self.steps.size) if self.count is None else self.count

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


#: What :func:`bucketed_matrices` returns besides the stat columns: the largest relative change
#: of the norm between consecutive recorded steps in the bucket, and how many of the bucket's
#: steps had a NaN/±Inf element.
BUCKET_EXTRAS = ("norm_change", "nonfinite")
_BUCKET_COLUMNS = ("norm", "min", "max", "mean", "std", *BUCKET_EXTRAS)


def bucketed_matrices(run: Run, kind: str, max_columns: int) -> dict[str, StatMatrix] | None:
    """norm/min/max/mean/std (and :data:`BUCKET_EXTRAS`; ``norm_change`` for params only, the
    update-ratio bound: NaN for other kinds) of every ``kind`` tensor, aggregated
    in the catalog into at most ``max_columns`` buckets of equal step width; None when the run
    has at most ``max_columns`` stats steps (read it exactly, :func:`stat_matrices`).

    Each bucket keeps what a reader looks for: the largest norm (spikes), the smallest minimum and
    largest maximum (the envelope), the average mean and std, the largest step-to-step relative
    norm change and the count of steps with NaN/±Inf. The catalog returns ``tensors x buckets``
    rows (:meth:`~stepdump.store.queries.CatalogReader.stat_buckets`); the rows of every step
    are never loaded into Python.
    """
    steps = run.stats_steps
    if len(steps) <= max_columns:
        return None
    series = [(sid, name) for sid, _, name in run.catalog.matching_series(kind, None)]
    if not series:
        return None
    first, last = steps[0], steps[-1]
    width = -(-(last - first + 1) // max_columns)
    rows = run.catalog.stat_buckets(kind, first, width, change=kind == "params")  # the update-ratio bound
    table = _floats(run, rows, 5 + len(_BUCKET_COLUMNS), f"bucketed {kind} stats")
    del rows
    if not table.shape[0]:
        return None
    ids = np.array([sid for sid, _ in series], dtype=np.float64)
    buckets = np.unique(table[:, 1]).astype(np.int64)
    names = [n for _, n in series]
    r = np.searchsorted(ids, table[:, 0])
    c = np.searchsorted(buckets, table[:, 1].astype(np.int64))
    # Each column spans the steps its rows have (the bucket's first to last recorded step of the
    # kind); the steps it stands for: per bucket, the most rows any tensor has there.
    starts = np.full(buckets.size, np.iinfo(np.int64).max)
    ends = np.full(buckets.size, np.iinfo(np.int64).min)
    count = np.zeros(buckets.size, dtype=np.int64)
    np.minimum.at(starts, c, table[:, 2].astype(np.int64))
    np.maximum.at(ends, c, table[:, 3].astype(np.int64))
    np.maximum.at(count, c, table[:, 4].astype(np.int64))
    out = {}
    for j, column in enumerate(_BUCKET_COLUMNS):
        values = np.full((len(series), buckets.size), np.nan)
        values[r, c] = table[:, 5 + j]
        out[column] = StatMatrix(names, starts, values, ends=ends, count=int(count.sum()))
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
