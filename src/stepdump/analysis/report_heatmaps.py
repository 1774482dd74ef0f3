"""The report's heatmaps: tensors x steps matrices bucketed for the page, and the update ratio.

Split from :mod:`stepdump.analysis.report` (which assembles the whole page's data): how one
matrix becomes a heatmap (columns reduced by max, so a spike survives; NaN/Inf cells marked),
how several stores' matrices become one, and the update ratio ‖θ_{t+1} − θ_t‖ / ‖θ_t‖, exact
at full step pairs or bounded below from the recorded norms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from stepdump.analysis.downsample import bucket_max
from stepdump.analysis.matrices import StatMatrix, total_numel
from stepdump.read.run import Run

log = logging.getLogger(__name__)


def stack(parts: list[tuple[str, StatMatrix]]) -> StatMatrix:
    """Matrices of several stores as one: rows named with each store's prefix, columns the
    union of their steps (NaN where a store has no value)."""
    if len(parts) == 1 and not parts[0][0]:
        return parts[0][1]
    steps = np.unique(np.concatenate([m.steps for _, m in parts])).astype(np.int64)
    ends = steps.copy()
    names: list[str] = []
    blocks = []
    for prefix, m in parts:
        block = np.full((len(m.names), steps.size), np.nan)
        at = np.searchsorted(steps, m.steps)
        block[:, at] = m.values
        ends[at] = np.maximum(ends[at], m.last_steps)  # bucketed stores: the widest bucket starting there
        names.extend(prefix + n for n in m.names)
        blocks.append(block)
    bucketed = any(m.ends is not None for _, m in parts)
    return StatMatrix(names, steps, np.concatenate(blocks), ends=ends if bucketed else None,
                      count=max(m.recorded for _, m in parts) if bucketed else None)


def heatmap_data(m: StatMatrix, max_points: int, label: str, note: str = "") -> dict[str, Any] | None:
    """A tensors x steps heatmap of ``m`` for the page: columns bucketed to ``max_points`` by max."""
    return heatmap(m, max_points, label, note)


def heatmap(m: StatMatrix, max_points: int, label: str, note: str = "",
             bad: StatMatrix | None = None) -> dict[str, Any] | None:
    """A heatmap of ``m``'s columns reduced by max to ``max_points``. ``bad`` (same rows and
    columns): steps with a NaN/±Inf element, for ``nonfinite``, the ``[row, column]`` cells whose
    bucket holds one (the page marks them: a norm of the finite elements would hide them)."""
    if m.empty:
        return None
    first, last, reduced = bucket_max(m.values, max_points)
    out = {
        "label": label,
        "note": note,
        "names": m.names,
        "x0": ints(m.steps[first]),
        "x1": ints(m.last_steps[last]),
        "values": [floats(row) for row in reduced],
        "steps": m.recorded,
    }
    if bad is not None and bad.values.shape == m.values.shape:
        _, _, hot = bucket_max(np.nan_to_num(bad.values), max_points)
        out["nonfinite"] = [[int(r), int(c)] for r, c in zip(*np.nonzero(hot > 0))]
    return out


#: ``per_store(fn, *args)``: ``[fn(store, *args) for each store]``, in the stores' order, done
#: wherever the caller chooses (stepdump.analysis.report: worker processes for many ranks).
PerStore = Callable[..., list[Any]]


def update_ratio(
    stores: list[tuple[str, Run]], params: StatMatrix | None, max_points: int, exact_steps: int, budget: int,
    change: StatMatrix | None = None, *, per_store: PerStore | None = None,
) -> dict[str, Any] | None:
    """Exact ratios at full step pairs, else (or also) the lower bound from norms. ``change``: for
    norms bucketed in the catalog, each bucket's largest bound (the catalog computed it per step).
    ``per_store``: how :func:`store_ratios` is done for each store (default: one after another)."""
    if params is None or params.empty:
        return None
    exact = exact_ratios(stores, exact_steps, budget, per_store)
    bucketed = change is not None and params.ends is not None
    pairs_total = params.recorded - 1 if bucketed else int(np.count_nonzero(np.diff(params.steps) == 1))
    out: dict[str, Any] = {"exact": exact, "lower_bound": None}
    if exact is not None and exact["steps"] >= pairs_total:
        return out  # exact at every step: the bound adds nothing
    p = params.values
    bound: StatMatrix | None = None
    if bucketed:
        bound = change
    elif p.shape[1] >= 2:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.abs(p[:, 1:] - p[:, :-1]) / p[:, :-1]
        ratio[~np.isfinite(ratio)] = np.nan
        bound = StatMatrix(params.names, params.steps[:-1], ratio)
    if bound is not None:
        out["lower_bound"] = heatmap(
            bound, max_points, "| ‖θ_next‖ − ‖θ‖ | / ‖θ‖",
            "Lower bound on ‖θ_next − θ‖ / ‖θ‖ from recorded norms only (reverse triangle inequality), "
            "between consecutive recorded steps.",
        )
    return out


def exact_ratios(stores: list[tuple[str, Run]], max_steps: int, budget: int,
                 per_store: PerStore | None = None) -> dict[str, Any] | None:
    """:func:`store_ratios` of every store, its rows named with the store's prefix."""
    if per_store is None:
        ratios = [store_ratios(store, max_steps, budget // len(stores)) for _, store in stores]
    else:
        ratios = per_store(store_ratios, max_steps, budget // len(stores))
    parts = [(prefix, r) for (prefix, _), r in zip(stores, ratios, strict=True)]
    found = [(prefix, m, total) for prefix, (m, total) in parts if m is not None]
    if not found:
        return None
    m = stack([(prefix, m) for prefix, m, _ in found])
    total = max(t for _, _, t in found)
    return heatmap(m, max_steps, "‖θ_{t+1} − θ_t‖ / ‖θ_t‖",
                    f"Exact, from full tensors, at {m.steps.size} of {total} steps whose next step is also "
                    "stored in full.")


def store_ratios(run: Run, max_steps: int, budget: int) -> tuple[StatMatrix | None, int]:
    """‖θ_{t+1} − θ_t‖ / ‖θ_t‖ per tensor of one store at up to ``max_steps`` steps whose
    successor is also full; and how many such steps there are."""
    names = run.names("params")  # the rows of the params matrix: recording order
    full = run.steps
    full_set = set(full)
    pairs = [t for t in full if t + 1 in full_set]
    if not pairs or max_steps < 1:
        return None, len(pairs)
    per_step = max(1, total_numel(run, "params", pairs[0]))
    k = min(len(pairs), max_steps, budget // (2 * per_step))
    if k < 1:
        log.info("report: exact update ratios skipped, one step has %d elements (budget %d)", per_step, budget)
        return None, len(pairs)
    chosen = sorted({pairs[i] for i in np.linspace(0, len(pairs) - 1, k).round().astype(int)})
    values = np.full((len(names), len(chosen)), np.nan)
    prev_step: int | None = None
    prev: dict[str, torch.Tensor] = {}
    for j, t in enumerate(chosen):
        before = prev if prev_step == t else run.tensors(t, "params")
        after = run.tensors(t + 1, "params")
        for i, name in enumerate(names):
            a, b = before.get(name), after.get(name)
            if a is None or b is None or a.shape != b.shape:
                continue
            a64 = a.double()
            denom = float(torch.linalg.vector_norm(a64))
            if denom > 0:
                values[i, j] = float(torch.linalg.vector_norm(b.double() - a64)) / denom
        prev_step, prev = t + 1, after
    return StatMatrix(names, np.array(chosen, dtype=np.int64), values), len(pairs)


# -- JSON helpers ---------------------------------------------------------------
def floats(a: Iterable[float]) -> list[float | None]:
    arr = np.asarray(a, dtype=np.float64)
    finite = np.isfinite(arr)
    if finite.all():
        return arr.tolist()  # type: ignore[no-any-return]
    out = arr.astype(object)  # NaN/Inf -> None (JSON has neither), in C rather than per element in Python
    out[~finite] = None
    return out.tolist()  # type: ignore[no-any-return]


def ints(a: Iterable[int]) -> list[int]:
    return [int(v) for v in np.asarray(a).tolist()]
