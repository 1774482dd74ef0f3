"""Diff under nondeterminism: a difference counts only where it exceeds the spread among repeats.

On hardware with nondeterministic kernels two runs of the same code differ from step 0, so the
exact diff only says "diverge at step 0". Record A a few more times (the repeats) and call
``diff(a, b, noise=[a2, a3])``: per step and quantity,

* the **difference** is ``|B - A|``;
* the **spread** is the largest pairwise difference among A and its repeats;
* the difference **exceeds** the noise where it is more than ``factor`` (3) times the spread (the
  rule fairchem PR #2203 applied by hand: 3x the spread of three repeats, per quantity and step).

Quantities: every logged scalar (not the recorder's ``sys/*`` timings) by its value, and every
tensor with stats by its norm (over finite elements; a tensor whose non-finite count differs from
A's while A and the repeats agree on it exceeds; where the repeats' bytes differ, the spread is at
least the norm's float32 resolution, ``|norm| x 2**-23``, as norms that coincide after rounding
cannot show a smaller one). Where A and every repeat hold the same bytes (the
same fingerprint: spread 0), B is compared by fingerprint, bit for bit, so identical repeats give
the exact diff's verdict. The recorded state (hyperparameters, scheduler, scaler, batch) is compared
exactly, as the exact diff does; a repeat whose state differs from A's is noise there, and the state
is then left out (a note says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from stepdump.analysis.diff_result import DiffResult
from stepdump.analysis.diff_state import KIND_STAGE, STAGES, Difference, scalar_label, scalar_stage, scalar_table
from stepdump.core.hashing import XXH3
from stepdump.errors import ConfigError
from stepdump.read.rows import fp_kind_map

#: How many times the spread a difference must exceed to count.
FACTOR = 3.0
_NORM, _NONFINITE, _FP = 13, (6, 7, 8), 15  # columns of a stat_rows row
_F32_EPS = 2.0 ** -23  # float32's relative rounding: the resolution of a recorded norm


@dataclass(frozen=True)
class NoiseRow:
    """One quantity at one step: B's difference from A against the spread among A and its repeats.

    ``kind`` is a tensor kind or ``"scalar"``; ``measure`` is ``"value"`` (a scalar), ``"norm"``
    (a tensor whose bytes differ among the repeats) or ``"bytes"`` (A and every repeat hold the same
    bytes: B is compared by fingerprint, ``difference`` is then ``|norm B - norm A|`` or ``inf``).
    """

    step: int
    kind: str
    name: str
    measure: str
    a: float | None
    b: float | None
    difference: float
    spread: float
    exceeded: bool

    @property
    def ratio(self) -> float:
        """``difference / spread`` (inf where the spread is 0 and B differs)."""
        return self.difference / self.spread if self.spread else (math.inf if self.exceeded else 0.0)


@dataclass
class NoiseDiff:
    """The noise-aware part of a :class:`~stepdump.analysis.diff.DiffResult` (``result.noise``).

    ``rows``: every quantity at every common step up to the first step that exceeds (that one
    included) where B differs from A or the repeats differ among themselves; ``first_noisy_step``:
    the first step where A and its repeats differ (the noise starts); ``state_left_out``: the
    recorded state differed among the repeats, so it was not compared.
    """

    repeats: int
    factor: float
    rows: list[NoiseRow] = field(default_factory=list)
    first_noisy_step: int | None = None
    state_left_out: bool = False

    @property
    def exceeded(self) -> list[NoiseRow]:
        return [r for r in self.rows if r.exceeded]


def _values(run: Any, kinds: Sequence[str], scalar_left_out: Any) -> dict[int, dict[tuple[str, str], tuple]]:
    """step -> (kind, name) -> (value or norm, fingerprint or None, non-finite count). A
    fingerprint of a kind other than xxh3 is ``(kind, value)``: never equal to another kind's."""
    out: dict[int, dict[tuple[str, str], tuple]] = {}
    fp_kinds = fp_kind_map(run.catalog)
    for name, by_step in scalar_table(run.scalar_rows()).items():
        if scalar_left_out(name):
            continue
        for step, v in by_step.items():
            out.setdefault(step, {})[("scalar", name)] = (v, None, 0)
    for r in run.catalog.stat_rows():
        if r[1] in kinds:
            fk = fp_kinds.get((r[1], r[2]), XXH3)
            fp = r[_FP] if fk == XXH3 else (fk, r[_FP])
            out.setdefault(r[0], {})[(r[1], r[2])] = (r[_NORM], fp, sum(r[i] or 0 for i in _NONFINITE))
    return out


def _num(v: float | None) -> float:
    return math.nan if v is None else float(v)


def _row(step: int, key: tuple[str, str], a: tuple, b: tuple, reps: list[tuple], factor: float) -> NoiseRow | None:
    kind, name = key
    xs = [a, *reps]
    va, vb = _num(a[0]), _num(b[0])
    # A and the repeats bit-identical, B's fingerprint of their kind: exact. B of another kind
    # says nothing of its bytes: judged by its norm, as a tensor whose repeats differ.
    if kind != "scalar" and all(x[1] == a[1] for x in xs) and fp_kind(b) == fp_kind(a):
        if b[1] == a[1]:
            return None
        d = abs(vb - va) if not (math.isnan(va) or math.isnan(vb)) else math.inf
        return NoiseRow(step, kind, name, "bytes", a[0], b[0], d if d > 0 else math.inf, 0.0, True)
    vals = [_num(x[0]) for x in xs]
    if all(math.isnan(v) for v in vals):  # a NaN scalar (None) everywhere, or no finite element
        if math.isnan(vb):
            return None
        return NoiseRow(step, kind, name, "value" if kind == "scalar" else "norm", a[0], b[0], math.inf, 0.0, True)
    spread = math.inf if any(math.isnan(v) for v in vals) else max(
        (abs(p - q) for p, q in combinations(vals, 2)), default=0.0)
    if kind != "scalar":
        # The repeats' bytes differ here, yet their norms may coincide: a norm cannot resolve
        # differences below its own float32 rounding, so that is the least spread it can show.
        spread = max(spread, abs(va) * _F32_EPS)
    d = math.inf if math.isnan(vb) else abs(vb - va)
    nonfinite_new = kind != "scalar" and all(x[2] == a[2] for x in xs) and b[2] != a[2]
    if d == 0 and spread == 0 and not nonfinite_new:
        return None
    exceeded = nonfinite_new or d > factor * spread
    return NoiseRow(step, kind, name, "value" if kind == "scalar" else "norm", a[0], b[0], d, spread, exceeded)


def fp_kind(x: tuple) -> str:
    """The fingerprint kind of a :func:`_values` entry."""
    return str(x[1][0]) if isinstance(x[1], tuple) else XXH3


def noise_diff(run_a: Any, run_b: Any, noise: Sequence[Any], kinds: Sequence[str], left_out: Any,
               factor: float = FACTOR, *, exact: Callable[..., DiffResult]) -> DiffResult:
    """:func:`stepdump.diff` with ``noise=``: see the module docstring. Returns a DiffResult with
    ``noise`` set; ``first_step`` is the first step where something exceeds the spread.
    ``exact`` is :func:`stepdump.diff` itself (passed in: it compares the recorded state
    exactly, and diff.py calls this function)."""
    if factor <= 0:
        raise ConfigError("noise_factor must be > 0")
    for r in (run_a, run_b, *noise):
        if [k for k, _ in r.stores()] != [None] or not hasattr(r, "catalog"):
            raise ConfigError(f"diff with noise= compares single stores; {r.path} is a multi-rank or joint run: "
                              "compare one rank or pair of each")
    # The recorded state, exactly: A against B, and A against each repeat (noise there, if any).
    state_ignore = [*left_out.listed, "scalars", "rng"]
    state = exact(run_a, run_b, kinds=(), ignore=state_ignore)
    state_noise = [exact(run_a, r, kinds=(), ignore=state_ignore) for r in noise]
    nd = NoiseDiff(len(noise), factor)
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
    first: int | None = state_step
    keys_seen: set[tuple[str, str]] = set()
    for step in common:
        if first is not None and step > first:
            break
        at_a, at_b, at_r = va[step], vb[step], [v[step] for v in reps]
        keys = set(at_a) & set(at_b)
        for r in at_r:
            keys &= set(r)
        for key in sorted(keys):
            keys_seen.add(key)
            result.coverage.tensor_checks += key[0] != "scalar"
            if key[0] != "scalar" and fp_kind(at_b[key]) != fp_kind(at_a[key]):
                cov = result.coverage  # bytes not compared: never "identical" (diff_result.Coverage)
                cov.fp_kinds_differ += 1
                if cov.fp_kinds_differ_first is None:
                    cov.fp_kinds_differ_first = (step, *key, fp_kind(at_a[key]), fp_kind(at_b[key]))
            if nd.first_noisy_step is None and any(r[key][:2] != at_a[key][:2] for r in at_r):
                nd.first_noisy_step = step
            row = _row(step, key, at_a[key], at_b[key], [r[key] for r in at_r], factor)
            if row is not None:
                nd.rows.append(row)
                if row.exceeded and (first is None or step < first):
                    first = step
    result.coverage.tensors = len({k for k in keys_seen if k[0] != "scalar"})
    result.coverage.kinds = sorted({k for k, _ in keys_seen if k != "scalar"})
    result.coverage.scalars = sorted(n for k, n in keys_seen if k == "scalar")
    result.first_step = first
    if first is not None:
        result.differences = _differences(first, nd, state if state_step == first else None)
        result.first_tensor_step = min((r.step for r in nd.exceeded if r.kind != "scalar"), default=None)
    result.reading = _reading(result, nd)
    result.notes = _notes(nd, noisy_state)
    return result


def _differences(step: int, nd: NoiseDiff, state: Any) -> list[Difference]:
    items = list(state.differences) if state is not None else []
    seen = {(d.stage, d.what) for d in items}
    for r in sorted((r for r in nd.exceeded if r.step == step), key=lambda r: -r.ratio):
        stage = scalar_stage(r.name) if r.kind == "scalar" else KIND_STAGE.get(r.kind, "optimizer")
        what = scalar_label(r.name) if r.kind == "scalar" else f"{r.kind} {r.name}"
        if (stage, what) not in seen:
            seen.add((stage, what))
            items.append(Difference(step, stage, what, r.a, r.b))
    return sorted(items, key=lambda d: STAGES.index(d.stage) if d.stage in STAGES else len(STAGES))


def _reading(res: Any, nd: NoiseDiff) -> str:
    n = f"A and its {nd.repeats} repeat(s)"
    if res.first_step is None:
        return f"every difference is within {nd.factor:g}x the spread among {n}" if nd.rows else ""
    cause = res.differences[0] if res.differences else None
    row = next((r for r in nd.exceeded if r.step == res.first_step and cause is not None
                and cause.what in (f"{r.kind} {r.name}", scalar_label(r.name))), None)
    what = cause.what if cause is not None else "?"
    if row is None or row.spread == 0:
        how = f"{what} differs where {n} agree bit for bit (the exact diff's verdict)"
    else:
        how = (f"{what} differs from A by {row.difference:.3g}, {row.ratio:.1f}x the spread among {n} "
               f"({row.spread:.3g}; a difference counts above {nd.factor:g}x)")
    before = "" if res.first_step == 0 or nd.first_noisy_step is None or nd.first_noisy_step >= res.first_step \
        else f"; from step {nd.first_noisy_step} to {res.first_step - 1} every difference is within the noise"
    return f"step {res.first_step}: {how}{before}"


def _notes(nd: NoiseDiff, noisy_state: list[int]) -> list[str]:
    notes = [f"compared against the spread among A and {nd.repeats} repeat(s): a difference counts where "
             f"|B - A| > {nd.factor:g}x the largest difference among them, per quantity and step (tensors by "
             "norm; where A and every repeat hold the same bytes, bit for bit)"]
    if nd.first_noisy_step is not None:
        notes.append(f"A and its repeats differ from step {nd.first_noisy_step} on (the noise)")
    else:
        notes.append("A and its repeats are identical: this is the exact diff")
    if noisy_state:
        notes.append(f"the recorded state of a repeat differs from A's (from step {min(noisy_state)}): the state "
                     "was left out of the comparison")
    return notes
