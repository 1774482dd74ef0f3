"""Classes named by module and qualified name: ``"transformers.optimization:Adafactor"``.

A bare class name is not an identity: torch.optim has an ``Adafactor`` and so has
transformers, with other state and another update. A run names the classes of its model,
optimizer and scheduler as ``module:qualname`` (meta ``classes``, FORMAT.md); the bare
``*_class`` names stay for display and for runs recorded before. Nothing here imports a
module a run names: a reader only *compares* names, and resolves a torch.optim class by
looking it up in torch.optim and checking that its own module and name are the recorded ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def class_id(cls: type) -> str:
    """``module:qualname`` of ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def dotted(cid: str) -> str:
    """``module.qualname``, as a person writes a class (in messages)."""
    return cid.replace(":", ".", 1)


def classes_meta(model: Any, optimizer: Any, scheduler: Any) -> dict[str, str | None]:
    """The run's meta ``classes``: each object's class as ``module:qualname`` (None: no scheduler)."""
    return {"model": class_id(type(model)), "optimizer": class_id(type(optimizer)),
            "scheduler": class_id(type(scheduler)) if scheduler is not None else None}


def recorded_class(meta: Mapping[str, Any], role: str) -> tuple[str | None, str | None]:
    """``(module:qualname or None, bare name or None)`` of the ``role`` (``"optimizer"``...) a run
    recorded; a run from before ``classes`` has only the bare name."""
    classes = meta.get("classes")
    cid = classes.get(role) if isinstance(classes, dict) else None
    name = meta.get(f"{role}_class")
    return (cid if isinstance(cid, str) else None), (name if isinstance(name, str) else None)


def same_class(obj: Any, meta: Mapping[str, Any], role: str) -> bool:
    """Whether ``obj`` is of the class the run recorded for ``role`` (by module and qualified name;
    by bare name for a run that recorded only that; True when the run recorded neither)."""
    cid, name = recorded_class(meta, role)
    if cid is not None:
        return class_id(type(obj)) == cid
    return name is None or type(obj).__name__ == name


def described(meta: Mapping[str, Any], role: str) -> str:
    """The recorded class of ``role`` for a message: ``transformers.optimization.Adafactor``, or the
    bare name of an older run."""
    cid, name = recorded_class(meta, role)
    return dotted(cid) if cid is not None else str(name)


def torch_optimizer(meta: Mapping[str, Any]) -> type[torch.optim.Optimizer] | None:
    """The torch.optim class the run's optimizer is, or None when it is not one (another
    library's, a user's subclass). A run from before ``classes`` is resolved by bare name."""
    cid, name = recorded_class(meta, "optimizer")
    bare = cid.rpartition(":")[2] if cid is not None else name
    cls = getattr(torch.optim, bare, None) if isinstance(bare, str) and bare.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return None
    if cid is not None and class_id(cls) != cid:
        return None
    return cls


def is_torch_optimizer(cls: type) -> bool:
    """Whether ``cls`` is one of torch.optim's own optimizer classes (not a subclass of one)."""
    return isinstance(cls, type) and getattr(torch.optim, cls.__name__, None) is cls \
        and issubclass(cls, torch.optim.Optimizer)
