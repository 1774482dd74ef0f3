"""``stepdump.diff`` of two joint runs (several model/optimizer pairs): pair by pair, one result.

Pair P of run A is compared with pair P of run B (:func:`stepdump.diff` of the two stores);
the result is the earliest step where any pair differs, with every pair's differences at that
step, earliest cause first (:data:`~stepdump.analysis.diff_state.STAGES`; a tie keeps the
pairs' order). Names carry their pair (``D/lr``, ``grads G/fc.weight``); what ``rec.log``
received stays unprefixed, as the joint run shows it. Each pair's own result is in ``per_pair``.
A joint run and a single-store run, or joint runs of other pairs, are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from stepdump.analysis.diff_result import Coverage, DiffResult
from stepdump.analysis.diff_state import Difference
from stepdump.errors import ConfigError
from stepdump.read.joint import JointRun, is_joint

if TYPE_CHECKING:
    from stepdump.read.run import Run


def diff_joint(run_a: Any, run_b: Any, diff_store: Callable[[Run, Run], DiffResult]) -> DiffResult:
    """One result over the pairs of two joint runs (see the module docstring)."""
    if not (is_joint(run_a) and is_joint(run_b)):
        one = run_a if is_joint(run_a) else run_b
        raise ConfigError(f"one run is a joint run (pairs {one.pair_names}) and the other is not; compare one "
                          "pair with the single run: stepdump.diff(joint.pair('D'), single)")
    if run_a.pair_names != run_b.pair_names:
        raise ConfigError(f"run A holds pairs {run_a.pair_names} and run B {run_b.pair_names}; diff compares "
                          "joint runs pair by pair: compare one pair of each, stepdump.diff(a.pair(n), b.pair(n))")
    home = run_a.pair_names[0]
    logged = {k for _, k, _ in run_a.pair(home).scalar_rows()} | {k for _, k, _ in run_b.pair(home).scalar_rows()}
    per_pair = {n: _prefixed(n, diff_store(run_a.pair(n), run_b.pair(n)), run_a, logged if n == home else set())
                for n in run_a.pair_names}
    return _merge(per_pair)


def _prefixed(pair: str, res: DiffResult, run: JointRun, logged: set[str]) -> DiffResult:
    """``res`` with its names carrying ``pair``; ``logged``: the scalars ``rec.log`` received (unprefixed)."""
    def name(x: str) -> str:
        return x if x in logged and not _own(x) else f"{pair}/{x}"

    def diff_(d: Difference) -> Difference:
        if d.tensor is not None:
            t = replace(d.tensor, name=f"{pair}/{d.tensor.name}")
            return replace(d, what=f"{t.kind} {t.name}", tensor=t)
        return d if d.what in logged and not _own(d.what) else replace(d, what=f"{pair}/{d.what}")

    cov = res.coverage
    coverage = replace(cov, scalars=[name(s) for s in cov.scalars],
                       scalars_only_in_a=[name(s) for s in cov.scalars_only_in_a],
                       scalars_only_in_b=[name(s) for s in cov.scalars_only_in_b])
    if cov.fp_kinds_differ_first is not None:
        step, kind, tname, ka, kb = cov.fp_kinds_differ_first
        coverage.fp_kinds_differ_first = (step, kind, f"{pair}/{tname}", ka, kb)
    return replace(
        res, tensors=[replace(t, name=f"{pair}/{t.name}") for t in res.tensors],
        names_only_in_a=[(k, f"{pair}/{n}") for k, n in res.names_only_in_a],
        names_only_in_b=[(k, f"{pair}/{n}") for k, n in res.names_only_in_b],
        first_scalar_diff=None if res.first_scalar_diff is None else (res.first_scalar_diff[0],
                                                                      name(res.first_scalar_diff[1])),
        differences=[diff_(d) for d in res.differences], coverage=coverage,
        config=[(f"{pair}/{k}", a, b) for k, a, b in res.config], pair=pair)


def _own(scalar: str) -> bool:
    from stepdump.read.joint import _OWN

    return _OWN.fullmatch(scalar) is not None


def _merge(per_pair: dict[str, DiffResult]) -> DiffResult:
    results = list(per_pair.values())
    firsts = [r.first_step for r in results if r.first_step is not None]
    first = min(firsts) if firsts else None
    differences = sorted((d for r in results if r.first_step == first and first is not None for d in r.differences),
                         key=Difference.sort_key)
    tensor_steps = [r.first_tensor_step for r in results if r.first_tensor_step is not None]
    tensor_step = min(tensor_steps) if tensor_steps else None
    tensors = [t for r in results if tensor_step is not None and r.first_tensor_step == tensor_step
               for t in r.tensors]
    blind = [r for r in results if not r.comparable]
    lead = (blind[0] if blind else
            next((r for r in results if differences and differences[0] in r.differences), results[0]))
    scalar_diffs = [r.first_scalar_diff for r in results if r.first_scalar_diff is not None]

    def union(attr: str) -> list[Any]:
        out: dict[Any, None] = {}
        for r in results:
            out.update(dict.fromkeys(getattr(r, attr)))
        return list(out)

    return DiffResult(
        first_step=first, tensors=tensors, steps_compared=min(r.steps_compared for r in results),
        steps_only_in_a=sorted(set(union("steps_only_in_a"))), steps_only_in_b=sorted(set(union("steps_only_in_b"))),
        names_only_in_a=union("names_only_in_a"), names_only_in_b=union("names_only_in_b"),
        first_scalar_diff=min(scalar_diffs) if scalar_diffs else None, differences=differences,
        first_tensor_step=tensor_step, coverage=_coverage([r.coverage for r in results]),
        config=union("config"), reading=lead.reading, rng=results[0].rng, notes=union("notes"),
        ignored=results[0].ignored, pair=lead.pair if first is not None or blind else None, per_pair=per_pair)


def _coverage(parts: list[Coverage]) -> Coverage:
    """Counts added over the pairs (steps: the fewest), lists joined."""
    out = replace(parts[0])
    for f in fields(out):
        values = [getattr(c, f.name) for c in parts]
        if f.name == "steps":
            setattr(out, f.name, min(values))
        elif f.name == "fp_kinds_differ_first":  # the first pair's that has one
            setattr(out, f.name, next((v for v in values if v is not None), None))
        elif isinstance(values[0], int):
            setattr(out, f.name, sum(values))
        else:
            setattr(out, f.name, list(dict.fromkeys(x for v in values for x in v)))
    return out
