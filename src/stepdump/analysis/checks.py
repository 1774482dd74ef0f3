"""``stepdump.check``: run rules over a recorded run and collect their findings.

A rule is a named callable ``rule(run) -> Iterable[Finding]``. The built-in
ones (see :mod:`stepdump.analysis.rules`) are frozen keyword-only dataclasses
whose fields are their thresholds; pick and tune them by name or by instance::

    stepdump.check(run)                                    # every built-in rule, defaults
    stepdump.check(run, rules=["nan_inf", LossSpike(z=8)]) # some rules, one tuned
    stepdump.check(run, config={"loss_spike": {"z": 8}})   # defaults, one tuned by name
    stepdump.check(run, objective="policy_loss")           # which logged scalar should fall

Rules only read the run. Within one call they share one read of each stats and
scalars frame (see :class:`~stepdump.analysis.rule_runner.CachedRun`), so ten rules cost about one query each.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stepdump.analysis.findings import Finding
from stepdump.analysis.rule_runner import CachedRun, rule_name, run_rules
from stepdump.analysis.rules import (
    DEFAULT_RULES,
    Rule,
    RuleLike,
    registered_rules,
)
from stepdump.analysis.rules._roles import check_declaration
from stepdump.errors import ConfigError

RuleSpec = str | Rule | type[Rule] | Callable[[Any], Iterable[Finding]]


def rule_names() -> list[str]:
    """Names that ``check(rules=[...])`` accepts: the built-in rules, then registered user rules."""
    builtin = [cls.name for cls in DEFAULT_RULES]
    return builtin + sorted(n for n in registered_rules() if n not in builtin)


def check(
    run: Any,
    rules: RuleSpec | Iterable[RuleSpec] | None = None,
    *,
    config: Mapping[str, Mapping[str, Any]] | None = None,
    objective: str | bool | None = None,
) -> list[Finding]:
    """Check a recorded run for trouble: NaN/Inf, exploding gradients, loss spikes, ...

    Args:
        run: A :class:`stepdump.types.Run` (or the path of one).
        rules: Which rules to run (default: every built-in rule). Each item is
            a rule name (``"loss_spike"``), a rule instance (``LossSpike(z=8)``),
            a :class:`Rule` subclass, or any callable ``(run) -> Iterable[Finding]``
            with a ``name`` attribute (a plain function's ``__name__`` will do).
        config: Options for rules given by name (or run by default), as
            ``{rule_name: {option: value}}``; also applied to instances of that
            name, replacing their fields.
        objective: The logged scalar whose fall means the model learns (the loss rules judge
            it), or False for a run that has none (reinforcement learning, a GAN). None (the
            default): what the run was recorded with (``Recorder(metadata={"objective": ...})``),
            else ``"loss"``, unless the logged scalars mark the run as RL or adversarial
            (docs/checks.md, "The objective").

    Returns:
        The findings of every rule, sorted by step (whole-run findings, step
        None, last), then by severity, most severe first.

    Raises:
        ConfigError: An unknown rule name or option, an invalid threshold, a
            config entry for a rule that is not run, or a rule that returns
            something other than Findings.
    """
    selected = resolve_rules(rules, config)
    check_declaration(objective)
    if isinstance(run, (str, os.PathLike)):
        from stepdump.read.opener import open as open_run

        with open_run(run) as opened:
            return _check_opened(opened, selected, rules is None, objective)
    return _check_opened(run, selected, rules is None, objective)


def _check_opened(run: Any, selected: list[RuleLike], default: bool, objective: str | bool | None) -> list[Finding]:
    from stepdump.analysis.multirank import check_distributed, is_multirank
    from stepdump.read.joint import is_joint

    if is_joint(run):  # every rule on each pair's store, findings named by pair
        from stepdump.analysis.joint_checks import check_joint

        return check_joint(run, selected, objective)
    if is_multirank(run):  # every rule on each rank's store, plus cross_rank over all of them
        return check_distributed(run, selected, add_cross_rank=default, objective=objective)
    return run_rules(CachedRun(run, objective=objective), selected)


def resolve_rules(
    rules: RuleSpec | Iterable[RuleSpec] | None = None,
    config: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[RuleLike]:
    """Turn ``check``'s ``rules`` and ``config`` arguments into rule objects (see :func:`check`)."""
    cfg = _check_config(config)
    if rules is None:
        specs: list[Any] = list(DEFAULT_RULES)
    elif isinstance(rules, (str, Rule, type)) or callable(rules):
        specs = [rules]
    else:
        try:
            specs = list(rules)
        except TypeError:
            raise ConfigError(f"rules must be a rule or an iterable of rules, got {type(rules).__name__}") from None
    used: set[str] = set()
    out: list[RuleLike] = []
    for spec in specs:
        rule = _resolve_one(spec, cfg, used)
        out.append(rule)
    unused = sorted(set(cfg) - used)
    if unused:
        raise ConfigError(
            f"config has options for {', '.join(map(repr, unused))}, which is not among the rules run "
            f"({', '.join(rule_name(r) for r in out) or 'none'})"
        )
    return out


def _check_config(config: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must map rule names to option mappings, got {type(config).__name__}")
    out = {}
    for name, opts in config.items():
        if not isinstance(opts, Mapping):
            raise ConfigError(f"config[{name!r}] must be a mapping of option -> value, got {type(opts).__name__}")
        out[str(name)] = dict(opts)
    return out


def _resolve_one(spec: Any, cfg: dict[str, dict[str, Any]], used: set[str]) -> RuleLike:
    if isinstance(spec, str):
        cls = registered_rules().get(spec)
        if cls is None:
            raise ConfigError(f"unknown rule {spec!r}; known rules: {', '.join(rule_names())}")
        used.add(spec)
        return cls.from_config(cfg.get(spec, {}))
    if isinstance(spec, type) and issubclass(spec, Rule):
        used.add(spec.name)
        return spec.from_config(cfg.get(spec.name, {}))
    if isinstance(spec, Rule):
        opts = cfg.get(spec.name)
        if opts is None:
            return spec
        used.add(spec.name)
        base = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        return type(spec).from_config({**base, **opts})
    if callable(spec):
        name = rule_name(spec)
        if not name:
            raise ConfigError(f"rule {spec!r} has no name: give it a `name` attribute (a string)")
        if name in cfg:
            raise ConfigError(f"config has options for {name!r}, a plain callable rule; configure it yourself")
        return spec  # type: ignore[no-any-return]
    raise ConfigError(
        f"a rule must be a name, a Rule, or a callable (run) -> findings; got {type(spec).__name__}"
    )
