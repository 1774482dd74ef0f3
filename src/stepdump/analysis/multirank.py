"""Single-store analyses over a multi-rank run: ``check`` on every rank's store.

A :class:`~stepdump.read.ranked.DistributedRun` is one store per rank
(``run.stores()``). Rules are about one store, so they run on each rank's;
what several ranks report alike is reported once, naming the ranks. Rules
about the ranks together (``cross_rank``) see the whole run. (``verify`` and
``diff`` walk ``run.stores()`` themselves.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stepdump.analysis.cross_rank import CrossRank
from stepdump.analysis.findings import Finding
from stepdump.analysis.rule_runner import CachedRun, run_rules, sort_key
from stepdump.analysis.rank_pool import map_ranks
from stepdump.analysis.rules.base import RuleLike


def is_multirank(run: Any) -> bool:
    """True for a run recorded by ranks (its ``stores()`` name ranks)."""
    return any(r is not None for r, _ in run.stores())  # the first store tells; no need to open every rank


def finding_ranks(f: Finding) -> list[int] | None:
    """The ranks a finding of :func:`check_distributed` names (its ``rank r:`` / ``ranks a, b:``
    prefix), or None for a finding about the ranks together (``cross_rank``) or a single store."""
    word, _, rest = f.message.partition(" ")
    named, colon, _ = rest.partition(": ")
    parts = named.split(", ")
    if word not in ("rank", "ranks") or not colon or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def check_distributed(run: Any, rules: list[RuleLike], *, add_cross_rank: bool,
                      objective: str | bool | None = None) -> list[Finding]:
    """``stepdump.check`` on a multi-rank run: each rule on every rank's store, plus ``cross_rank``.

    Findings that several ranks share (same rule, step, kind, tensor, severity)
    are reported once, the message starting with the ranks (``ranks 0, 1: ...``).
    """
    if add_cross_rank and not any(getattr(r, "name", None) == CrossRank.name for r in rules):
        rules = [*rules, CrossRank()]
    whole: list[RuleLike] = [r for r in rules if isinstance(r, CrossRank)]
    per_rank = [r for r in rules if not isinstance(r, CrossRank)]
    merged: dict[tuple[Any, ...], tuple[Finding, list[int]]] = {}
    # Each rank's store in a worker process from rank_pool.PARALLEL_MIN_RANKS ranks on, else here.
    for rank, found in map_ranks(run, _rules_on, per_rank, objective) if per_rank else ():
        for f in found:
            key = (f.rule, f.step, f.kind, f.tensor, f.severity)
            if key in merged:
                merged[key][1].append(rank)
            else:
                merged[key] = (f, [rank])
    out = [replace(f, message=f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {f.message}")
           for f, rs in merged.values()]
    if whole:
        out.extend(run_rules(CachedRun(run), whole))
    return sorted(out, key=sort_key)


def _rules_on(store: Any, rules: list[RuleLike], objective: str | bool | None) -> list[Finding]:
    return run_rules(CachedRun(store, objective=objective), rules)
