"""Diff two runs: the first step where they part, and which tensors differ there.

Fingerprints (xxh3-64 of exact bytes) are compared first, a block of steps per
query, so equal tensors are never read. Only tensors whose fingerprints differ
are read, and only at the first divergent step (or, with a tolerance, at steps
where a fingerprint differs, to see whether the difference is within it).

Two multi-rank runs are compared rank by rank (rank r of A with rank r of B);
the result is the rank that diverges first. Runs recorded by different ranks
are refused rather than compared in part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stepdump.errors import ConfigError, StepNotFoundError
from stepdump.read.reader import RunReader

# Order of kinds at one step: upstream first, so the first entry points at the origin.
KIND_ORDER = ("inputs", "activations", "activation_grads", "grads", "optimizer", "params", "buffers")
_BLOCK = 256

Key = tuple[str, str]


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs at the first divergent step.

    ``reason`` is ``values`` (errors computed), ``fingerprint`` (bytes differ but
    values were not stored at this step), ``dtype`` or ``shape``.
    """

    kind: str
    name: str
    reason: str
    max_abs: float | None = None
    max_rel: float | None = None
    n_diff: int | None = None
    numel: int | None = None

    def describe(self) -> str:
        if self.reason == "values":
            return (f"{self.kind} {self.name}: {self.n_diff}/{self.numel} elements differ, max abs "
                    f"{self.max_abs:.3g}, max rel {self.max_rel:.3g}")
        if self.reason == "fingerprint":
            return f"{self.kind} {self.name}: bytes differ (values not stored at this step)"
        return f"{self.kind} {self.name}: {self.reason} differs"


@dataclass
class DiffResult:
    """What :func:`diff` found. ``identical`` means every common tensor at every common step is equal."""

    first_step: int | None
    tensors: list[TensorDiff]
    steps_compared: int
    steps_only_in_a: list[int] = field(default_factory=list)
    steps_only_in_b: list[int] = field(default_factory=list)
    names_only_in_a: list[Key] = field(default_factory=list)
    names_only_in_b: list[Key] = field(default_factory=list)
    first_scalar_diff: tuple[int, str] | None = None
    #: For multi-rank runs: the rank ``first_step`` and ``tensors`` are about (None: single stores).
    rank: int | None = None
    #: For multi-rank runs: each rank's own result (empty for single stores).
    per_rank: dict[int, DiffResult] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first_step is None

    @property
    def first_tensor(self) -> TensorDiff | None:
        return self.tensors[0] if self.tensors else None

    def summary(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        ranks = f" on each of {len(self.per_rank)} ranks" if self.per_rank else ""
        if self.identical:
            text = f"identical over {self.steps_compared} common steps{ranks}"
        else:
            first = self.tensors[0]
            text = f"runs diverge at step {self.first_step}{where}, first at {first.kind} {first.name}"
        extras = []
        if self.steps_only_in_a or self.steps_only_in_b:
            extras.append(f"{len(self.steps_only_in_a)} steps only in A, {len(self.steps_only_in_b)} only in B")
        if self.names_only_in_a or self.names_only_in_b:
            extras.append(f"{len(self.names_only_in_a)} tensors only in A, {len(self.names_only_in_b)} only in B")
        return text + (f" ({'; '.join(extras)})" if extras else "")


def diff(run_a: RunReader, run_b: RunReader, atol: float = 0.0, rtol: float = 0.0,
         kinds: Iterable[str] | None = None) -> DiffResult:
    """Find the first step and tensors where two runs differ.

    Args:
        run_a, run_b: Opened runs (``stepdump.open``). Two multi-rank runs are
            compared rank by rank, and must have been recorded by the same ranks.
        atol, rtol: Tolerances; 0 (default) means bitwise. A tensor differs when
            ``|a - b| > atol + rtol * |b|`` for some element.
        kinds: Only compare these kinds (default: all recorded kinds).

    Returns:
        For single stores, their comparison. For multi-rank runs, the comparison
        of the rank that diverges first (lowest step, then lowest rank; ``rank``
        says which; ``steps_compared`` and the step and name lists are the union
        over ranks) with every rank's own result in ``per_rank``.

    Raises:
        ConfigError: Bad tolerances or kinds, or runs recorded by different
            ranks (compare one rank of each: ``run.rank(r)``).
    """
    if atol < 0 or rtol < 0:
        raise ConfigError("atol and rtol must be >= 0")
    wanted = tuple(kinds) if kinds is not None else KIND_ORDER
    for k in wanted:
        if k not in KIND_ORDER:
            raise ConfigError(f"unknown kind {k!r}; choose from {', '.join(KIND_ORDER)}")
    stores_a, stores_b = list(run_a.stores()), list(run_b.stores())
    ranks_a, ranks_b = [r for r, _ in stores_a], [r for r, _ in stores_b]
    if ranks_a != ranks_b:
        def which(ranks: list[int | None]) -> str:
            return "a single process" if ranks == [None] else f"ranks {ranks}"
        raise ConfigError(
            f"run A was recorded by {which(ranks_a)} and run B by {which(ranks_b)}; diff compares runs rank by "
            "rank. Compare one rank of each: stepdump.diff(run_a.rank(r), run_b.rank(r)) (or the single run)"
        )
    if ranks_a == [None]:
        return _diff_store(stores_a[0][1], stores_b[0][1], atol, rtol, wanted)
    per_rank = {r: _diff_store(a, b, atol, rtol, wanted)
                for (r, a), (_, b) in zip(stores_a, stores_b, strict=True) if r is not None}
    return _merge(per_rank)


def _merge(per_rank: dict[int, DiffResult]) -> DiffResult:
    """One result for a multi-rank diff: the first divergent rank's, with every rank's attached."""
    diverged = [(res.first_step, r) for r, res in per_rank.items() if res.first_step is not None]
    rank = min(diverged)[1] if diverged else min(per_rank)
    first = per_rank[rank]

    def union(attr: str) -> list[Any]:
        return sorted({x for res in per_rank.values() for x in getattr(res, attr)},
                      key=_order if attr.startswith("names") else None)

    scalar_diffs = [(res.first_scalar_diff, r) for r, res in per_rank.items() if res.first_scalar_diff]
    return DiffResult(
        first_step=first.first_step, tensors=first.tensors,
        steps_compared=max(res.steps_compared for res in per_rank.values()),
        steps_only_in_a=union("steps_only_in_a"), steps_only_in_b=union("steps_only_in_b"),
        names_only_in_a=union("names_only_in_a"), names_only_in_b=union("names_only_in_b"),
        first_scalar_diff=min(scalar_diffs)[0] if scalar_diffs else None,
        rank=rank if diverged else None, per_rank=per_rank,
    )


def _diff_store(run_a: Any, run_b: Any, atol: float, rtol: float, wanted: tuple[str, ...]) -> DiffResult:
    """:func:`diff` of two single stores (Runs: ``run.catalog`` answers the queries)."""
    steps_a, steps_b = set(run_a.stats_steps), set(run_b.stats_steps)
    common = sorted(steps_a & steps_b)
    result = DiffResult(
        first_step=None, tensors=[], steps_compared=len(common),
        steps_only_in_a=sorted(steps_a - steps_b), steps_only_in_b=sorted(steps_b - steps_a),
    )
    names_a, names_b = _names(run_a, wanted), _names(run_b, wanted)
    result.names_only_in_a = sorted(names_a - names_b, key=_order)
    result.names_only_in_b = sorted(names_b - names_a, key=_order)
    for i in range(0, len(common), _BLOCK):
        block = common[i : i + _BLOCK]
        fa, fb = _fingerprints(run_a, block, wanted), _fingerprints(run_b, block, wanted)
        for step in block:
            ra, rb = fa.get(step, {}), fb.get(step, {})
            found = []
            for key in sorted(ra.keys() & rb.keys(), key=_order):
                if ra[key][:3] == rb[key][:3]:  # same dtype, shape and bytes: equal, stored or not
                    continue
                d = _tensor_diff(run_a, run_b, step, key, ra[key], rb[key], atol, rtol)
                if d is not None:
                    found.append(d)
            if found:
                result.first_step, result.tensors = step, found
                result.first_scalar_diff = _first_scalar_diff(run_a, run_b)
                return result
    result.first_scalar_diff = _first_scalar_diff(run_a, run_b)
    return result


def _order(key: Key) -> tuple[int, str]:
    return (KIND_ORDER.index(key[0]) if key[0] in KIND_ORDER else 99, key[1])


def _names(run: Any, kinds: tuple[str, ...]) -> set[Key]:
    return {(k, n) for k, n in run.catalog.series_keys() if k in kinds}


def _fingerprints(run: Any, steps: list[int], kinds: tuple[str, ...]) -> dict[int, dict[Key, tuple[Any, ...]]]:
    out: dict[int, dict[Key, tuple[Any, ...]]] = {}
    for step, kind, name, dtype, shape, fp, blob in run.catalog.fingerprint_block(steps[0], steps[-1]):
        if kind in kinds:
            out.setdefault(step, {})[(kind, name)] = (dtype, shape, fp, blob)
    return out


def _tensor_diff(run_a: Any, run_b: Any, step: int, key: Key, a: tuple[Any, ...], b: tuple[Any, ...],
                 atol: float, rtol: float) -> TensorDiff | None:
    kind, name = key
    if a[0] != b[0]:
        return TensorDiff(kind, name, "dtype")
    if a[1] != b[1]:
        return TensorDiff(kind, name, "shape")
    try:  # stored (a blob): read by name, its fingerprint checked; a gradient log rebuilds the rest
        ta = run_a.tensor(name, step, kind)
        tb = run_b.tensor(name, step, kind)
    except StepNotFoundError:  # values not stored (nor rebuilt, verified) at this step
        if a[3] is None or b[3] is None:
            return TensorDiff(kind, name, "fingerprint")
        raise
    return compare_tensors(kind, name, ta, tb, atol, rtol)


def compare_tensors(kind: str, name: str, ta: torch.Tensor, tb: torch.Tensor, atol: float = 0.0,
                    rtol: float = 0.0) -> TensorDiff | None:
    """Element-wise comparison; None when equal (bitwise, or within the tolerance)."""
    if ta.is_floating_point() or ta.is_complex():
        xa, xb = ta.double() if not ta.is_complex() else ta, tb.double() if not tb.is_complex() else tb
    else:
        xa, xb = ta.to(torch.float64), tb.to(torch.float64)
    err = (xa - xb).abs()
    # Same bits NaN on both sides counts as equal; bit differences count even if values are ==.
    same_bits = _bit_equal(ta, tb)
    if atol == 0 and rtol == 0:
        differs = ~same_bits
    else:
        both_nan = torch.isnan(xa) & torch.isnan(xb)
        differs = ~(both_nan | (err <= atol + rtol * xb.abs()))
    n = int(differs.sum())
    if n == 0:
        return None
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    max_abs = float(err[differs].max())
    rel = err / xb.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_rel = float(rel[differs].max())
    return TensorDiff(kind, name, "values", max_abs, max_rel, n, ta.numel())


def _bit_equal(ta: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
    size = ta.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if view is None or ta.is_complex():
        return ta == tb
    return ta.contiguous().view(view) == tb.contiguous().view(view)


def _first_scalar_diff(run_a: Any, run_b: Any) -> tuple[int, str] | None:
    sa, sb = run_a.scalars(), run_b.scalars()
    cols = [c for c in sa.columns if c in sb.columns and c != "skipped"]
    idx = sa.index.intersection(sb.index)
    if not cols or len(idx) == 0:
        return None
    a, b = sa.loc[idx, cols], sb.loc[idx, cols]
    neq = (a != b) & ~(a.isna() & b.isna())
    rows = neq.any(axis=1)
    if not rows.any():
        return None
    step = int(rows[rows].index[0])
    col = str(neq.loc[step][neq.loc[step]].index[0])
    return step, col
