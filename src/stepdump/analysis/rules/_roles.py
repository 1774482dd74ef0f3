"""Roles of logged scalars: which one is the *objective*, the scalar whose fall means the model learns.

The loss rules (``loss_spike``, ``loss_not_decreasing``) judge the objective; the rules that
weigh the damage a flagged step did read it too, and ``nan_inf`` puts it first among the
scalars of a step (the forward pass computes it before anything logged after backward).
It is, in this order:

1. declared to the check: ``stepdump.check(run, objective="policy_loss")``, or
   ``objective=False`` for a run that has no scalar expected to fall;
2. declared at record time: ``Recorder(..., metadata={"objective": "policy_loss"})``
   (``None``/``False`` there: no objective);
3. by default ``"loss"``, unless the logged scalars mark the run as reinforcement learning
   (:data:`RL_MARKERS`: PPO's entropy, value and policy losses, a KL estimate, returns...) or
   adversarial (:data:`ADVERSARIAL_MARKERS`: a GAN's ``D(x)``, ``D(G(z))``, generator and
   discriminator losses). Such a run's losses are not expected to fall (every rollout brings
   new targets; two models play against each other), so by default it has no objective, and
   ``loss_not_decreasing`` says so as INFO instead of judging.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from stepdump.errors import ConfigError

OBJECTIVE_META_KEY = "objective"
DEFAULT_OBJECTIVE = "loss"
# The attribute of a CachedRun that carries check(objective=...).
DECLARED_ATTR = "declared_objective"

# Globs (matched against lower-cased scalar names) of what policy-gradient RL loops log (cleanrl,
# SB3, TRL's PPO): specific on purpose; a reward model's or DPO's "rewards/..." are left out (their
# loss does fall), so such a run keeps "loss" as its objective.
RL_MARKERS = ("*entropy*", "*value_loss*", "*policy_loss*", "*pg_loss*", "v_loss", "*approx_kl*", "*approxkl*",
              "*clipfrac*", "*clip_frac*", "*loss/policy*", "*loss/value*", "*episodic_return*",
              "*episode_reward*", "ep_rew_mean")
# What GAN loops log (pytorch/examples dcgan prints D(x), D(G(z)); others name the two losses).
ADVERSARIAL_MARKERS = ("d_x", "d_g_z*", "*loss_d", "*loss_g", "*errd*", "*errg*", "*d_loss*", "*g_loss*",
                       "*loss_disc*", "*disc_loss*", "*loss_gen*", "*gen_loss*", "*d_real*", "*d_fake*")


@dataclass(frozen=True)
class Objective:
    """The objective of a run, and why.

    Attributes:
        name: The scalar whose fall means the model learns; None when the run has none.
        declared: The user named it (or said there is none), at check or record time.
        why: Why there is none (for a message), or "" when there is one.
    """

    name: str | None
    declared: bool
    why: str = ""


def check_declaration(value: Any) -> None:
    """Raise ConfigError unless ``value`` is a scalar name, None (not declared) or False (none)."""
    if value is None or value is False:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(f"objective must be the name of a logged scalar, or False for a run that has none "
                          f"(reinforcement learning, a GAN); got {value!r}")


def _marks(names: list[str], globs: tuple[str, ...]) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatchcase(n.lower(), g) for g in globs)]


def objective(run: Any) -> Objective:
    """The run's objective (module docstring)."""
    declared = getattr(run, DECLARED_ATTR, None)
    if isinstance(declared, str) and declared:
        return Objective(declared, True)
    if declared is False:
        return Objective(None, True, "declared to have no objective (check(objective=False))")
    meta = run.meta if isinstance(getattr(run, "meta", None), dict) else {}
    user = meta.get("user")
    if isinstance(user, dict) and OBJECTIVE_META_KEY in user:
        value = user[OBJECTIVE_META_KEY]
        if isinstance(value, str) and value:
            return Objective(value, True)
        if value is None or value is False:
            return Objective(None, True, "recorded with metadata objective=None (no scalar expected to fall)")
    names = [c for c in run.scalars().columns if c != "skipped"]
    for kind, globs in (("like reinforcement learning", RL_MARKERS), ("adversarial (a GAN)", ADVERSARIAL_MARKERS)):
        hits = _marks(names, globs)
        if hits:
            listed = ", ".join(repr(h) for h in hits[:3])
            return Objective(None, False, f"the run looks {kind}: it logs {listed}; such losses are not expected "
                                          "to fall")
    return Objective(DEFAULT_OBJECTIVE, False)


def damage_scalar(run: Any, chosen: str | None) -> str:
    """The scalar whose rise measures damage: the one configured, else the objective, else ``"loss"``."""
    if chosen is not None:
        return chosen
    return objective(run).name or DEFAULT_OBJECTIVE


def check_scalar_option(rule: str, option: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is None (the run's objective) or a scalar name."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{rule}: {option} must be the name of a logged scalar, or None for the run's objective; "
                          f"got {value!r}")
