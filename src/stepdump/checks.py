"""Public API for checks: run them, tune the built-in rules, write your own.

Everything docs/checks.md shows is importable from here::

    from stepdump.checks import Finding, LossSpike, Rule, Severity, register_rule

* :func:`check` (also ``stepdump.check``) runs rules over a run and returns
  :class:`Finding` objects ordered by step and :class:`Severity`;
* the built-in rules are frozen keyword-only dataclasses (:class:`LossSpike`,
  :class:`NanInf`, ...); :data:`DEFAULT_RULES` is the set run when none is named,
  :func:`rule_names` every name ``check(rules=[...])`` accepts;
* a rule of your own subclasses :class:`Rule` (and :func:`register_rule` makes it
  selectable by name) or is any named callable (:class:`RuleLike`); the
  ``check_*`` helpers validate its options with the same messages as the
  built-in rules. A rule receives a :class:`CachedRun`.

The implementation lives in the internal package ``stepdump.analysis``; import
from here, whose names are kept stable.
"""

from __future__ import annotations

# cross_rank is imported for its side effect too: it registers the "cross_rank"
# rule, so that check(rules=["cross_rank"]) and rule_names() know it.
from stepdump.analysis.checks import DEFAULT_RULES, CachedRun, check, rule_names
from stepdump.analysis.cross_rank import CrossRank, cross_rank
from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules import (
    DeadUnits,
    ExplodingGradient,
    LossNotDecreasing,
    LossSpike,
    LrJump,
    NanInf,
    OptimizerState,
    RecordingStopped,
    UnchangedTensor,
    UpdateRatio,
    VanishingGradient,
    WeightNormGrowth,
)
from stepdump.analysis.rules.base import (
    Rule,
    RuleLike,
    check_fraction,
    check_globs,
    check_int,
    check_kinds,
    check_non_negative,
    check_positive,
    register_rule,
)

__all__ = [
    "DEFAULT_RULES",
    "CachedRun",
    "CrossRank",
    "DeadUnits",
    "ExplodingGradient",
    "Finding",
    "LossNotDecreasing",
    "LossSpike",
    "LrJump",
    "NanInf",
    "OptimizerState",
    "RecordingStopped",
    "Rule",
    "RuleLike",
    "Severity",
    "UnchangedTensor",
    "UpdateRatio",
    "VanishingGradient",
    "WeightNormGrowth",
    "check",
    "check_fraction",
    "check_globs",
    "check_int",
    "check_kinds",
    "check_non_negative",
    "check_positive",
    "cross_rank",
    "register_rule",
    "rule_names",
]
