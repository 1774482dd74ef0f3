"""Checking and queueing the scalars given to ``Recorder.log``."""

from __future__ import annotations

from typing import Any

import torch

from stepdump.errors import ConfigError


def check_scalar(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"log({name}=...) got a tensor of shape {tuple(value.shape)}; log a single number")
        return
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ConfigError(f"log({name}=...) got {type(value).__name__}; log numbers (float, int, 1-element tensor)")


def scalar_rows(step: int, values: dict[str, Any]) -> list[tuple[int, str, Any]]:
    # Values stay as logged (maybe CUDA tensors): the writer thread turns them
    # into floats, so the training thread never waits on a device sync for them.
    return [(step, name, v) for name, v in values.items()]
