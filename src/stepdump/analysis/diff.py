"""Diff two runs: the first step where they part, its earliest cause, and what was compared.

At each common step, in causal order (:data:`~stepdump.analysis.diff_state.STAGES`), the diff
compares the param groups' hyperparameters and the scheduler and GradScaler state (from the
step's recorded state; the ``lr`` scalars at every step), the RNG and the batch where they were
recorded, then the tensors (params, activations, grads, optimizer state) and the logged
scalars. The first step where anything differs is ``first_step``; what differs there is
``differences``, earliest cause first, and ``reading`` says in one line what that points at.

Fingerprints (xxh3-64 of exact bytes) are compared first, a block of steps per query, so equal
tensors are never read; a step's state is compared as stored, its tensors by fingerprint.
Tensors are read only where fingerprints differ, at the first step where tensors differ (or,
with a tolerance, where a fingerprint differs, to see whether it is within it).

What could not be compared is said, never taken as equal: ``coverage`` counts what was compared
and lists what is in one run only, and two runs with no tensor in common at a common step are
not ``identical`` but not ``comparable``.

An RNG stream is compared but is not, by itself, a divergence: two runs that seed torch only
have different (unused) numpy and python states, and their training is the same. Where the RNG
differs and nothing computed from it does (the batch, params, loss, grads, optimizer state), it
is a note (``notes``, ``rng``); where something computed differs too, the verdict is that
earliest computed difference and the reading names the RNG as its likely or possible cause.
``ignore=`` leaves parts out of the comparison altogether (:mod:`~stepdump.analysis.diff_ignore`).

Two joint runs (several model/optimizer pairs) are compared pair by pair
(:mod:`~stepdump.analysis.diff_joint`). Two multi-rank runs are compared rank by rank (rank r of A with rank r of B); the result is the
rank that diverges first. Runs recorded by different ranks are refused rather than compared in
part.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stepdump.analysis.diff_ignore import RNG_STREAMS, Ignore, parse_ignore
from stepdump.analysis.diff_joint import diff_joint
from stepdump.analysis.diff_noise import noise_diff
from stepdump.analysis.diff_reading import reading, rng_notes
from stepdump.analysis.diff_structure import structure_notes, structure_reading
from stepdump.analysis.diff_result import Coverage, DiffResult
from stepdump.analysis.diff_state import (KIND_STAGE, STAGES, Difference, RngDiff, config_differences, parse_state,
                                          scalar_differences, scalar_table, scalars_equal, state_differences)
from stepdump.analysis.diff_values import TensorDiff, compare_tensors
from stepdump.core.hashing import XXH3, fingerprint_as, same_fingerprint
from stepdump.errors import ConfigError, StepNotFoundError
from stepdump.read.joint import is_joint
from stepdump.read.reader import RunReader
from stepdump.read.rows import fp_kind_map
from stepdump.store.format import Key
from stepdump.store.queries import FingerprintRow

__all__ = ["KIND_ORDER", "Coverage", "DiffResult", "Difference", "RngDiff", "TensorDiff", "compare_tensors", "diff"]

#: Order of tensor kinds at one step, earliest cause first (the batch, the params the forward
#: pass reads, its activations, the backward pass, the optimizer state).
KIND_ORDER = ("inputs", "params", "buffers", "activations", "activation_grads", "grads", "optimizer")
_BLOCK = 256


def diff(run_a: RunReader, run_b: RunReader, atol: float = 0.0, rtol: float = 0.0,
         kinds: Iterable[str] | None = None, ignore: str | Iterable[str] | None = None,
         noise: Sequence[RunReader] | None = None, noise_alpha: float = 0.01) -> DiffResult:
    """Find the first step where two runs differ, its earliest cause, and the tensors that differ.

    Args:
        run_a, run_b: Opened runs (``stepdump.open``). Two multi-rank runs are
            compared rank by rank, and must have been recorded by the same ranks.
        atol, rtol: Tolerances for tensors and scalars; 0 (default) means bitwise. A
            value differs when ``|a - b| > atol + rtol * |b|``. State (hyperparameters,
            scheduler, scaler, RNG) is always compared exactly.
        kinds: Only compare tensors of these kinds (default: all recorded kinds).
        ignore: Parts to leave out of the comparison: ``"rng"`` (or one stream:
            ``"rng.numpy"``, ``"rng.python"``, ``"rng.torch"``, ``"rng.cuda"``),
            ``"hyperparameters"``, ``"scheduler"``, ``"scaler"``, ``"batch"``, ``"scalars"``
            (or one: ``"scalars.NAME"``), or a tensor kind (module
            :mod:`~stepdump.analysis.diff_ignore`). An RNG that differs is never a
            divergence by itself, ignored or not; leaving it out also drops its note.
        noise: Repeats of ``run_a`` (the same code and settings, run again): a difference then
            counts only where B stands out from ``run_a`` and its repeats, with a false-alarm
            rate of at most ``noise_alpha`` over the whole run if B is just another repeat
            (scalars by value, tensors by norm, each a Student t test against the repeats,
            Bonferroni over every quantity and step; exact until the repeats first differ).
            ``result.noise`` holds the test's size and critical value and the quantities at the
            first step that counts (:mod:`~stepdump.analysis.diff_noise`). Not with atol/rtol.
        noise_alpha: With ``noise``: the run-level false-alarm rate, in (0, 1) (default 1%).

    Returns:
        For single stores, their comparison. For multi-rank runs, the comparison
        of the rank that diverges first (lowest step, then lowest rank; ``rank``
        says which; ``steps_compared`` and the step and name lists are the union
        over ranks) with every rank's own result in ``per_rank``.

    Raises:
        ConfigError: Bad tolerances, kinds or ignored parts, or runs recorded by
            different ranks (compare one rank of each: ``run.rank(r)``).
    """
    if atol < 0 or rtol < 0:
        raise ConfigError("atol and rtol must be >= 0")
    wanted = tuple(kinds) if kinds is not None else KIND_ORDER
    for k in wanted:
        if k not in KIND_ORDER:
            raise ConfigError(f"unknown kind {k!r}; choose from {', '.join(KIND_ORDER)}")
    left_out = parse_ignore(ignore)
    wanted = left_out.kinds(wanted)
    if noise:
        if atol or rtol:
            raise ConfigError("diff with noise= judges differences by the spread among the repeats: "
                              "leave atol and rtol at 0")
        return noise_diff(run_a, run_b, list(noise), wanted, left_out, noise_alpha, exact=diff)
    if is_joint(run_a) or is_joint(run_b):  # pair by pair (G with G, D with D)
        return diff_joint(run_a, run_b, lambda a, b: _diff_store(a, b, atol, rtol, wanted, left_out))
    # Rank by rank, one pair of stores at a time: run.stores() opens them lazily, a list of them
    # would hold every rank open at once (tests/test_ranks_bounded.py).
    ranks_a, ranks_b = [r for r, _ in run_a.stores()], [r for r, _ in run_b.stores()]
    if ranks_a != ranks_b:
        def which(ranks: list[int | None]) -> str:
            return "a single process" if ranks == [None] else f"ranks {ranks}"
        raise ConfigError(
            f"run A was recorded by {which(ranks_a)} and run B by {which(ranks_b)}; diff compares runs rank by "
            "rank. Compare one rank of each: stepdump.diff(run_a.rank(r), run_b.rank(r)) (or the single run)"
        )
    if ranks_a == [None]:
        return _diff_store(next(run_a.stores())[1], next(run_b.stores())[1], atol, rtol, wanted, left_out)
    per_rank = {r: _diff_store(a, b, atol, rtol, wanted, left_out)
                for (r, a), (_, b) in zip(run_a.stores(), run_b.stores(), strict=True) if r is not None}
    return _merge(per_rank)


def _merge(per_rank: dict[int, DiffResult]) -> DiffResult:
    """One result for a multi-rank diff: the first divergent rank's, with every rank's attached.

    A rank with nothing comparable makes the whole not comparable (its coverage is the one
    reported), since "identical" must hold for every rank."""
    diverged = [(res.first_step, r) for r, res in per_rank.items() if res.first_step is not None]
    blind = [r for r, res in per_rank.items() if not res.comparable]
    rank = min(diverged)[1] if diverged else min(blind) if blind else min(per_rank)
    first = per_rank[rank]

    def union(attr: str) -> list[Any]:
        return sorted({x for res in per_rank.values() for x in getattr(res, attr)},
                      key=_order if attr.startswith("names") else None)

    scalar_diffs = [(res.first_scalar_diff, r) for r, res in per_rank.items() if res.first_scalar_diff]
    coverage = per_rank[min(blind)].coverage if blind else first.coverage
    unmade = [(r, res.coverage) for r, res in sorted(per_rank.items()) if res.coverage.fp_kinds_differ]
    if unmade:  # a check left out on any rank keeps the whole from being identical
        coverage = replace(coverage, fp_kinds_differ=sum(c.fp_kinds_differ for _, c in unmade),
                           fp_kinds_differ_first=unmade[0][1].fp_kinds_differ_first)
    return DiffResult(
        first_step=first.first_step, tensors=first.tensors,
        steps_compared=max(res.steps_compared for res in per_rank.values()),
        steps_only_in_a=union("steps_only_in_a"), steps_only_in_b=union("steps_only_in_b"),
        names_only_in_a=union("names_only_in_a"), names_only_in_b=union("names_only_in_b"),
        first_scalar_diff=min(scalar_diffs)[0] if scalar_diffs else None,
        rank=rank if diverged else None, per_rank=per_rank,
        differences=first.differences, first_tensor_step=first.first_tensor_step, coverage=coverage,
        config=first.config, reading=first.reading, rng=first.rng, ignored=first.ignored,
        notes=[f"rank {r}: {n}" for r, res in sorted(per_rank.items()) for n in res.notes],
    )


@dataclass
class _Scan:
    """What one pass over the common steps found (see :func:`_scan`)."""

    state_step: int | None = None
    state_diffs: list[Difference] = field(default_factory=list)
    tensor_step: int | None = None
    tensor_diffs: list[TensorDiff] = field(default_factory=list)
    state_seen: dict[int, set[str]] = field(default_factory=dict)  # step -> state parts both had
    state_missing: int = 0
    keys: set[Key] = field(default_factory=set)
    checks: int = 0
    rng: dict[str, list[int]] = field(default_factory=dict)  # stream -> [first step, last step, steps]
    rng_steps: int = 0  # steps whose RNG was compared
    # (kind, name) -> fingerprint kind of the series that are not xxh3, in A and in B (read once)
    fp_a: dict[Key, str] = field(default_factory=dict)
    fp_b: dict[Key, str] = field(default_factory=dict)
    kinds_differ: int = 0  # step-tensor checks not made: two fingerprint kinds and no bytes to decide
    kinds_differ_first: tuple[int, str, str, str, str] | None = None  # (step, kind, name, kind in A, kind in B)

    def rng_differs(self, step: int, stream: str) -> None:
        seen = self.rng.setdefault(stream, [step, step, 0])
        seen[1], seen[2] = step, seen[2] + 1


def _diff_store(run_a: Any, run_b: Any, atol: float, rtol: float, wanted: tuple[str, ...],
                left_out: Ignore) -> DiffResult:
    """:func:`diff` of two single stores (Runs: ``run.catalog`` answers the queries)."""
    steps_a, steps_b = set(run_a.stats_steps), set(run_b.stats_steps)
    common = sorted(steps_a & steps_b)
    result = DiffResult(
        first_step=None, tensors=[], steps_compared=len(common),
        steps_only_in_a=sorted(steps_a - steps_b), steps_only_in_b=sorted(steps_b - steps_a),
        config=config_differences(run_a.meta, run_b.meta), ignored=left_out.listed,
    )
    names_a, names_b = _names(run_a, wanted), _names(run_b, wanted)
    result.names_only_in_a = sorted(names_a - names_b, key=_order)
    result.names_only_in_b = sorted(names_b - names_a, key=_order)

    # Scalars first (one query a run): their first difference bounds the state comparison.
    ta, tb = scalar_table(run_a.scalar_rows()), scalar_table(run_b.scalar_rows())
    for table in (ta, tb):
        for name in [n for n in table if left_out.scalar(n)]:
            del table[name]
    by_step = scalar_differences(ta, tb, atol, rtol)
    skipped_a, skipped_b = set(run_a.skipped_steps), set(run_b.skipped_steps)
    if "scaler" in left_out.parts:
        skipped_a = skipped_b = set()
    for step in sorted((skipped_a ^ skipped_b) & set(run_a.all_steps) & set(run_b.all_steps)):
        by_step.setdefault(step, []).append(Difference(
            step, "optimizer", "skipped by the GradScaler", "skipped" if step in skipped_a else "not skipped",
            "skipped" if step in skipped_b else "not skipped"))
    scalar_step = min(by_step) if by_step else None
    result.first_scalar_diff = _first_scalar(ta, tb, atol, rtol)

    scan = _scan(run_a, run_b, atol, rtol, wanted, common, scalar_step, left_out,
                 fp_kind_map(run_a.catalog), fp_kind_map(run_b.catalog))
    firsts = [s for s in (scalar_step, scan.state_step, scan.tensor_step) if s is not None]
    result.first_step = min(firsts) if firsts else None
    result.first_tensor_step, result.tensors = scan.tensor_step, scan.tensor_diffs
    if result.first_step is not None:
        result.differences = _at_step(result.first_step, by_step, scan)

    cov = result.coverage
    cov.steps = len(common)
    cov.tensors, cov.tensor_checks = len(scan.keys), scan.checks
    cov.kinds = sorted({k for k, _ in scan.keys}, key=_kind_rank)
    kinds_a, kinds_b = {k for k, _ in names_a}, {k for k, _ in names_b}
    cov.kinds_only_in_a, cov.kinds_only_in_b = sorted(kinds_a - kinds_b), sorted(kinds_b - kinds_a)
    cov.state_steps = len(scan.state_seen)
    cov.state_parts = sorted({p for parts in scan.state_seen.values() for p in parts})
    cov.state_missing = scan.state_missing
    cov.rng_steps = scan.rng_steps
    cov.fp_kinds_differ, cov.fp_kinds_differ_first = scan.kinds_differ, scan.kinds_differ_first
    result.rng = [RngDiff(s, *scan.rng[s]) for s in sorted(scan.rng, key=_stream_rank)]
    result.notes = rng_notes(result.rng, cov.rng_steps, result.first_step)
    cov.scalars = sorted(ta.keys() & tb.keys())
    cov.scalars_only_in_a, cov.scalars_only_in_b = sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())
    stop = result.first_step
    cov.lr_steps = len({s for n in ("lr",) if n in ta and n in tb for s in ta[n].keys() & tb[n].keys()
                        if stop is None or s <= stop})
    if result.first_step is not None:
        result.reading = reading(result, prev_compared=_prev_compared(result.first_step, common),
                                 parts_at_step=scan.state_seen.get(result.first_step, set()))
    structure = structure_notes(run_a, run_b)  # a model pruned / reparametrized in one run only
    explained = structure_reading(result.first_step, structure)
    result.notes += [n for _, n in structure if explained is None or n not in explained]
    result.reading = explained or result.reading
    return result


def _scan(run_a: Any, run_b: Any, atol: float, rtol: float, wanted: tuple[str, ...], common: list[int],
          bound: int | None, left_out: Ignore, fp_a: dict[Key, str], fp_b: dict[Key, str]) -> _Scan:
    """Walk the common steps a block at a time: the state of each step until the first step
    where it (or a scalar, ``bound``) differs, the tensors until the first step where they do.
    An RNG difference is noted along the way and stops nothing. ``fp_a`` / ``fp_b``: the
    fingerprint kinds of the runs' series that are not xxh3 (:func:`~stepdump.read.rows.fp_kind_map`)."""
    scan = _Scan(fp_a=fp_a, fp_b=fp_b)
    stats = set(common)
    steps = sorted(set(run_a.all_steps) & set(run_b.all_steps))
    for i in range(0, len(steps), _BLOCK):
        block = steps[i : i + _BLOCK]
        fa, fb = _fingerprints(run_a, block), _fingerprints(run_b, block)
        for step in block:
            limit = min((s for s in (bound, scan.state_step) if s is not None), default=None)
            if limit is None or step <= limit:
                _compare_state(run_a, run_b, step, fa.get(step, {}), fb.get(step, {}), scan, left_out)
            if step in stats:
                _compare_tensors_at(run_a, run_b, step, fa.get(step, {}), fb.get(step, {}), atol, rtol, wanted,
                                    scan)
            if scan.tensor_step is not None:  # every earlier step's state is compared by now
                return scan
    return scan


def _compare_state(run_a: Any, run_b: Any, step: int, fa: dict[Key, FingerprintRow],
                   fb: dict[Key, FingerprintRow], scan: _Scan, left_out: Ignore) -> None:
    """The recorded state of ``step`` in both runs, where both have one (less what is left out).
    RNG streams that differ are noted in ``scan.rng``; only the rest can be the state's divergence."""
    sa = parse_state(run_a.catalog.step_state(step), f"step {step} of {run_a.path}")
    sb = parse_state(run_b.catalog.step_state(step), f"step {step} of {run_b.path}")
    if sa is None or sb is None:
        scan.state_missing += 1
        return
    state_a = {n: (v.dtype, v.shape, v.fingerprint) for (k, n), v in fa.items() if k == "state"}
    state_b = {n: (v.dtype, v.shape, v.fingerprint) for (k, n), v in fb.items() if k == "state"}
    if scan.fp_a or scan.fp_b:
        _state_across_kinds(run_a, run_b, step, fa, fb, state_a, state_b, scan)
    found, parts = state_differences(step, left_out.state(sa), left_out.state(sb), state_a, state_b)
    scan.state_seen[step] = parts
    scan.rng_steps += "rng" in parts
    computed = []
    for d in found:
        if d.stage == "rng":  # "rng numpy": a stream, judged by what is computed from it
            scan.rng_differs(step, d.what.split(" ", 1)[1] if " " in d.what else d.what)
        else:
            computed.append(d)
    if computed and scan.state_step is None:
        scan.state_step, scan.state_diffs = step, computed


def _compare_tensors_at(run_a: Any, run_b: Any, step: int, ra: dict[Key, FingerprintRow],
                        rb: dict[Key, FingerprintRow], atol: float, rtol: float, wanted: tuple[str, ...],
                        scan: _Scan) -> None:
    found = []
    for key in sorted(ra.keys() & rb.keys(), key=_order):
        kind, name = key
        if kind not in wanted:
            continue
        kind_a, kind_b = scan.fp_a.get(key, XXH3), scan.fp_b.get(key, XXH3)
        if kind_a != kind_b:  # an xxh3 and a dmix64 number say nothing of each other: the bytes decide
            d, compared = _across_kinds(run_a, run_b, step, key, ra[key], rb[key], kind_a, kind_b, atol, rtol)
            if not compared:
                scan.kinds_differ += 1
                if scan.kinds_differ_first is None:
                    scan.kinds_differ_first = (step, kind, name, kind_a, kind_b)
                continue
            scan.keys.add(key)
            scan.checks += 1
            if d is not None:
                found.append(d)
            continue
        scan.keys.add(key)
        scan.checks += 1
        a, b = ra[key], rb[key]
        # same dtype, shape and bytes: equal, stored or not
        if (a.dtype, a.shape, a.fingerprint) == (b.dtype, b.shape, b.fingerprint):
            continue
        d = _tensor_diff(run_a, run_b, step, key, a, b, atol, rtol)
        if d is not None:
            found.append(d)
    if found:
        scan.tensor_step, scan.tensor_diffs = step, found


def _at_step(step: int, scalars: dict[int, list[Difference]], scan: _Scan) -> list[Difference]:
    """Everything that differs at ``step``, earliest cause first; a value both the state and
    the scalars hold (the lr) once."""
    items = list(scan.state_diffs) if scan.state_step == step else []
    seen = {(d.stage, d.what) for d in items}
    items += [d for d in scalars.get(step, []) if (d.stage, d.what) not in seen]
    if scan.tensor_step == step:
        items += [Difference(step, KIND_STAGE.get(t.kind, "optimizer"), f"{t.kind} {t.name}", tensor=t)
                  for t in scan.tensor_diffs]
    return sorted(items, key=lambda d: STAGES.index(d.stage) if d.stage in STAGES else len(STAGES))


def _prev_compared(step: int, common: list[int]) -> bool | None:
    """Whether the step before ``step`` had its tensors compared (and so was equal); None when
    ``step`` comes before every common step."""
    before = [s for s in common if s < step]
    if not before:
        return None
    return before[-1] == step - 1


def _first_scalar(ta: dict[str, dict[int, float | None]], tb: dict[str, dict[int, float | None]], atol: float,
                  rtol: float) -> tuple[int, str] | None:
    """(step, name) of the first logged scalar that differs (by step, then name)."""
    firsts = [(s, n) for n in ta.keys() & tb.keys()
              for s in sorted(ta[n].keys() & tb[n].keys()) if not scalars_equal(ta[n][s], tb[n][s], atol, rtol)]
    return min(firsts) if firsts else None


def _stream_rank(stream: str) -> tuple[int, str]:
    return (RNG_STREAMS.index(stream) if stream in RNG_STREAMS else len(RNG_STREAMS), stream)


def _kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def _order(key: Key) -> tuple[int, str]:
    kind, name = key
    return _kind_rank(kind), name


def _names(run: Any, kinds: tuple[str, ...]) -> set[Key]:
    return {(k, n) for k, n in run.catalog.series_keys() if k in kinds}


def _fingerprints(run: Any, steps: list[int]) -> dict[int, dict[Key, FingerprintRow]]:
    """step -> (kind, name) -> what the record says of the tensor, every kind (``state`` too)."""
    out: dict[int, dict[Key, FingerprintRow]] = {}
    for r in run.catalog.fingerprint_block(steps[0], steps[-1]):
        out.setdefault(r.step, {})[(r.kind, r.name)] = r
    return out


def _tensor_diff(run_a: Any, run_b: Any, step: int, key: Key, a: FingerprintRow, b: FingerprintRow,
                 atol: float, rtol: float) -> TensorDiff | None:
    kind, name = key
    if a.dtype != b.dtype:
        return TensorDiff(kind, name, "dtype")
    if a.shape != b.shape:
        return TensorDiff(kind, name, "shape")
    try:  # stored (a blob): read by name, its fingerprint checked; a gradient log rebuilds the rest
        ta = run_a.tensor(name, step, kind)
        tb = run_b.tensor(name, step, kind)
    except StepNotFoundError:  # values not stored (nor rebuilt, verified) at this step
        if a.blob is None or b.blob is None:
            return TensorDiff(kind, name, "fingerprint")
        raise
    return compare_tensors(kind, name, ta, tb, atol, rtol)


def _across_kinds(run_a: Any, run_b: Any, step: int, key: Key, a: FingerprintRow, b: FingerprintRow,
                  kind_a: str, kind_b: str, atol: float, rtol: float) -> tuple[TensorDiff | None, bool]:
    """(difference or None, whether compared) of one tensor whose fingerprints are of two kinds
    (docs/cuda.md, "Comparisons"): dtype and shape as usual; then the bytes where both runs
    stored them; where one did, its tensor fingerprinted under the other's kind; where neither
    did, not compared (never taken as equal, nor as different)."""
    kind, name = key
    if a.dtype != b.dtype:
        return TensorDiff(kind, name, "dtype"), True
    if a.shape != b.shape:
        return TensorDiff(kind, name, "shape"), True
    if a.blob is not None and b.blob is not None:  # both stored: read (each checked under its own kind), compare
        return compare_tensors(kind, name, run_a.tensor(name, step, kind), run_b.tensor(name, step, kind),
                               atol, rtol), True
    if a.blob is None and b.blob is None:
        return None, False
    if a.blob is not None:  # A's bytes under B's kind, against B's fingerprint
        same = same_fingerprint(kind_b, fingerprint_as(kind_b, run_a.tensor(name, step, kind)), kind_b, b.fingerprint)
    else:
        same = same_fingerprint(kind_a, a.fingerprint, kind_a, fingerprint_as(kind_a, run_b.tensor(name, step, kind)))
    # Bytes differ and one side's values are unknown: the same answer as one kind's (_tensor_diff).
    return (None if same else TensorDiff(kind, name, "fingerprint")), True


def _state_across_kinds(run_a: Any, run_b: Any, step: int, fa: dict[Key, FingerprintRow],
                        fb: dict[Key, FingerprintRow], state_a: dict[str, tuple[Any, ...]],
                        state_b: dict[str, tuple[Any, ...]], scan: _Scan) -> None:
    """Make the state's tensor refs of two fingerprint kinds comparable in place: where the
    bytes decide (:func:`_across_kinds`) B's entry becomes A's (equal) or stays (different);
    where they cannot, both become one placeholder and the check is counted as not made."""
    for ref in state_a.keys() & state_b.keys():
        key = ("state", ref)
        kind_a, kind_b = scan.fp_a.get(key, XXH3), scan.fp_b.get(key, XXH3)
        if kind_a == kind_b:
            continue
        d, compared = _across_kinds(run_a, run_b, step, key, fa[key], fb[key], kind_a, kind_b, 0.0, 0.0)
        if compared:  # equal: B's entry made A's; different: made unequal to any (dtype, shape, int)
            dtype, shape, fp = state_b[ref]
            state_b[ref] = state_a[ref] if d is None else (dtype, shape, f"{kind_b} {fp}")
            continue
        state_b[ref] = state_a[ref]
        scan.kinds_differ += 1
        if scan.kinds_differ_first is None:
            scan.kinds_differ_first = (step, "state", ref, kind_a, kind_b)
