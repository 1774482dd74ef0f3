"""Rebuilding ``state_dict``-shaped objects from a recorded step.

The layout and state they are built from come from the catalog, which may be
damaged or hostile: anything not shaped as FORMAT.md says is a CorruptDataError.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stepdump.core.hashing import XXH3
from stepdump.errors import CorruptDataError, StepNotFoundError
from stepdump.read.rows import check_fingerprint, fp_kind_map, require_full

K = TypeVar("K")

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.run import Run


def check_meta(meta: dict[str, Any], path: Path) -> None:
    """Refuse, on open, meta values of the wrong type that readers use as FORMAT.md says
    they are (a time, a list of kinds, lists of parameter names): a damaged or hostile
    catalog would otherwise fail deep inside ``info``, ``check`` or a report."""
    created = meta.get("created")
    # Unix times a datetime can hold: what time.time() gave when the run was created.
    if created is not None and (not isinstance(created, (int, float)) or isinstance(created, bool)
                                or not 0 <= created < 1e11):
        _bad_meta(path, "created", created, "is not a unix time")
    capture = meta.get("capture")
    if "capture" in meta and not (isinstance(capture, list) and all(isinstance(c, str) for c in capture)):
        _bad_meta(path, "capture", capture, "is not a list of kinds")
    layout = meta.get("layout")
    if "layout" in meta:
        groups = layout.get("groups", []) if isinstance(layout, dict) else None
        if not (isinstance(groups, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                                 for g in groups)):
            _bad_meta(path, "layout", layout, "does not list the parameter names of each optimizer group")


def _bad_meta(path: Path, key: str, value: Any, what: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise CorruptDataError(f"meta {key!r} in the catalog of {path} {what} ({shown}): the catalog is damaged")


def layout_at(run: Run, step: int | None) -> dict[str, Any]:
    """The layout (FORMAT.md meta ``layout``) that record ``step`` was taken in: the model's
    structure may have changed mid-run (pruning, a parametrization), and each earlier layout is
    kept in meta ``layouts`` with the step it was replaced at (``until``). None: the latest."""
    layout = run.meta.get("layout")
    earlier = run.meta.get("layouts")
    if step is None or earlier is None:
        return layout if isinstance(layout, dict) else {}
    if not (isinstance(earlier, list) and all(isinstance(e, dict) and isinstance(e.get("until"), int)
                                              for e in earlier)):
        raise CorruptDataError(f"meta 'layouts' in the catalog of {run.path} is malformed: the catalog is damaged")
    for e in earlier:
        if step < e["until"]:
            return e
    return layout if isinstance(layout, dict) else {}


def layout_changes(run: Run) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(step, layout before, layout from then) for each change of the model's structure in the run."""
    earlier = run.meta.get("layouts")
    if not isinstance(earlier, list) or not earlier:
        return []
    layouts = [layout_at(run, e["until"] - 1) for e in earlier] + [layout_at(run, None)]
    return [(e["until"], layouts[i], layouts[i + 1]) for i, e in enumerate(earlier)]


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What changed between two layouts (meta ``layout`` objects), in words: the state_dict keys
    removed and added, else the params the optimizer steps that were renamed (a module replaced)."""
    def keys(layout: dict[str, Any]) -> dict[str, str]:
        return {key: kind for e in layout.get("state_dict", []) if isinstance(e, list) and len(e) == 3
                for key, kind, _name in (e,)}

    def stepped(layout: dict[str, Any]) -> list[str]:
        return [n for g in layout.get("groups", []) if isinstance(g, list) for n in g]

    a, b = keys(before), keys(after)
    parts = []
    if set(a) - set(b):
        parts.append("removed " + ", ".join(f"{a[k][:-1]} {k!r}" for k in sorted(set(a) - set(b))))
    if set(b) - set(a):
        parts.append("added " + ", ".join(f"{b[k][:-1]} {k!r}" for k in sorted(set(b) - set(a))))
    if not parts:
        gone = [n for n in stepped(before) if n not in stepped(after)]
        new = [n for n in stepped(after) if n not in stepped(before)]
        if gone:
            parts.append("the optimizer no longer steps " + ", ".join(repr(n) for n in gone))
        if new:
            parts.append("the optimizer steps " + ", ".join(repr(n) for n in new) + " under new names (a module "
                         "replaced: params the model no longer has are named group{i}.param{j})")
    return "; ".join(parts) or "its tensors were regrouped"


def layout_entries(run: Run, step: int | None = None) -> list[tuple[str, str, str]]:
    """(state_dict key, kind, recorded name) of record ``step``'s model (None: the latest layout)."""
    layout = layout_at(run, step)
    entries = layout.get("state_dict") if isinstance(layout, dict) else None
    if entries is None:
        raise CorruptDataError(f"{run.path} has no state_dict layout in its catalog")
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e) for e in entries
    ):
        raise CorruptDataError(f"the state_dict layout in the catalog of {run.path} is malformed")
    return [(k, kind, name) for k, kind, name in entries]


def model_state_dict(run: Run, blobs: BlobReader, step: int) -> OrderedDict[str, torch.Tensor]:
    """Params (before update ``step``) and buffers (start of iteration ``step``), by state_dict key.

    ``blobs``: the Run's blob reader (the caller's read scope is in it)."""
    require_full(run.catalog, step, run.path)
    stored = {(r.kind, r.name): r for r in run.catalog.stored_tensors(step, ("params", "buffers"))}
    fp_kinds = fp_kind_map(run.catalog)  # each row's fingerprint is of its series' kind

    def load(kind: str, name: str) -> torch.Tensor | None:
        row = stored.get((kind, name))
        return None if row is None else blobs.tensor(row.blob, row.dtype, row.shape,
                                                     check_fingerprint(row.fingerprint, run.path),
                                                     fp_kinds.get((kind, name), XXH3))

    return assemble_model_state(run, step, load)


def assemble_model_state(run: Run, step: int,
                         load: Callable[[str, str], torch.Tensor | None]) -> OrderedDict[str, torch.Tensor]:
    """The state_dict of ``step`` in the recorded layout, each entry from ``load(kind, name)``
    (None: not available at that step). One path for stored and rebuilt (gradient-log) steps."""
    entries = layout_entries(run, step)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    for key, kind, name in entries:
        ref = (kind, name)
        if ref not in loaded:
            value = load(kind, name)
            if value is None:
                raise StepNotFoundError(
                    f"step {step} of {run.path} has no {kind} {name!r}, so no full state_dict: record with "
                    "capture including 'params' and include/exclude covering every parameter"
                )
            loaded[ref] = value
        out[key] = loaded[ref]
    return out


def param_indices(groups: Iterable[Iterable[K]]) -> dict[K, int]:
    """Parameter -> its index in ``optimizer.state_dict()``: torch numbers each distinct
    parameter once, in param-group order (a parameter in two groups keeps its first index).

    ``groups``: each group's parameters, by recorded name or by any other key (``id(p)``
    of a live optimizer's parameters)."""
    index: dict[K, int] = {}
    for g in groups:
        for p in g:
            index.setdefault(p, len(index))
    return index


def optimizer_state_dict(run: Run, blobs: BlobReader, step: int,
                         read: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """The optimizer's state_dict before update ``step``, with torch's index numbering.

    ``blobs``: the Run's blob reader (the caller's read scope is in it). ``read(blob, dtype, shape,
    fingerprint, fp_kind=)``: how each tensor is read (default ``blobs.tensor``; a gradient log reads its
    keyframe into tensors of its own, see read/gradlog.py)."""
    require_full(run.catalog, step, run.path)
    state = run.step_state(step)
    read = read or blobs.tensor
    per_param: dict[str, dict[str, Any]] = {}
    fp_kinds = fp_kind_map(run.catalog)  # each row's fingerprint is of its series' kind
    for r in run.catalog.stored_tensors(step, ("optimizer",)):
        param, key = r.param, r.key
        if not isinstance(param, str) or not isinstance(key, str):
            raise CorruptDataError(f"an optimizer series of {run.path} has param {param!r} and key {key!r}")
        per_param.setdefault(param, {})[key] = read(r.blob, r.dtype, r.shape,
                                                    check_fingerprint(r.fingerprint, run.path),
                                                    fp_kind=fp_kinds.get(("optimizer", r.name), XXH3))
    return assemble_optimizer_state(run, step, state, per_param)


def recorded_groups(run: Run, step: int, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups of ``step``'s state (``{"hyper": {...}, "params": [names]}`` each), checked."""
    groups = state.get("groups")
    if groups is None:
        raise CorruptDataError(f"step {step} of {run.path} has no optimizer param groups recorded")
    malformed = CorruptDataError(f"the optimizer param groups recorded at step {step} of {run.path} are malformed")
    if not isinstance(groups, list):
        raise malformed
    for g in groups:
        if not (isinstance(g, dict) and isinstance(g.get("hyper"), dict) and isinstance(g.get("params"), list)
                and all(isinstance(n, str) for n in g["params"])):
            raise malformed
    return groups


def assemble_optimizer_state(run: Run, step: int, state: dict[str, Any],
                             per_param: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``optimizer.state_dict()`` of ``step`` from its decoded state (groups, non-tensor extras) and
    ``per_param``: recorded name -> {state key: tensor}. One path for stored and rebuilt steps."""
    groups = recorded_groups(run, step, state)
    index = param_indices(g["params"] for g in groups)
    param_groups = [{**g["hyper"], "params": [index[n] for n in g["params"]]} for g in groups]
    extras = state.get("optimizer_extra", {})
    if not isinstance(extras, dict) or not all(isinstance(v, dict) for v in extras.values()):
        raise CorruptDataError(f"the optimizer state recorded at step {step} of {run.path} is malformed")
    for param, extra in extras.items():
        per_param.setdefault(param, {}).update(extra)
    opt_state = {index[p]: v for p, v in per_param.items() if p in index}
    return {"state": opt_state, "param_groups": param_groups}
