"""The per-step state a record holds besides tensors: optimizer/scheduler/scaler state as JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stepdump.core.layout import Layout


def full_state(layout: Layout, optimizer: torch.optim.Optimizer, scheduler: object, scaler: object) -> dict:
    """The non-tensor state of a full record: param groups by name, optimizer extras, scheduler, scaler."""
    groups = []
    for names, group in zip(layout.groups, optimizer.param_groups, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": names})
    extra: dict[str, dict[str, object]] = {}
    for n, p in layout.params.items():
        for k, v in optimizer.state.get(p, {}).items():
            # Sparse state goes here as well, kept sparse (indices + values in their order):
            # its dense series serves reading; restore needs the exact sparse tensor.
            if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
                extra.setdefault(n, {})[k] = v
    state: dict[str, object] = {"groups": groups, "optimizer_extra": extra}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()  # type: ignore[attr-defined]
    if scaler is not None:
        state["scaler"] = scaler.state_dict()  # type: ignore[attr-defined]
    return state


def tensor_entries(layout: Layout, optimizer: torch.optim.Optimizer, kinds: tuple[str, ...],
                   selected: Callable[[str], bool], full: bool, buffers: dict[str, torch.Tensor]) -> list[tuple]:
    """(kind, name, tensor, full, param, key) for every live tensor a record takes at the pre-hook."""
    out: list[tuple] = []
    params = [(n, p) for n, p in layout.params.items() if selected(n)]
    if "params" in kinds:
        out.extend(("params", n, p, full, None, None) for n, p in params)
    if "grads" in kinds:
        out.extend(("grads", n, p.grad, full, None, None) for n, p in params if p.grad is not None)
    if "optimizer" in kinds:
        for n, p in params:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out.append(("optimizer", f"{n}.{k}", v, full, n, k))
    out.extend(("buffers", n, b, True, None, None) for n, b in buffers.items())
    return out


def begin_state(layout: Layout, buffers: Callable[[str], bool] | None) -> dict[str, Any]:
    """What a record takes at the start of its iteration: the RNG state, and private
    copies of the module buffers ``buffers`` selects (None: no buffers)."""
    from stepdump.core.rng import get_rng_state

    with torch.no_grad():
        return {
            "rng": get_rng_state(),
            "buffers": {n: b.detach().clone() for n, b in layout.buffers.items() if buffers is not None and buffers(n)},
        }


def state_json(state: dict[str, Any], begin: dict[str, Any] | None, batch: Any, entries: list[tuple]) -> str:
    """The record's typed-JSON state (FORMAT.md); its tensors are appended to ``entries`` as kind ``state``."""
    from stepdump.core import tjson

    if begin is not None:
        state["rng"] = begin["rng"]
    if batch is not None:
        state["batch"] = batch

    def put(ref: str, tensor: torch.Tensor) -> None:
        entries.append(("state", ref, tensor, True, None, None))

    return tjson.dumps(tjson.encode(state, put))
