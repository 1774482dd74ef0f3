"""Running rules over one store: the shared read-once view (:class:`CachedRun`) and the loop.

``stepdump.check`` (:mod:`stepdump.analysis.checks`) picks the rules and the kind of run;
:mod:`stepdump.analysis.multirank` and :mod:`stepdump.analysis.joint_checks` run them on
each rank's or pair's store. All three use what is here, so it sits below them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepdump.analysis.findings import Finding
from stepdump.analysis.rules._roles import DECLARED_ATTR
from stepdump.analysis.rules.base import RuleLike
from stepdump.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing pandas costs ~0.3 s
    import pandas as pd


def rule_name(rule: Any) -> str:
    """A rule's ``name`` attribute, else its ``__name__`` (a plain function), else ""."""
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        name = getattr(rule, "__name__", None)
    return name if isinstance(name, str) else ""


def run_rules(run: CachedRun, rules: list[RuleLike]) -> list[Finding]:
    """Every rule on ``run``, findings in :func:`sort_key` order; ConfigError if a rule returns something else."""
    findings: list[Finding] = []
    for rule in rules:
        result = rule(run)
        if result is None:
            continue
        for f in result:
            if not isinstance(f, Finding):
                raise ConfigError(
                    f"rule {rule_name(rule)!r} returned {type(f).__name__}; rules must return stepdump Finding objects"
                )
            findings.append(f)
    return sorted(findings, key=sort_key)


def sort_key(f: Finding) -> tuple[Any, ...]:
    """The order ``check`` returns findings in: by step (whole-run ones last), most severe first."""
    return (f.step is None, f.step or 0, -int(f.severity), f.rule, f.kind or "", f.tensor or "")


class CachedRun:
    """A read-only view of a Run for the rules of one ``check`` call.

    ``stats()``, ``scalars()``, ``scalar_rows()``, ``kinds()``, ``names()`` and the
    step lists are read once and shared (each call returns a copy, so a rule may modify what it
    gets); everything else is passed through to the Run. The view is a snapshot:
    steps a live recorder commits during the check are not seen halfway.
    ``declared_objective`` is ``check(objective=...)`` (None: not declared; see
    :mod:`stepdump.analysis.rules._roles`).
    """

    def __init__(self, run: Any, *, objective: str | bool | None = None) -> None:
        self._run = run
        self._memo: dict[Any, Any] = {}
        setattr(self, DECLARED_ATTR, objective)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._run, attr)

    def __repr__(self) -> str:
        return f"<CachedRun of {self._run!r}>"

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        try:
            hit = key in self._memo
        except TypeError:  # unhashable arguments: no caching
            return make()
        if not hit:
            self._memo[key] = make()
        return self._memo[key]

    def stats(self, kind: str | None = None, name: str | None = None, steps: Any = None) -> pd.DataFrame:
        if name is None and steps is None:
            full = self._cached(("stats",), lambda: self._run.stats())
            if kind is None:
                return full.copy()
            if kind not in self.kinds():
                return self._run.stats(kind)  # validates the kind, empty if merely absent
            return full[full["kind"] == kind].reset_index(drop=True)
        key = ("stats", kind, name, tuple(steps) if isinstance(steps, (list, range)) else steps)
        return self._cached(key, lambda: self._run.stats(kind, name, steps)).copy()

    def scalars(self, names: Any = None, steps: Any = None) -> pd.DataFrame:
        key = ("scalars", tuple(names) if isinstance(names, list) else names,
               tuple(steps) if isinstance(steps, (list, range)) else steps)
        return self._cached(key, lambda: self._run.scalars(names, steps)).copy()

    def scalar_rows(self, steps: Any = None, *, nan_only: bool = False) -> list[tuple[int, str, float | None]]:
        # Several rules ask for the logged NaNs (nan_inf, and the damage a flagged step did).
        key = ("scalar_rows", tuple(steps) if isinstance(steps, (list, range)) else steps, nan_only)
        return list(self._cached(key, lambda: self._run.scalar_rows(steps, nan_only=nan_only)))

    def kinds(self) -> list[str]:
        return list(self._cached(("kinds",), self._run.kinds))

    def names(self, kind: str = "params") -> list[str]:
        return list(self._cached(("names", kind), lambda: self._run.names(kind)))

    @property
    def steps(self) -> list[int]:
        return list(self._cached(("steps",), lambda: self._run.steps))

    @property
    def stats_steps(self) -> list[int]:
        return list(self._cached(("stats_steps",), lambda: self._run.stats_steps))

    @property
    def all_steps(self) -> list[int]:
        return list(self._cached(("all_steps",), lambda: self._run.all_steps))

    @property
    def skipped_steps(self) -> list[int]:
        return list(self._cached(("skipped_steps",), lambda: self._run.skipped_steps))
