"""The model's structure changing mid-run: params and buffers renamed, added or removed.

Pruning (``prune.l1_unstructured`` turns ``weight`` into ``weight_orig`` and a ``weight_mask``
buffer), ``prune.remove``, a parametrization added or removed (``parametrize``: the param moves
to ``parametrizations.weight.original``, spectral norm adds ``_u`` / ``_v`` buffers), a module
replaced: each changes the names and buffers of ``model.state_dict()``. The record must follow,
or it keeps recording what the model no longer is (a pruned layer's unmasked ``weight_orig`` under
its old name, no mask).

Walking the model every step to see this would cost a pass over every module. Every one of those
changes registers a param, buffer or module through ``nn.Module`` (``register_parameter``,
``register_buffer``, ``__setattr__``), and torch calls process-wide registration hooks there: the
watch only raises a flag, and the Assembler rebuilds and compares the layout when it is up. A
change made by writing ``module._parameters`` / ``_buffers`` directly bypasses those hooks; only
``optimizer.add_param_group`` is noticed otherwise (by the group sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.nn.modules import module as _module

from stepdump.core.layout import Layout


class StructureWatch:
    """A flag raised whenever any ``nn.Module`` registers a param, buffer or submodule."""

    def __init__(self) -> None:
        self.dirty = False
        self._handles = [
            _module.register_module_parameter_registration_hook(self._seen),
            _module.register_module_buffer_registration_hook(self._seen),
            _module.register_module_module_registration_hook(self._seen),
        ]

    def _seen(self, *args: Any) -> None:  # returns None: torch keeps the value being registered
        self.dirty = True

    def take(self) -> bool:
        """Whether a registration happened since the last call."""
        dirty, self.dirty = self.dirty, False
        return dirty

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@dataclass(frozen=True)
class StructureChange:
    """How the model's ``state_dict`` layout differs between two layouts (names by kind)."""

    added: list[str] = field(default_factory=list)  # "param 2.weight_orig", "buffer 2.weight_mask"
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def describe(self) -> str:
        parts = []
        if self.removed:
            parts.append("no longer " + ", ".join(self.removed))
        if self.added:
            parts.append("now " + ", ".join(self.added))
        return "; ".join(parts)


def structure_change(old: Layout, new: Layout) -> StructureChange:
    """The ``model.state_dict()`` entries that ``new`` has and ``old`` has not, and the reverse, and
    the params the optimizer steps that go by another name in ``new``.

    By the model's entries (key, params or buffers, recorded name): a buffer reassigned under its
    name (``self.count = self.count + 1``) is the same structure (the new layout still replaces the
    old, whose tensors are stale), and so is a param added to the optimizer alone
    (``add_param_group`` of a temperature: the groups say it, per step). A param renamed (a module
    replaced: the optimizer's old params are no longer the model's, ``group{i}.param{j}``) is a
    change: the record of a param's updates goes by its name."""
    a, b = set(old.state_dict), set(new.state_dict)

    def said(entries: set[tuple[str, str, str]]) -> list[str]:
        return sorted(f"{kind[:-1]} {key}" for key, kind, _ in entries)

    added, removed = said(b - a), said(a - b)
    name_of = {id(p): n for n, p in new.params.items()}
    for n, p in old.params.items():
        now = name_of.get(id(p))
        if now is not None and now != n:
            removed.append(f"param {n}")
            added.append(f"param {now} (was {n})")
    return StructureChange(added=sorted(set(added)), removed=sorted(set(removed)))


def _layout_before(old: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The recorded layout (meta) in effect at ``step`` of a run whose catalog meta is ``old``."""
    for e in old.get("layouts") or []:
        if isinstance(e, dict) and isinstance(e.get("until"), int) and step < e["until"]:
            return e
    layout = old.get("layout")
    return layout if isinstance(layout, dict) else None


def resumed_layouts(old: dict[str, Any], live: dict[str, Any], first: int) -> list[dict[str, Any]] | None:
    """The earlier layouts (meta ``layouts``) of a run resumed at step ``first`` with the model and
    optimizer whose layout meta is ``live``: those that ended by ``first``, and the one in effect
    just before ``first`` if the live model differs from it (the steps from ``first`` are recorded
    as the live model is). None: the live optimizer's param groups match neither the layout of step
    ``first`` nor that of ``first - 1`` (a different optimizer: the resume is refused)."""
    at, before = _layout_before(old, first), _layout_before(old, first - 1) if first > 0 else None
    if not any(x is not None and x.get("groups") == live["groups"] for x in (at, before)):
        return None
    earlier = [e for e in old.get("layouts") or [] if isinstance(e, dict) and isinstance(e.get("until"), int)
               and e["until"] <= first]
    if before is not None and before.get("state_dict") != live["state_dict"] \
            and not (earlier and earlier[-1]["until"] == first):
        earlier.append({**{k: v for k, v in before.items() if k != "until"}, "until": first})
    return earlier


def recorded_layouts(path: Path) -> list[dict[str, Any]]:
    """Meta ``layouts`` of the run at ``path`` (a resumed Recorder goes on from them)."""
    from stepdump.store.catalog import catalog_path
    from stepdump.store.queries import CatalogReader

    if not catalog_path(path).exists():
        return []
    reader = CatalogReader(path)
    try:
        earlier = reader.meta().get("layouts")
    finally:
        reader.close()
    return [e for e in earlier if isinstance(e, dict)] if isinstance(earlier, list) else []
