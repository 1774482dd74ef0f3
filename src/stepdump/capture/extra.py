"""Extra state: objects with ``state_dict`` / ``load_state_dict`` recorded beside the model.

``Recorder(..., extra_state={"ema": ema_model, "swa": averaged})`` records each object's
``state_dict()`` as it is when update *t* begins (the optimizer's pre-hook, with the params):
an EMA updated right after ``optimizer.step()``, as AveragedModel, timm's ModelEmaV3 and
torch-ema are used, is recorded in record *t* with every update before *t*, so restoring *t*
and redoing iteration *t* updates it exactly as the run did.

Tensors of a state_dict are stored like params (series of kind ``extra`` named
``<name>/<path in the state_dict>``, stats and fingerprints, the bytes at full steps); the rest
is typed JSON under the step state's ``extra_state``, a tensor marked ``{"$extra": ref}``
(FORMAT.md). Nothing is pickled. A gradient log also stores their stats and fingerprints at
every step, so a rebuilt EMA can be verified (read/extra_rebuild.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepdump.capture.step_state import Entry
from stepdump.errors import ConfigError

KIND = "extra"  # the series kind of extra-state tensors (store/format.py INTERNAL_KINDS)


def check_extra_state(objects: Any) -> dict[str, Any] | None:
    """``extra_state=`` as a dict of name -> object, checked (None or empty: nothing)."""
    if objects is None:
        return None
    if not isinstance(objects, Mapping):
        raise ConfigError(f"extra_state= takes a dict of name -> object with state_dict() and load_state_dict() "
                          f"(e.g. extra_state={{'ema': ema_model}}), got {type(objects).__name__}")
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("$"):
            raise ConfigError(f"extra_state name {name!r}: give a non-empty string without '/' (it names the "
                              "object's tensors, '<name>/<key>'), not starting with '$'")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"extra_state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                              "load_state_dict(); give the object itself (an AveragedModel, an EMA helper)")
    return dict(objects) or None


def update_rule(obj: Any) -> dict[str, Any] | None:
    """How the object changes between records, where stepdump can re-apply it on read (a gradient
    log rebuilds it): ``torch.optim.swa_utils.AveragedModel`` with its default average or one of
    the ``get_ema_*`` / ``get_swa_*`` functions of ``swa_utils``. None: unknown (any other
    object, another averaging function), so a gradient log refuses to rebuild it."""
    from torch.optim.swa_utils import AveragedModel

    if not isinstance(obj, AveragedModel):
        return None
    avg_fn, multi = getattr(obj, "avg_fn", None), getattr(obj, "multi_avg_fn", None)
    rule: dict[str, Any] = {"class": "AveragedModel", "use_buffers": bool(getattr(obj, "use_buffers", False))}
    if avg_fn is None and multi is None:
        return {**rule, "avg": "default"}
    fn = multi if multi is not None else avg_fn
    known = _swa_utils_function(fn)
    if known is None:
        return None
    return {**rule, "avg": known[0], **known[1], "multi": multi is not None}


def _swa_utils_function(fn: Any) -> tuple[str, dict[str, Any]] | None:
    """(factory name, its arguments) of a function made by a ``torch.optim.swa_utils.get_*_fn``
    factory, read from its closure; None for anything else."""
    import inspect

    try:
        fn = inspect.unwrap(fn)  # get_ema_multi_avg_fn's function is wrapped by torch.no_grad()
    except ValueError:
        return None
    code = getattr(fn, "__code__", None)
    qual = getattr(fn, "__qualname__", "")
    if code is None or getattr(fn, "__module__", None) != "torch.optim.swa_utils" or ".<locals>." not in qual:
        return None
    factory = qual.split(".<locals>.")[0]
    if factory not in ("get_ema_multi_avg_fn", "get_ema_avg_fn", "get_swa_multi_avg_fn", "get_swa_avg_fn"):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    args = {}
    if factory.startswith("get_ema"):  # the decay it was made with (swa has no argument)
        decay = cells.get("decay")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            return None
        args["decay"] = float(decay)
    return factory, args


def extra_meta(objects: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run meta ``extra_state``: each object's class and the update rule a reader may re-apply."""
    if not objects:
        return {}
    return {"extra_state": {name: {"class": type(obj).__name__, "update": update_rule(obj)}
                            for name, obj in objects.items()}}


def take(objects: Mapping[str, Any], full: bool, entries: list[Entry]) -> dict[str, Any]:
    """Each object's ``state_dict()`` now: the typed-JSON tree (tensors as ``{"$extra": ref}``) by
    name, its tensors appended to ``entries`` (of kind ``extra``, named by their ref)."""
    from stepdump.core import tjson

    def put(ref: str, tensor: torch.Tensor) -> None:
        entries.append(Entry(KIND, ref, tensor.detach(), full))

    tree: dict[str, Any] = {}
    for name, obj in objects.items():
        tree[name] = tjson.encode(obj.state_dict(), put, path=name, tag="$extra")
    return tree
