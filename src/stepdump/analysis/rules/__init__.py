"""The built-in check rules, one idea per module.

* :mod:`.nonfinite` -- ``nan_inf``
* :mod:`.gradients` -- ``exploding_gradient``, ``vanishing_gradient``, ``dead_units``
* :mod:`.loss` -- ``loss_spike``, ``loss_not_decreasing``
* :mod:`.lr` -- ``lr_jump``
* :mod:`.params` -- ``weight_norm_growth``, ``update_ratio``
* :mod:`.unchanged` -- ``unchanged_tensor``
* :mod:`.optimizer` -- ``optimizer_state``
* :mod:`.recording` -- ``recording_stopped``
* :mod:`.reexecution` -- ``reexecution``
* :mod:`.model_changed` -- ``model_changed``

Importing this package registers them (see :func:`.base.register_rule`).
Helpers the rules share: :mod:`._roles` (which scalar is the objective),
:mod:`._frames` (series from stats frames), :mod:`._walk` (one walk over the tensors' histories,
shared by the rules that judge each tensor),
:mod:`._gradnorm` (the grad norm before clipping), :mod:`._damage` (what the
loss did after a flagged step, which sets the severity).
"""

from __future__ import annotations

from stepdump.analysis.rules.base import Rule, RuleLike, register_rule, registered_rules
from stepdump.analysis.rules.gradients import (
    DeadUnits,
    ExplodingGradient,
    VanishingGradient,
)
from stepdump.analysis.rules.loss import LossNotDecreasing, LossSpike
from stepdump.analysis.rules.lr import LrJump
from stepdump.analysis.rules.model_changed import ModelChanged
from stepdump.analysis.rules.nonfinite import NanInf
from stepdump.analysis.rules.optimizer import OptimizerState
from stepdump.analysis.rules.params import UpdateRatio, WeightNormGrowth
from stepdump.analysis.rules.recording import RecordingStopped
from stepdump.analysis.rules.reexecution import Reexecution
from stepdump.analysis.rules.unchanged import UnchangedTensor

# The rules stepdump.check runs when none are named, in this order.
DEFAULT_RULES: tuple[type[Rule], ...] = (
    NanInf,
    ExplodingGradient,
    VanishingGradient,
    LossSpike,
    LossNotDecreasing,
    LrJump,
    UpdateRatio,
    UnchangedTensor,
    DeadUnits,
    WeightNormGrowth,
    OptimizerState,
    RecordingStopped,
    Reexecution,
    ModelChanged,
)

__all__ = [
    "DEFAULT_RULES",
    "DeadUnits",
    "ExplodingGradient",
    "LossNotDecreasing",
    "LossSpike",
    "LrJump",
    "ModelChanged",
    "NanInf",
    "OptimizerState",
    "RecordingStopped",
    "Reexecution",
    "Rule",
    "RuleLike",
    "UnchangedTensor",
    "UpdateRatio",
    "VanishingGradient",
    "WeightNormGrowth",
    "register_rule",
    "registered_rules",
]
