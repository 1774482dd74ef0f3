"""Rebuilding ``state_dict``-shaped objects from a recorded step."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from stepdump.errors import CorruptDataError, StepNotFoundError

if TYPE_CHECKING:
    from stepdump.read.run import Run


def model_state_dict(run: Run, step: int) -> OrderedDict[str, torch.Tensor]:
    """Params (before update ``step``) and buffers (start of iteration ``step``), by state_dict key."""
    run._require_full(step)
    entries = run.meta.get("layout", {}).get("state_dict")
    if entries is None:
        raise CorruptDataError(f"{run.path} has no state_dict layout in its catalog")
    stored = {
        (k, n): (b, d, sh)
        for k, n, b, d, sh in run._con.execute(
            "SELECT s.kind, s.name, t.blob, t.dtype, t.shape FROM tensors t JOIN series s ON s.id = t.series "
            "WHERE t.step = ? AND s.kind IN ('params', 'buffers') AND t.blob IS NOT NULL",
            (step,),
        )
    }
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    for key, kind, name in entries:
        ref = (kind, name)
        if ref not in loaded:
            if ref not in stored:
                raise StepNotFoundError(
                    f"step {step} of {run.path} has no {kind} {name!r}, so no full state_dict: record with "
                    "capture including 'params' and include/exclude covering every parameter"
                )
            loaded[ref] = run._blobs.tensor(*stored[ref])
        out[key] = loaded[ref]
    return out


def optimizer_state_dict(run: Run, step: int) -> dict[str, Any]:
    """The optimizer's state_dict before update ``step``, with torch's index numbering."""
    run._require_full(step)
    state = run.step_state(step)
    groups = state.get("groups")
    if groups is None:
        raise CorruptDataError(f"step {step} of {run.path} has no optimizer param groups recorded")
    index: dict[str, int] = {}
    param_groups = []
    for g in groups:
        ids = []
        for name in g["params"]:
            # torch numbers each distinct parameter once, in group order.
            if name not in index:
                index[name] = len(index)
            ids.append(index[name])
        param_groups.append({**g["hyper"], "params": ids})
    per_param: dict[str, dict[str, Any]] = {}
    rows = run._con.execute(
        "SELECT s.param, s.key, t.blob, t.dtype, t.shape FROM tensors t JOIN series s ON s.id = t.series "
        "WHERE t.step = ? AND s.kind = 'optimizer' ORDER BY s.id",
        (step,),
    ).fetchall()
    for param, key, blob, dtype, shape in rows:
        if blob is None:
            continue
        per_param.setdefault(param, {})[key] = run._blobs.tensor(blob, dtype, shape)
    for param, extra in state.get("optimizer_extra", {}).items():
        per_param.setdefault(param, {}).update(extra)
    opt_state = {index[p]: v for p, v in per_param.items() if p in index}
    return {"state": opt_state, "param_groups": param_groups}
