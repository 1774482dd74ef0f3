"""Stable names for everything the optimizer steps and the model's state_dict holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stepdump.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """How tensors are named in a run.

    ``params``: name -> parameter, for every parameter of the model and every
    parameter the optimizer steps (those the model does not name are called
    ``group{i}.param{j}``). ``groups``: parameter names per optimizer param group,
    in the optimizer's order (which defines state_dict indices). ``state_dict``:
    (key, kind, name) for every entry of ``model.state_dict()``, so tied weights
    and buffers come back under all their keys. ``not_recorded``: state_dict keys
    whose value is not a tensor (a module's ``get_extra_state()``): stepdump stores
    tensors only, and restore leaves these as they are in the model it restores into.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    groups: list[list[str]]
    state_dict: list[tuple[str, str, str]]
    not_recorded: list[str] = field(default_factory=list)

    def to_meta(self) -> dict[str, object]:
        meta: dict[str, object] = {"groups": self.groups, "state_dict": [list(e) for e in self.state_dict]}
        if self.not_recorded:
            meta["not_recorded"] = self.not_recorded
        return meta


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose names a run uses: a ``torch.compile`` wrapper's inner module.

    A compiled model names its params ``_orig_mod.fc1.weight`` while its modules'
    hooks see ``fc1``; recording the inner names keeps params, grads and activations
    under one spelling, and lets a record restore into the plain or the compiled model.
    """
    seen = 0
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) and seen < 8:
        model, seen = model._orig_mod, seen + 1  # type: ignore[assignment]
    return model


def build_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> Layout:
    model = unwrap(model)
    names: dict[int, str] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        params[name] = p
    groups: list[list[str]] = []
    for i, group in enumerate(optimizer.param_groups):
        gnames = []
        for j, p in enumerate(group["params"]):
            name = names.get(id(p))
            if name is None:
                name = f"group{i}.param{j}"
                names[id(p)] = name
                params[name] = p
            gnames.append(name)
        groups.append(gnames)
    buffers: dict[str, torch.Tensor] = {}
    buffer_names: dict[int, str] = {}
    for name, b in model.named_buffers():
        buffer_names[id(b)] = name
        buffers[name] = b
    entries: list[tuple[str, str, str]] = []
    not_recorded: list[str] = []
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):  # extra state (get_extra_state): not a tensor
            not_recorded.append(key)
            continue
        if id(value) in names:
            entries.append((key, "params", names[id(value)]))
        elif id(value) in buffer_names:
            entries.append((key, "buffers", buffer_names[id(value)]))
        else:
            raise ConfigError(f"model.state_dict() entry {key!r} is neither a parameter nor a buffer")
    return Layout(params=params, buffers=buffers, groups=groups, state_dict=entries, not_recorded=not_recorded)


def param_name_map(layout: Layout) -> dict[int, str]:
    return {id(p): n for n, p in layout.params.items()}


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
    from stepdump.capture.rng import get_rng_state

    with torch.no_grad():
        return {
            "rng": get_rng_state(),
            "buffers": {n: b.detach().clone() for n, b in layout.buffers.items() if buffers is not None and buffers(n)},
        }


def state_json(state: dict[str, Any], begin: dict[str, Any] | None, batch: Any, entries: list[tuple]) -> str:
    """The record's typed-JSON state (FORMAT.md); its tensors are appended to ``entries`` as kind ``state``."""
    from stepdump.store import tjson

    if begin is not None:
        state["rng"] = begin["rng"]
    if batch is not None:
        state["batch"] = batch

    def put(ref: str, tensor: torch.Tensor) -> None:
        entries.append(("state", ref, tensor, True, None, None))

    return tjson.dumps(tjson.encode(state, put))
