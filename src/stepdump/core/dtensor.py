"""DTensor detection without importing ``torch.distributed.tensor``.

That import costs ~0.5 s (it pulls in sympy), and a DTensor can only exist once
its module has been imported by whoever made it, so ``sys.modules`` is enough.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
