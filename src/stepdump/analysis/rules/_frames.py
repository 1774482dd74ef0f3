"""Per-step series the rules derive from a run's stats and scalars frames (pure functions of frames).

Everything here is a pure function of frames (or of the Run's reader API) so
that each rule stays a short statement of its test.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from stepdump.errors import StepdumpError

# 1.4826 * MAD estimates the standard deviation of normally distributed data.
MAD_TO_STD = 1.4826


def ndim(shape: Any) -> int:
    """Number of dimensions of a stats-frame ``shape`` string ("16,8" -> 2, "" -> 0)."""
    text = "" if shape is None else str(shape).strip()
    return 0 if not text else len(text.split(","))


def stats_windows(run: Any, kind: str | None = None) -> Iterator[pd.DataFrame]:
    """``run.stats(kind)`` as consecutive frames of a few steps each when ``run`` can give them
    (:meth:`~stepdump.analysis.rule_runner.CachedRun.stats_windows`), else as one frame."""
    windows = getattr(run, "stats_windows", None)
    if windows is None:
        yield run.stats(kind) if kind is not None else run.stats()
        return
    yield from windows(kind)


def tensor_series(run: Any, kind: str) -> Iterator[tuple[str, pd.DataFrame]]:
    """``(name, rows)`` of each ``kind`` tensor, as ``run.stats(kind).groupby("name", sort=False)``
    yields them, one tensor read at a time when ``run`` can (see :func:`stats_windows`)."""
    series = getattr(run, "tensor_series", None)
    if series is None:
        for name, rows in run.stats(kind).groupby("name", sort=False):
            yield str(name), rows
        return
    yield from series(kind)


def glob_literal(name: str) -> str:
    """A GLOB pattern matching exactly ``name`` (its ``*``, ``?`` and ``[`` taken literally)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def name_rows(run: Any, kind: str, name: str) -> pd.DataFrame:
    """The stats rows of one tensor, by step (what ``run.stats(kind)`` holds for ``name``), from
    ``run.name_rows`` when it has it (:class:`~stepdump.analysis.rule_runner.CachedRun`)."""
    rows = getattr(run, "name_rows", None)
    if rows is not None:
        return rows(kind, name)  # type: ignore[no-any-return]
    return run.stats(kind, glob_literal(name))


def frame_names(run: Any, kind: str) -> list[str]:
    """The ``kind`` tensors in the order ``run.stats(kind)`` first shows them (no rows read when
    ``run`` can say it from the catalog)."""
    names = getattr(run, "frame_names", None)
    if names is not None:
        return list(names(kind))
    return [str(n) for n in pd.unique(run.stats(kind)["name"])]


def nonfinite(df: pd.DataFrame) -> pd.Series:
    """Per row: number of NaN + Inf elements (the stats leave those out of norm, max, ...)."""
    cols = [df[c].to_numpy() for c in ("nan", "posinf", "neginf")]
    if all(c.dtype == np.int64 for c in cols):  # no NULL count: the sum of the columns as they are
        return pd.Series(cols[0] + cols[1] + cols[2], index=df.index)
    return df[["nan", "posinf", "neginf"]].fillna(0).sum(axis=1).astype("int64")


def matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def derived(run: Any, key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per check where ``run`` keeps such values
    (:meth:`~stepdump.analysis.rule_runner.CachedRun.derived`; several rules ask for the same);
    the caller must not change what it gets."""
    keep = getattr(run, "derived", None)
    return make() if keep is None else keep(key, make)


def skipped_steps(run: Any) -> set[int]:
    """Steps the GradScaler skipped (no update happened)."""
    return set(derived(run, "skipped_steps", lambda: _skipped_steps(run)))


def as_step_array(steps: set[int]) -> np.ndarray:
    """``steps`` as an int64 array (for ``np.isin`` over a piece of a tensor's rows)."""
    return np.fromiter(steps, dtype=np.int64, count=len(steps))


def _skipped_steps(run: Any) -> set[int]:
    sc = run.scalars()
    if "skipped" not in sc.columns:
        return set()
    return {int(s) for s in sc.index[sc["skipped"].astype(bool)]}


def optimizer_param(name: str, params: Sequence[str]) -> tuple[str, str] | None:
    """Split an optimizer-state name ``"<param>.<key>"`` into (param, key), longest param first."""
    best = None
    for p in params:
        if name.startswith(p + ".") and (best is None or len(p) > len(best)):
            best = p
    return None if best is None else (best, name[len(best) + 1 :])


def optimized_params(run: Any) -> set[str]:
    """Parameters the optimizer steps: in a param group, or with grads or optimizer state."""
    out: set[str] = set()
    layout = run.meta.get("layout", {}) if isinstance(run.meta, dict) else {}
    for group in layout.get("groups", []) or []:
        out.update(group)
    kinds = run.kinds()
    if "grads" in kinds:
        out.update(run.names("grads"))
    if "optimizer" in kinds:
        params = run.names("params") if "params" in kinds else sorted(out)
        for n in run.names("optimizer"):
            split = optimizer_param(n, params)
            if split is not None:
                out.add(split[0])
    return out


def global_grad_norm(grads: pd.DataFrame, skipped: set[int]) -> pd.Series:
    """sqrt(sum of squared per-tensor grad norms) per step.

    Steps the scaler skipped and steps where any grad has NaN/Inf are left out
    (the ``nan_inf`` rule reports those), so the series is finite.
    """
    if grads.empty:
        return pd.Series(dtype=float, name="grad_norm")
    df = grads.assign(bad=nonfinite(grads) > 0, sq=grads["norm"].fillna(0.0) ** 2)
    per = df.groupby("step").agg(sq=("sq", "sum"), bad=("bad", "any"))
    per = per[~per["bad"] & ~per.index.isin(list(skipped))]
    out = np.sqrt(per["sq"].astype(float))
    out.name = "grad_norm"
    return out


def windowed_grad_norm(run: Any, skipped: set[int], names: set[str] | None = None) -> tuple[pd.Series, list[int]]:
    """:func:`global_grad_norm` of the run's grads (only ``names``, when given), window by window
    (:func:`stats_windows`), and the steps at which any grad has a norm (the rows a
    ``pivot_table`` of the grads' norms has). The norm of a step is a sum over that step's rows
    only, so windows of whole steps give the very same series."""
    if names is not None and "grads" in run.kinds() and set(run.names("grads")) <= set(names):
        names = None  # every grad kept: the series of all grads, which another rule may have asked for
    norms, steps = derived(run, ("windowed_grad_norm", frozenset(skipped), None if names is None else frozenset(names)),
                           lambda: _windowed_grad_norm(run, skipped, names))
    return norms.copy(), list(steps)


def _windowed_grad_norm(run: Any, skipped: set[int], names: set[str] | None) -> tuple[pd.Series, list[int]]:
    parts: list[pd.Series] = []
    steps: list[int] = []
    if "grads" in run.kinds():
        for df in stats_windows(run, "grads"):
            if names is not None:
                df = df[df["name"].isin(names)]
            if df.empty:
                continue
            parts.append(global_grad_norm(df, skipped))
            steps.extend(int(s) for s in pd.unique(df.loc[df["norm"].notna(), "step"]))
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.Series(dtype=float, name="grad_norm"), sorted(set(steps))
    out = pd.concat(parts) if len(parts) > 1 else parts[0]
    out.name = "grad_norm"
    return out, sorted(set(steps))


def trailing_median(values: pd.Series, window: int, min_history: int) -> pd.Series:
    """Median of the ``window`` values before each one (NaN until ``min_history`` exist)."""
    return values.shift(1).rolling(window, min_periods=min_history).median()


def robust_z(values: pd.Series, window: int, min_history: int, rel_floor: float, *, log: bool) -> pd.DataFrame:
    """Robust z-score of each value against the ``window`` values before it.

    ``z = (x - median) / scale`` with ``scale = max(1.4826 * MAD, floor)``. On
    a log scale (``log=True``, values must be > 0) x, median and MAD are of
    ``log(values)`` and ``floor = rel_floor``; otherwise ``floor = rel_floor *
    |median|``. Either way the floor is a relative change, and keeps a flat
    stretch (MAD near 0) from turning rounding noise into huge z. Returns
    columns ``median`` (in the values' own units), ``scale``, ``z`` (NaN until
    ``min_history`` values exist).
    """
    x = np.log(values) if log else values
    prev = x.shift(1).rolling(window, min_periods=min_history)
    med = prev.median()

    def mad(a: np.ndarray) -> float:
        a = a[~np.isnan(a)]
        return float(np.median(np.abs(a - np.median(a))))

    floor = rel_floor if log else rel_floor * med.abs()
    scale = np.maximum(MAD_TO_STD * prev.apply(mad, raw=True), floor)
    scale = scale.where(scale > 0)
    z = (x - med) / scale
    return pd.DataFrame({"median": np.exp(med) if log else med, "scale": scale, "z": z})


def episodes(flagged: Iterable[int], order: Sequence[int]) -> list[list[int]]:
    """Group flagged steps into runs that are consecutive in ``order`` (the recorded steps)."""
    pos = {s: i for i, s in enumerate(order)}
    out: list[list[int]] = []
    last = None
    for s in sorted(flagged, key=lambda s: pos.get(s, -1)):
        i = pos.get(s)
        if i is None:
            continue
        if last is not None and i == last + 1:
            out[-1].append(s)
        else:
            out.append([s])
        last = i
    return out


def sustained(flagged: Iterable[int], order: Sequence[int], patience: int) -> list[list[int]]:
    """Episodes (see :func:`episodes`) at least ``patience`` recorded steps long."""
    return [e for e in episodes(flagged, order) if len(e) >= patience]


def fmt(x: float) -> str:
    """A number for a message: 3 significant digits."""
    return f"{x:.3g}"


def times(x: float) -> str:
    """A ratio for a message: ``"1000x"``, ``"23.9x"`` (no exponent below a million)."""
    return f"{x:.0f}x" if 100 <= abs(x) < 1e6 else f"{x:.3g}x"


def param_hypers(run: Any) -> dict[str, dict[str, Any]]:
    """Parameter name -> hyperparameters of its param group (lr, eps, betas, ...).

    Taken from the last step stored in full (the only ones that keep the param
    groups); empty when the run has none.
    """
    steps = run.steps
    if not steps:
        return {}
    try:
        groups = run.step_state(steps[-1]).get("groups", [])
    except StepdumpError:  # state unreadable: the callers fall back to their defaults
        return {}
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        for p in g.get("params", []):
            out[p] = dict(g.get("hyper", {}))
    return out
