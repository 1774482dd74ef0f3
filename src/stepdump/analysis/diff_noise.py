"""Diff under nondeterminism: a difference counts only where B stands out from A and its repeats.

On hardware with nondeterministic kernels two runs of the same code differ from step 0, so the
exact diff only says "diverge at step 0". Record A a few more times (the repeats) and call
``diff(a, b, noise=[a2, a3])``. The question is whether B is just another repeat, and the answer
has a stated error rate over the **whole run**: if B is another repeat, the diff names a
divergence with probability at most ``alpha`` (1% by default), however many quantities and steps
the runs hold. The decision is :func:`~stepdump.analysis.noise_stat.noise_test` (its docstring
says why it is a per-quantity Student t test with a Bonferroni correction over every quantity and
step, and what size of change k repeats can see).

Quantities: every logged scalar (not the recorder's ``sys/*`` timings) by its value, and every
tensor with stats by its norm (over finite elements).

* **Before the noise starts** (the steps before A and its repeats first differ in anything), the
  comparison is exact: B's fingerprints and scalars must equal A's, bit for bit, so identical
  repeats give the exact diff's verdict.
* **From the step the repeats first differ on**, every quantity at every step is one test: B's
  deviation from the mean of A and its repeats, in their standard deviations (at least the
  norm's or value's float32 resolution, ``|A| x 2**-23``: values that coincide after rounding
  cannot show a smaller spread), against the critical value for ``alpha`` over all the run's
  tests. A quantity that A and every repeat hold bit-identical there is tested the same way (its
  spread is its resolution).
* Non-finite values are events, counted whatever the noise: a tensor whose non-finite count
  differs from A's while A and every repeat agree on it, B not finite where A and its repeats
  are, or finite where all of them are not.

The recorded state (hyperparameters, scheduler, scaler, batch) is compared exactly, as the exact
diff does; a repeat whose state differs from A's is noise there, and the state is then left out
(a note says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from stepdump.analysis.diff_result import DiffResult
from stepdump.analysis.diff_state import KIND_STAGE, STAGES, Difference, scalar_label, scalar_stage, scalar_table
from stepdump.analysis.noise_stat import ALPHA, NoiseTest, check_alpha, critical_value, noise_test
from stepdump.core.hashing import XXH3
from stepdump.errors import ConfigError
from stepdump.read.rows import fp_kind_map

_F32_EPS = 2.0 ** -23  # float32's relative rounding: the resolution of a recorded norm or float32 value
#: Below this critical value a change a few times the noise is seen; above it, notes suggest more repeats.
_SHARP = 10.0


@dataclass(frozen=True)
class NoiseRow:
    """One quantity at one step: B against A and its repeats.

    ``kind`` is a tensor kind or ``"scalar"``; ``measure`` is ``"value"`` (a scalar), ``"norm"``
    (a tensor, tested by its norm), ``"bytes"`` (before the noise starts: B compared with A by
    fingerprint, ``difference`` is then ``|norm B - norm A|`` or ``inf``) or ``"non-finite"``
    (an event: B's non-finite elements differ where A and its repeats agree). ``difference`` is
    ``|B - A|``; ``spread`` the standard deviation of A and its repeats (0 before the noise
    starts); ``score`` B's deviation from their mean in units of ``spread * sqrt(1 + 1/(k+1))``
    (Student's t with k degrees of freedom if B is another repeat; inf for an exact difference or
    an event). The row ``exceeded`` where ``score`` is above :attr:`NoiseDiff.critical`.
    """

    step: int
    kind: str
    name: str
    measure: str
    a: float | None
    b: float | None
    difference: float
    spread: float
    score: float
    exceeded: bool


@dataclass
class NoiseDiff:
    """The noise-aware part of a :class:`~stepdump.analysis.diff.DiffResult` (``result.noise``).

    ``alpha``: the run-level false-alarm rate (if B is another repeat, the probability that
    anything counts anywhere in the run is at most this); ``tests``: how many quantity-step tests
    the run made from ``first_noisy_step`` on; ``critical``: the score above which a quantity
    counts (Student's t with ``repeats`` degrees of freedom at ``alpha / tests``, two-sided;
    None when nothing was tested).

    ``rows``: at each common step before the first that counts, the quantity closest to counting
    (the highest score) where anything differs, and at that first step every quantity that differs;
    ``first_noisy_step``: the first step where A and its repeats differ (the noise starts);
    ``state_left_out``: the recorded state differed among the repeats, so it was not compared.
    """

    repeats: int
    alpha: float
    tests: int = 0
    critical: float | None = None
    rows: list[NoiseRow] = field(default_factory=list)
    first_noisy_step: int | None = None
    state_left_out: bool = False

    @property
    def exceeded(self) -> list[NoiseRow]:
        return [r for r in self.rows if r.exceeded]


class _Value(NamedTuple):
    """A quantity in one run at one step."""

    value: float | None  # a scalar's value or a tensor's norm
    fp: Any  # a tensor's fingerprint (``(kind, value)`` for a kind other than xxh3), None for a scalar
    nonfinite: int


Values = dict[int, dict[tuple[str, str], _Value]]


def _values(run: Any, kinds: Sequence[str], scalar_left_out: Any) -> Values:
    """step -> (kind, name) -> its value or norm, fingerprint and non-finite count."""
    out: Values = {}
    fp_kinds = fp_kind_map(run.catalog)
    for name, by_step in scalar_table(run.scalar_rows()).items():
        if scalar_left_out(name):
            continue
        for step, v in by_step.items():
            out.setdefault(step, {})[("scalar", name)] = _Value(v, None, 0)
    # (unpacked by name: STAT_ROW_COLUMNS; one more column fails here, not reads the wrong one)
    for (step, kind, name, _dtype, _shape, _numel, nan, posinf, neginf, _min, _max, _mean, _std, norm, _zero_frac,
         fingerprint, _stored) in run.catalog.stat_rows():
        if kind in kinds:
            fk = fp_kinds.get((kind, name), XXH3)
            fp = fingerprint if fk == XXH3 else (fk, fingerprint)
            out.setdefault(step, {})[(kind, name)] = _Value(norm, fp, (nan or 0) + (posinf or 0) + (neginf or 0))
    return out


def _same(x: _Value, y: _Value) -> bool:
    """Bit for bit the same quantity: the same value (or norm) and fingerprint."""
    return (x.value, x.fp) == (y.value, y.fp)


def _num(v: float | None) -> float:
    return math.nan if v is None else float(v)


def fp_kind(x: _Value) -> str:
    """The fingerprint kind of a :func:`_values` entry."""
    return str(x.fp[0]) if isinstance(x.fp, tuple) else XXH3


def _exact_row(step: int, key: tuple[str, str], a: _Value, b: _Value) -> NoiseRow | None:
    """Before the noise starts: B against A exactly (A and every repeat agree here)."""
    kind, name = key
    va, vb = _num(a.value), _num(b.value)
    d = abs(vb - va) if not (math.isnan(va) or math.isnan(vb)) else (0.0 if math.isnan(va) and math.isnan(vb)
                                                                        else math.inf)
    if kind == "scalar":
        if a.value == b.value or (math.isnan(va) and math.isnan(vb)):
            return None
        return NoiseRow(step, kind, name, "value", a.value, b.value, d, 0.0, math.inf, True)
    if fp_kind(b) == fp_kind(a):
        if b.fp == a.fp:
            return None
        return NoiseRow(step, kind, name, "bytes", a.value, b.value, d if d > 0 else math.inf, 0.0, math.inf, True)
    # B fingerprints in another kind: its bytes are not comparable, its norm is (to its resolution).
    exceeded = d > abs(va) * _F32_EPS or (b.nonfinite != a.nonfinite)
    if d == 0 and not exceeded:
        return None
    return NoiseRow(step, kind, name, "norm", a.value, b.value, d, 0.0, math.inf if exceeded else 0.0, exceeded)


class _Stage(NamedTuple):
    """The tested stage (from the first noisy step on) as arrays, and the decision over it."""

    steps: list[int]
    keys: list[tuple[str, str]]
    present: np.ndarray  # (steps, keys): the quantity is in A, B and every repeat at that step
    a: np.ndarray
    b: np.ndarray
    reps: np.ndarray
    events: np.ndarray  # non-finite events: count whatever the noise
    test: NoiseTest


def _common_keys(step: int, va: Values, vb: Values, reps: list[Values]) -> set[tuple[str, str]]:
    keys = set(va[step]) & set(vb[step])
    for r in reps:
        keys &= set(r[step])
    return keys


def _stage(steps: list[int], va: Values, vb: Values, reps: list[Values], alpha: float) -> _Stage:
    """The arrays of the tested stage and the decision over them."""
    keys = sorted({k for s in steps for k in _common_keys(s, va, vb, reps)})
    col = {k: j for j, k in enumerate(keys)}
    shape = (len(steps), len(keys))
    a, b = np.full(shape, np.nan), np.full(shape, np.nan)
    r = np.full((len(reps), *shape), np.nan)
    present, events = np.zeros(shape, bool), np.zeros(shape, bool)
    for i, s in enumerate(steps):
        for key in _common_keys(s, va, vb, reps):
            j = col[key]
            xa, xb, xr = va[s][key], vb[s][key], [v[s][key] for v in reps]
            present[i, j] = True
            a[i, j], b[i, j] = _num(xa.value), _num(xb.value)
            r[:, i, j] = [_num(x.value) for x in xr]
            kind, _name = key
            if kind != "scalar" and xb.nonfinite != xa.nonfinite and all(x.nonfinite == xa.nonfinite for x in xr):
                events[i, j] = True
    all_nan = present & np.isnan(a) & np.isnan(r).all(axis=0)
    events |= all_nan & np.isfinite(b)
    tested = present & np.isfinite(a) & np.isfinite(r).all(axis=0)
    resolution = np.nan_to_num(np.abs(a) * _F32_EPS)
    test = noise_test(np.nan_to_num(a), np.nan_to_num(r), b, alpha=alpha, resolution=resolution, tested=tested)
    return _Stage(steps, keys, present, a, b, r, events, test)


def _stage_row(st: _Stage, i: int, j: int, va: Values, vb: Values, reps: list[Values]) -> NoiseRow | None:
    """Row (i, j) of the tested stage; None where A, B and every repeat agree bit for bit."""
    step, key = st.steps[i], st.keys[j]
    kind, name = key
    xa, xb = va[step][key], vb[step][key]
    if all(_same(v[step][key], xa) for v in reps) and _same(xb, xa):
        return None
    fa, fb = float(st.a[i, j]), float(st.b[i, j])
    d = abs(fb - fa) if not (math.isnan(fa) or math.isnan(fb)) else (0.0 if math.isnan(fa) and math.isnan(fb)
                                                                      else math.inf)
    event = bool(st.events[i, j])
    tested = bool(np.isfinite(st.test.sd[i, j]))
    spread = float(st.test.sd[i, j]) if tested else math.inf
    score = math.inf if event else float(st.test.score[i, j]) if tested else 0.0
    measure = "non-finite" if event else "value" if kind == "scalar" else "norm"
    return NoiseRow(step, kind, name, measure, xa.value, xb.value, d, spread, score,
                    event or bool(st.test.exceeded[i, j]))


def noise_diff(run_a: Any, run_b: Any, noise: Sequence[Any], kinds: Sequence[str], left_out: Any,
               alpha: float = ALPHA, *, exact: Callable[..., DiffResult]) -> DiffResult:
    """:func:`stepdump.diff` with ``noise=``: see the module docstring. Returns a DiffResult with
    ``noise`` set; ``first_step`` is the first step where something counts. ``exact`` is
    :func:`stepdump.diff` itself (passed in: it compares the recorded state exactly, and diff.py
    calls this function)."""
    check_alpha(alpha)
    for r in (run_a, run_b, *noise):
        if [k for k, _ in r.stores()] != [None] or not hasattr(r, "catalog"):
            raise ConfigError(f"diff with noise= compares single stores; {r.path} is a multi-rank or joint run: "
                              "compare one rank or pair of each")
    # The recorded state, exactly: A against B, and A against each repeat (noise there, if any).
    state_ignore = [*left_out.listed, "scalars", "rng"]
    state = exact(run_a, run_b, kinds=(), ignore=state_ignore)
    state_noise = [exact(run_a, r, kinds=(), ignore=state_ignore) for r in noise]
    nd = NoiseDiff(len(noise), alpha)
    result = DiffResult(first_step=None, tensors=[], steps_compared=0, ignored=left_out.listed,
                        config=state.config, noise=nd)
    noisy_state = [s.first_step for s in state_noise if s.first_step is not None]
    nd.state_left_out = bool(noisy_state)
    state_step = None if nd.state_left_out else state.first_step

    va, vb = _values(run_a, kinds, left_out.scalar), _values(run_b, kinds, left_out.scalar)
    reps = [_values(r, kinds, left_out.scalar) for r in noise]
    steps = set(va) & set(vb)
    for v in reps:
        steps &= set(v)
    common = sorted(steps)
    result.steps_compared = result.coverage.steps = len(common)
    keys_seen: set[tuple[str, str]] = set()
    for step in common:
        keys = _common_keys(step, va, vb, reps)
        keys_seen |= keys
        for key in sorted(keys):
            kind, _name = key
            result.coverage.tensor_checks += kind != "scalar"
            if kind != "scalar" and fp_kind(vb[step][key]) != fp_kind(va[step][key]):
                cov = result.coverage  # bytes not compared: never "identical" (diff_result.Coverage)
                cov.fp_kinds_differ += 1
                if cov.fp_kinds_differ_first is None:
                    cov.fp_kinds_differ_first = (step, *key, fp_kind(va[step][key]), fp_kind(vb[step][key]))
            if nd.first_noisy_step is None and any(r[step][key][:2] != va[step][key][:2] for r in reps):
                nd.first_noisy_step = step

    # Before the noise starts: exact, up to the first difference.
    quiet = [s for s in common if nd.first_noisy_step is None or s < nd.first_noisy_step]
    first_exact: int | None = None
    for step in quiet:
        rows = [row for key in sorted(_common_keys(step, va, vb, reps))
                if (row := _exact_row(step, key, va[step][key], vb[step][key])) is not None]
        if rows:
            first_exact = step
            nd.rows.extend(rows)
            break
    # From the noise on: every quantity at every step is one test of the run-level decision.
    noisy = [s for s in common if nd.first_noisy_step is not None and s >= nd.first_noisy_step]
    st = _stage(noisy, va, vb, reps, alpha) if noisy else None
    first_tested: int | None = None
    if st is not None:
        nd.tests, nd.critical = st.test.tests, st.test.critical
        hit = np.flatnonzero((st.test.exceeded | st.events).any(axis=1))
        first_tested = st.steps[int(hit[0])] if hit.size else None
    first = min((s for s in (state_step, first_exact, first_tested) if s is not None), default=None)
    if first_exact is not None and first_exact != first:
        nd.rows = []
    if st is not None:
        nd.rows.extend(_stage_rows(st, first, va, vb, reps))

    result.coverage.tensors = sum(kind != "scalar" for kind, _ in keys_seen)
    result.coverage.kinds = sorted({k for k, _ in keys_seen if k != "scalar"})
    result.coverage.scalars = sorted(n for k, n in keys_seen if k == "scalar")
    result.first_step = first
    if first is not None:
        result.differences = _differences(first, nd, state if state_step == first else None)
        result.first_tensor_step = min((r.step for r in nd.exceeded if r.kind != "scalar"), default=None)
    result.reading = _reading(result, nd)
    result.notes = _notes(nd, noisy_state, first is not None and first == first_exact)
    return result


def _stage_rows(st: _Stage, first: int | None, va: Values, vb: Values, reps: list[Values]) -> list[NoiseRow]:
    """Up to ``first``: each step's closest call, then every quantity that differs at ``first``."""
    rows: list[NoiseRow] = []
    score = np.where(st.events, np.inf, np.nan_to_num(st.test.score, nan=-1.0))
    for i, step in enumerate(st.steps):
        if first is not None and step > first:
            break
        if step == first:
            rows.extend(row for j in range(len(st.keys)) if st.present[i, j]
                        and (row := _stage_row(st, i, j, va, vb, reps)) is not None)
        elif st.present[i].any():
            j = int(np.argmax(np.where(st.present[i], score[i], -np.inf)))
            if (row := _stage_row(st, i, j, va, vb, reps)) is not None:
                rows.append(row)
    return rows


def _differences(step: int, nd: NoiseDiff, state: Any) -> list[Difference]:
    items = list(state.differences) if state is not None else []
    seen = {(d.stage, d.what) for d in items}
    for r in sorted((r for r in nd.exceeded if r.step == step), key=lambda r: -r.score):
        stage = scalar_stage(r.name) if r.kind == "scalar" else KIND_STAGE.get(r.kind, "optimizer")
        what = scalar_label(r.name) if r.kind == "scalar" else f"{r.kind} {r.name}"
        if (stage, what) not in seen:
            seen.add((stage, what))
            items.append(Difference(step, stage, what, r.a, r.b))
    return sorted(items, key=lambda d: STAGES.index(d.stage) if d.stage in STAGES else len(STAGES))


def percent(alpha: float) -> str:
    """``0.01`` -> ``"1%"``."""
    return f"{alpha * 100:g}%"


def _rate(nd: NoiseDiff) -> str:
    return f"at most {percent(nd.alpha)} false alarms over the run's {nd.tests} tests"


def _reading(res: Any, nd: NoiseDiff) -> str:
    n = f"A and its {nd.repeats} repeat(s)"
    if res.first_step is None:
        return f"no quantity stands out from {n} ({_rate(nd)})" if nd.tests else ""
    cause = res.differences[0] if res.differences else None
    row = next((r for r in nd.exceeded if r.step == res.first_step and cause is not None
                and cause.what in (f"{r.kind} {r.name}", scalar_label(r.name))), None)
    what = cause.what if cause is not None else "?"
    if row is None or row.spread == 0:
        how = f"{what} differs where {n} agree bit for bit (the exact diff's verdict)"
    elif row.measure == "non-finite":
        how = f"{what}: its non-finite values differ from A's where {n} agree"
    elif row.spread <= abs(_num(row.a)) * _F32_EPS:
        how = (f"{what} differs from A by {row.difference:.3g} where {n} agree to its float32 resolution "
               f"({row.spread:.3g}); a quantity counts above {nd.critical:.3g} times that, for {_rate(nd)}")
    else:
        how = (f"{what} differs from A by {row.difference:.3g}, {row.score:.3g} standard deviations of the noise "
               f"among {n} ({row.spread:.3g}); a quantity counts above {nd.critical:.3g}, for {_rate(nd)}")
    before = "" if res.first_step == 0 or nd.first_noisy_step is None or nd.first_noisy_step >= res.first_step \
        else f"; from step {nd.first_noisy_step} to {res.first_step - 1} nothing stands out from the noise"
    return f"step {res.first_step}: {how}{before}"


def _notes(nd: NoiseDiff, noisy_state: list[int], exact_first: bool) -> list[str]:
    k, pct = nd.repeats, percent(nd.alpha)
    notes = []
    if nd.tests and nd.critical is not None:
        notes.append(f"run-level false-alarm rate {pct}: were B another repeat of A, something would count "
                     f"anywhere in the run with probability at most {pct} (each quantity at each step from step "
                     f"{nd.first_noisy_step} on is a Student t test against A and its {k} repeat(s), "
                     f"Bonferroni over the {nd.tests} tests: a quantity counts beyond {nd.critical:.3g} standard "
                     "deviations of the noise; tensors by norm)")
        if nd.critical > _SHARP:
            better = next((m for m in range(k + 1, 65) if critical_value(nd.alpha, nd.tests, m) <= _SHARP), None)
            more = (f"; {better} repeats would see changes beyond about {critical_value(nd.alpha, nd.tests, better):.3g}"
                    if better is not None else "")
            notes.append(f"with {k} repeat(s) only changes beyond about {nd.critical:.3g} times the noise can be "
                         f"seen{more}")
    if nd.first_noisy_step is not None:
        notes.append(f"A and its repeats differ from step {nd.first_noisy_step} on (the noise); before, B is "
                     "compared exactly")
    else:
        notes.append("A and its repeats are identical: this is the exact diff")
    if exact_first:
        notes.append(f"where A and its repeats agree bit for bit B is compared exactly; were the noise intermittent, "
                     f"B could by chance be the first of the {k + 2} runs to show it (probability at most 1/{k + 2})")
    if noisy_state:
        notes.append(f"the recorded state of a repeat differs from A's (from step {min(noisy_state)}): the state "
                     "was left out of the comparison")
    return notes
