"""``stepdump.localize``: where two setups re-executing one recorded step first part, by module or by op.

``level="module"`` is :func:`stepdump.analysis.localize.localize` (forward and backward hooks on
every module, a tolerance allowed); ``level="op"`` is :func:`stepdump.reexec.ops.localize_ops`
(the op tracer, bitwise, the engine ``reexecute`` uses). The public name lives here, above both,
because analysis/ may not import the re-execution engine (tests/test_layers.py).
"""

from __future__ import annotations

from typing import Any, Literal, overload

from stepdump.analysis.localize import Localization, Setup
from stepdump.analysis.localize import localize as module_localize
from stepdump.errors import ConfigError
from stepdump.reexec.ops import OpLocalization, localize_ops

LEVELS = ("module", "op")


@overload
def localize(run: Any, step: int, a: Setup | tuple, b: Setup | tuple, *, level: Literal["module"] = ...,
             atol: float = ..., rtol: float = ..., batch: Any = ...) -> Localization: ...


@overload
def localize(run: Any, step: int, a: Setup | tuple, b: Setup | tuple, *, level: Literal["op"],
             atol: float = ..., rtol: float = ..., batch: Any = ...) -> OpLocalization: ...


def localize(run: Any, step: int, a: Setup | tuple, b: Setup | tuple, *, level: str = "module",
             atol: float = 0.0, rtol: float = 0.0, batch: Any = None) -> Localization | OpLocalization:
    """Re-execute ``step`` of ``run`` in setups ``a`` and ``b`` and name where they first part.

    Each setup is ``Setup(model, optimizer, train_step)`` or a tuple of those three, built as the
    recorded loop built them (the two models use the same parameter names).

    Args:
        level: ``"module"`` (default): the first module whose output differs (in forward order),
            else whose output gradient differs (in backward order), with the error's size; the run
            must hold the step in full and its batch. ``"op"``: both setups re-execute the step
            under the op tracer and the first ATen op whose output differs while its inputs are
            equal is named with its module path, phase and source line (e.g. ``aten.gelu.default``
            in a port using GELU's tanh approximation); the step's state is reached as
            :func:`stepdump.reexecute` reaches it (full, gradient log, replay from a keyframe).
        atol, rtol: Tolerances of the module level; the op level is bitwise and refuses them.
        batch: The op level only: the step's batch when the run holds only its fingerprint
            (checked against it).

    Returns:
        A :class:`stepdump.types.Localization` (module) or :class:`stepdump.types.OpLocalization` (op).
    """
    if level not in LEVELS:
        raise ConfigError(f"level={level!r}: localize works at level='module' (the default) or level='op'")
    if level == "op":
        if atol or rtol:
            raise ConfigError("level='op' compares every op's output bitwise (fingerprints): drop atol/rtol, or use "
                              "level='module' for a tolerance")
        return localize_ops(run, step, a, b, batch=batch)
    if batch is not None:
        raise ConfigError("batch= is for level='op'; level='module' feeds the batch the run stored")
    return module_localize(run, step, a, b, atol=atol, rtol=rtol)
