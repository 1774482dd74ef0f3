"""Stable names for everything the optimizer steps and the model's state_dict holds.

Capture names tensors with :func:`build_layout`; restore and replay rebuild the
same layout from the user's model to match recorded names to live tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ``embeddings``: names of the parameters that an ``nn.Embedding`` / ``nn.EmbeddingBag`` owns,
    whose gradient is zero outside the rows a batch looks up (by construction, not a fault:
    the checks read it).
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    groups: list[list[str]]
    state_dict: list[tuple[str, str, str]]
    not_recorded: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)

    def to_meta(self) -> dict[str, object]:
        meta: dict[str, object] = {"groups": self.groups, "state_dict": [list(e) for e in self.state_dict]}
        if self.not_recorded:
            meta["not_recorded"] = self.not_recorded
        if self.embeddings:
            meta["embeddings"] = self.embeddings
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
            known = names.get(id(p))
            if known is None:
                known = f"group{i}.param{j}"
                names[id(p)] = known
                params[known] = p
            name = known
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
    looked_up = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                 for p in m.parameters(recurse=False)}
    embeddings = [n for n, p in params.items() if id(p) in looked_up]
    return Layout(params=params, buffers=buffers, groups=groups, state_dict=entries, not_recorded=not_recorded,
                  embeddings=embeddings)
