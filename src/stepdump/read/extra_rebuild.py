"""An averaged model (EMA / SWA) rebuilt at a gradient log's steps between keyframes.

A gradient log stores extra state in full at keyframes only; between them, the stats and exact
fingerprints of its tensors at every step. Where the run says how the object is updated
(``meta.extra_state[name].update``: a ``torch.optim.swa_utils.AveragedModel`` with its default
average or a ``swa_utils`` ``get_ema_*`` / ``get_swa_*`` function, capture/extra.py), the state
at step *s* is rebuilt from keyframe *k* by torch's own ``AveragedModel.update_parameters``,
applied to a stand-in of the model holding the rebuilt params (and recorded buffers) of each
step where the recorded fingerprints changed (one update per such step: ``n_averaged``
changes with every update). Every step is checked against its fingerprints: a difference (an
update placed elsewhere in the loop, two updates in one iteration, another device's kernels)
raises :class:`~stepdump.errors.RebuildError` and nothing unverified is returned. Any other
object is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.hashing import XXH3
from stepdump.errors import RebuildError, StepNotFoundError, nearest_steps
from stepdump.read.rows import Recorded, differs_from_row, fp_kind_map
from stepdump.read.state import layout_entries

if TYPE_CHECKING:
    from torch.optim.swa_utils import AveragedModel

    from stepdump.read.run import Run

_AVERAGES = ("default", "get_ema_multi_avg_fn", "get_ema_avg_fn", "get_swa_multi_avg_fn", "get_swa_avg_fn")
_KNOWN = ("torch.optim.swa_utils.AveragedModel with its default average, or with a function from "
          "swa_utils.get_ema_multi_avg_fn / get_ema_avg_fn / get_swa_multi_avg_fn / get_swa_avg_fn")


def rebuild(run: Run, step: int, name: str,
            read_full: Callable[[Run, int, str], Any]) -> dict[str, torch.Tensor]:
    """The ``state_dict()`` of the averaged model ``name`` before update ``step``, rebuilt and verified.

    ``read_full(run, k, name)`` reads the object's state at a keyframe ``k``
    (:func:`stepdump.read.extra.extra_state_dict`, which calls this function: passed in so that
    neither module imports the other)."""
    log = run.gradient_log
    if log is None:
        raise StepNotFoundError(f"extra state {name!r} at step {step} of {run.path} has only stats and "
                                f"fingerprints, its values were not stored; {nearest_steps(step, run.steps)}")
    keys = [k for k in log.keyframes() if k <= step]
    where = f"read it at a keyframe ({nearest_steps(step, log.keyframes())})"
    if not keys:
        raise _error(run, step, name, f"step {step} comes before the first keyframe; {where}")
    rule = _rule(run, name)
    if rule is None:
        cls = ((run.meta.get("extra_state") or {}).get(name) or {}).get("class", "object")
        raise _error(run, step, name, f"a gradient log stores extra state in full at keyframes only, and stepdump "
                     f"knows no update rule for this {cls} to rebuild it with (it rebuilds {_KNOWN}); {where}")
    k = keys[-1]
    averaged, standin = _start(run, k, name, rule, read_full(run, k, name))
    before = _rows(run, k, name)
    fp_kinds = fp_kind_map(run.catalog)  # each rebuilt tensor is checked under its series' fingerprint kind
    for s in range(k + 1, step + 1):
        rows = _rows(run, s, name)
        if not rows:
            raise _error(run, step, name, f"step {s} has no fingerprints of {name!r}, so its rebuild cannot be "
                         f"verified; {where}")
        if rows == before:
            continue  # not updated in iteration s - 1
        standin.load_state_dict(run.state_dict(s), strict=True)
        averaged.update_parameters(standin)
        _verify(run, step, s, name, averaged, rows, fp_kinds)
        before = rows
    return {key: v.detach().clone() for key, v in averaged.state_dict().items()}


def _rule(run: Run, name: str) -> dict[str, Any] | None:
    """The recorded update rule, checked (a damaged or hostile catalog gives None: refused)."""
    desc = (run.meta.get("extra_state") or {}).get(name)
    rule = desc.get("update") if isinstance(desc, dict) else None
    if not isinstance(rule, dict) or rule.get("class") != "AveragedModel" or rule.get("avg") not in _AVERAGES:
        return None
    if not isinstance(rule.get("use_buffers"), bool):
        return None
    decay = rule.get("decay")
    if str(rule["avg"]).startswith("get_ema") and (isinstance(decay, bool) or not isinstance(decay, (int, float))
                                                   or not 0 <= decay <= 1):
        return None
    return rule


def _start(run: Run, k: int, name: str, rule: dict[str, Any],
           recorded: Any) -> tuple[AveragedModel, torch.nn.Module]:
    """An AveragedModel built as the recorded one (its update rule) over a stand-in of the model,
    loaded with the state recorded at keyframe ``k``."""
    from torch.optim import swa_utils

    standin = _standin(run, run.state_dict(k))
    kwargs: dict[str, Any] = {"use_buffers": rule["use_buffers"]}
    if rule["avg"] != "default":
        factory = getattr(swa_utils, rule["avg"])
        fn = factory(rule["decay"]) if str(rule["avg"]).startswith("get_ema") else factory()
        kwargs["multi_avg_fn" if rule.get("multi") else "avg_fn"] = fn
    averaged = swa_utils.AveragedModel(standin, **kwargs)
    try:
        averaged.load_state_dict(recorded, strict=True)
    except (RuntimeError, TypeError, KeyError) as e:
        raise _error(run, k, name, f"its state recorded at keyframe {k} is not that of an AveragedModel of the "
                     f"recorded model ({e}); read it at a keyframe") from e
    return averaged, standin


def _standin(run: Run, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module with the recorded model's parameters and buffers under their state_dict keys, in
    the order ``model.parameters()`` / ``buffers()`` gave them (tied weights: one Parameter)."""
    root = torch.nn.Module()
    params: dict[str, torch.nn.Parameter] = {}
    for key, kind, rec_name in layout_entries(run):
        *path, leaf = key.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        if kind == "params":
            p = params.get(rec_name)
            if p is None:
                p = params[rec_name] = torch.nn.Parameter(sd[key].clone(), requires_grad=False)
            module.register_parameter(leaf, p)
        else:
            module.register_buffer(leaf, sd[key].clone())
    return root


def _rows(run: Run, step: int, name: str) -> dict[str, Recorded]:
    """ref -> the dtype, shape and fingerprint of each extra tensor of ``name`` at ``step`` (equal
    at two steps: not updated between them)."""
    prefix = f"{name}/"
    return {r.name[len(prefix):]: Recorded(r.dtype, r.shape, r.fingerprint)
            for r in run.catalog.fingerprint_block(step, step)
            if r.kind == "extra" and isinstance(r.name, str) and r.name.startswith(prefix)}


def _verify(run: Run, target: int, s: int, name: str, averaged: torch.nn.Module,
            rows: dict[str, Recorded], fp_kinds: dict[tuple[str, str], str]) -> None:
    rebuilt = averaged.state_dict()
    for key in sorted(set(rows) | set(rebuilt)):
        t, row = rebuilt.get(key), rows.get(key)
        if t is None or row is None:
            why: str | None = "is not in the rebuild" if t is None else "is not in the record"
        else:
            why = differs_from_row(t, row, fp_kind=fp_kinds.get(("extra", f"{name}/{key}"), XXH3))
        if why is None:
            continue
        raise _error(run, target, name, f"re-applying AveragedModel.update_parameters to the model of step {s} gives "
                     f"{key!r} that {why}. The values are not returned: the run updates it elsewhere than right "
                     "after optimizer.step() (or more than once an iteration), or this machine's kernels differ "
                     "from the recording's; read it at a keyframe", s)


def _error(run: Run, step: int, name: str, what: str, at: int | None = None) -> RebuildError:
    err = RebuildError(f"extra state {name!r} at step {step} of {run.path} cannot be rebuilt from the gradient "
                       f"log: {what}")
    err.step, err.kind, err.name = step if at is None else at, "extra", name
    return err
