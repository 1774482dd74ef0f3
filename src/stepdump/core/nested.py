"""Walking the nested outputs of a module (tuples, lists, dicts, dataclasses)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nest of tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}/{i}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}/{k}")
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from flatten(getattr(obj, k), f"{prefix}/{k}")
