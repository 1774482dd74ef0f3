"""What the Recorder attaches to the user's objects, made safe to copy and to pickle.

Do no harm (docs/reliability.md): ``copy.deepcopy(model)`` (an EMA),
``torch.save(model)`` (a whole-model pickle), ``copy.deepcopy(optimizer)`` and
``pickle.dumps(scaler)`` are everyday lines, and each copies the hooks the Recorder
put on the object. A hook that is a bound method or a closure of the Recorder either
breaks the copy (it drags in the writer's queue, threads and locks) or, worse, is
shared by the copy, which then records its own forwards and steps into the run.

So every hook the Recorder attaches is a :class:`Hook`: while attached it calls the
Recorder, but a copy of it is never the Recorder's:

* a deep copy is :data:`INERT`, which does nothing and, at its first call on a module
  (the copy's first forward), removes itself from that module's hook dicts: the copy
  ends up with the hooks a copy made without a Recorder has;
* a pickle holds ``().__init__`` (a builtin that accepts any arguments and returns
  None) in its place, so a whole-model pickle made while recording loads without
  stepdump installed; the loaded model keeps that no-op entry in its hook dict.

``scaler.step``, which the Recorder wraps on a GradScaler instance, is a
:class:`ScalerStep`: copied or pickled with its scaler, it becomes the copy's own
``step`` method. Optimizer hooks need nothing more (torch's ``Optimizer.__getstate__``
leaves hooks out of copies and pickles); they are Hooks too, for optimizers that copy
their ``__dict__``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

# Module attributes holding the hooks the Recorder registers, and the per-id flag dicts beside them.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_FLAG_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class _Inert:
    """What a deep copy of a :class:`Hook` is: a no-op that drops itself from a module's hook dicts."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        # Safe to remove now: Module._call_impl iterates over a tuple of the hooks taken before
        # the first one runs (torch 2.x). Optimizer hooks iterate the live dict, so an inert one
        # called by an optimizer stays (torch leaves them out of optimizer copies anyway).
        if args and isinstance(args[0], torch.nn.Module) and not torch.compiler.is_compiling():
            _drop_inert(args[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return self

    def __copy__(self) -> _Inert:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _NO_OP_REDUCE

    def __repr__(self) -> str:
        return "<stepdump: inert hook of a copy (removed at its first call)>"


INERT = _Inert()

# A no-op any pickle can rebuild without stepdump: object.__init__ bound to the empty tuple
# takes any arguments and returns None (tuple has no __init__ of its own).
_NO_OP_REDUCE: tuple[Any, ...] = (getattr, ((), "__init__"))


def _drop_inert(module: torch.nn.Module) -> None:
    for attr in _HOOK_DICTS:
        hooks = getattr(module, attr, None)
        if not isinstance(hooks, dict):
            continue
        for key in [k for k, h in hooks.items() if h is INERT]:
            del hooks[key]
            for flags in _FLAG_DICTS:
                d = getattr(module, flags, None)
                if isinstance(d, dict):
                    d.pop(key, None)


class Hook:
    """A hook of the Recorder: calls ``fn`` while attached; a deep copy is :data:`INERT`,
    a pickle a stepdump-free no-op (module docstring)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return INERT

    def __copy__(self) -> Hook:
        return self  # a shallow copy of a model shares its hook dicts, and so its Recorder, already

    def __reduce__(self) -> tuple[Any, ...]:
        return _NO_OP_REDUCE

    def __repr__(self) -> str:
        return f"<stepdump hook {getattr(self.fn, '__qualname__', self.fn)!r}>"


class ScalerStep:
    """``scaler.step`` while a Recorder watches a GradScaler (``run`` does the work); copied or
    pickled with the scaler, it becomes the copy's own ``step`` method, not a Recorder's."""

    __slots__ = ("scaler", "run")

    def __init__(self, scaler: Any, run: Callable[..., Any]) -> None:
        self.scaler, self.run = scaler, run

    def __call__(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return self.run(optimizer, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # Inside deepcopy(scaler) the copy is in memo already, its __dict__ not yet filled:
        # getattr finds the class's step, bound to the copy.
        return getattr(copy.deepcopy(self.scaler, memo), "step")

    def __copy__(self) -> ScalerStep:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (self.scaler, "step"))  # rebuilt the same way when the pickle loads
