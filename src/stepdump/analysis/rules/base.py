"""The rule interface, the registry of named rules, and argument checks for rule configs.

A rule is anything callable as ``rule(run) -> Iterable[Finding]`` that has a
``name``. The built-in rules subclass :class:`Rule`: a frozen, keyword-only
dataclass whose fields are its thresholds (with documented defaults) and
whose ``__post_init__`` rejects bad values with a :class:`~stepdump.ConfigError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from stepdump.analysis.findings import Finding, Severity
from stepdump.errors import ConfigError


@runtime_checkable
class RuleLike(Protocol):
    """What :func:`stepdump.check` accepts as a rule: a named callable."""

    @property
    def name(self) -> str: ...  # a property: a rule class's ``name`` ClassVar matches it

    def __call__(self, run: Any) -> Iterable[Finding]: ...


@dataclass(frozen=True, kw_only=True)
class Rule:
    """Base class of check rules.

    Subclass it as a ``@dataclass(frozen=True, kw_only=True)``, set the class
    attribute ``name``, put thresholds in fields with defaults, validate them
    in ``__post_init__`` and implement ``__call__(run) -> list[Finding]``.
    Build findings with :meth:`finding` so that ``rule`` is filled in. Decorate
    the class with :func:`register_rule` to make it selectable by name.
    """

    name: ClassVar[str] = ""

    def __call__(self, run: Any) -> list[Finding]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(run)")

    def finding(
        self,
        severity: Severity,
        step: int | None,
        message: str,
        *,
        kind: str | None = None,
        tensor: str | None = None,
        value: float | None = None,
        threshold: float | None = None,
        tensors: Iterable[str] = (),
    ) -> Finding:
        """A :class:`Finding` of this rule; numbers are turned into plain floats.

        ``tensors``: every tensor one cause touched, when it is more than ``tensor``
        (a grouped finding); left empty when there is only one.
        """
        grouped = tuple(str(t) for t in tensors)
        return Finding(
            rule=self.name,
            severity=severity,
            step=None if step is None else int(step),
            kind=kind,
            tensor=tensor,
            value=None if value is None else float(value),
            threshold=None if threshold is None else float(threshold),
            message=message,
            tensors=grouped if len(grouped) > 1 else (),
        )

    @classmethod
    def options(cls) -> dict[str, Any]:
        """Field name -> default value: the thresholds a user can change."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Rule:
        """Build the rule from a mapping of option -> value; unknown options raise ConfigError."""
        known = cls.options()
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ConfigError(
                f"rule {cls.name!r} has no option {', '.join(map(repr, unknown))}; "
                f"its options are {', '.join(known) or '(none)'}"
            )
        # JSON and TOML give lists where the rule wants tuples (of globs, kinds).
        config = {k: tuple(v) if isinstance(v, list) and isinstance(known[k], tuple) else v for k, v in config.items()}
        try:
            return cls(**config)
        except TypeError as e:  # a positional or duplicated argument
            raise ConfigError(f"rule {cls.name!r}: {e}") from None


_REGISTRY: dict[str, type[Rule]] = {}

R = TypeVar("R", bound=type[Rule])


def register_rule(cls: R) -> R:
    """Class decorator: make a :class:`Rule` subclass selectable by its ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise ConfigError(f"register_rule expects a Rule subclass, got {cls!r}")
    if not cls.name or not cls.name.isidentifier():
        raise ConfigError(f"{cls.__name__}.name must be a non-empty identifier, got {cls.name!r}")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise ConfigError(f"a rule named {cls.name!r} is already registered ({other.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def registered_rules() -> dict[str, type[Rule]]:
    """Name -> rule class, for every registered rule (built-in and user)."""
    return dict(_REGISTRY)


# -- option checks used in __post_init__ --------------------------------------


def _number(rule: str, option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"{rule}: {option} must be a number, got {value!r}")
    return float(value)


def check_positive(rule: str, option: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is a number > 0."""
    if _number(rule, option, value) <= 0:
        raise ConfigError(f"{rule}: {option} must be > 0, got {value!r}")


def check_non_negative(rule: str, option: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is a number >= 0."""
    if _number(rule, option, value) < 0:
        raise ConfigError(f"{rule}: {option} must be >= 0, got {value!r}")


def check_fraction(rule: str, option: str, value: Any, *, open_low: bool = True) -> None:
    """Raise ConfigError unless ``value`` is in (0, 1] (or [0, 1] with ``open_low=False``)."""
    v = _number(rule, option, value)
    if v > 1 or v < 0 or (open_low and v == 0):
        interval = "(0, 1]" if open_low else "[0, 1]"
        raise ConfigError(f"{rule}: {option} must be in {interval}, got {value!r}")


def check_int(rule: str, option: str, value: Any, minimum: int) -> None:
    """Raise ConfigError unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{rule}: {option} must be an integer >= {minimum}, got {value!r}")


def check_globs(rule: str, option: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is a tuple of glob strings."""
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{rule}: {option} must be a tuple of glob strings, got {value!r}")


def check_kinds(rule: str, option: str, value: Any, allowed: Iterable[str]) -> None:
    """Raise ConfigError unless ``value`` is a tuple of kinds from ``allowed``."""
    allowed = tuple(allowed)
    check_globs(rule, option, value)
    bad = [k for k in value if k not in allowed]
    if bad:
        raise ConfigError(f"{rule}: {option} has unknown kind(s) {bad}; choose from {', '.join(allowed)}")
