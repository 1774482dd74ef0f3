"""Extra state read back: the objects recorded with ``Recorder(extra_state={name: obj})``.

A full step's state holds, under ``extra_state``, each object's ``state_dict()`` as typed JSON
whose tensors are ``{"$extra": ref}``, series of kind ``extra`` at the same step (FORMAT.md).
:func:`extra_state_dict` decodes one; at a gradient log's steps between keyframes the tensors
have stats and fingerprints only, and an object whose update rule is known (AveragedModel's) is
rebuilt and verified against them (read/extra_rebuild.py), any other refused with the reason.

:func:`plan_extra` is restore's part: it checks what was given against what the run holds and
that each object can load its recorded state, before anything is changed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core import tjson
from stepdump.errors import ConfigError, CorruptDataError, RestoreMismatchError, StepNotFoundError
from stepdump.read.extra_rebuild import rebuild
from stepdump.store.format import LEVEL_FULL, STATE_EXTRA

if TYPE_CHECKING:
    from stepdump.read.run import Run

log = logging.getLogger(__name__)

KIND = "extra"


def recorded_trees(run: Run, step: int) -> dict[str, Any]:
    """name -> the undecoded typed-JSON ``state_dict()`` of each object recorded at ``step``
    (empty when the step holds none)."""
    text = run.catalog.step_state(step)
    if text is None:
        return {}
    try:
        tree = tjson.loads(text, f"the recorded state of step {step} in {run.path}")
    except ValueError as e:
        raise CorruptDataError(f"the recorded state of step {step} in {run.path} is malformed ({e})") from e
    extra = tree.get(STATE_EXTRA) if isinstance(tree, dict) else None
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise CorruptDataError(f"the extra state recorded at step {step} of {run.path} is malformed")
    return extra


def names(run: Run, step: int) -> list[str]:
    """Names of the extra state recorded at ``step``."""
    return list(recorded_trees(run, step))


def extra_state_dict(run: Run, step: int, name: str) -> Any:
    """``obj.state_dict()`` of the object recorded as ``name``, as it was when update ``step`` began."""
    trees = recorded_trees(run, step)
    if name not in trees:
        held = ", ".join(map(repr, trees)) or "none"
        raise StepNotFoundError(f"step {step} of {run.path} holds no extra state named {name!r} (it holds: {held}); "
                                "record it with Recorder(..., extra_state={name: obj})")
    level = run.catalog.level(step)
    if not (isinstance(level, int) and level >= LEVEL_FULL):  # a gradient log's step between keyframes
        return rebuild(run, step, name, extra_state_dict)
    try:
        return tjson.decode(trees[name], lambda ref: run.tensor(ref, step, kind="state"),
                            lambda ref: run.tensor(ref, step, kind=KIND))
    except (StepNotFoundError, ConfigError, RestoreMismatchError, CorruptDataError):
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as e:
        raise CorruptDataError(f"the extra state {name!r} recorded at step {step} of {run.path} is malformed "
                               f"({e})") from e


# -- restore ------------------------------------------------------------------------------


@dataclass
class ExtraPlan:
    """What restore loads into the extra-state objects, once every part is checked."""

    loads: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, object, recorded state_dict)

    def apply(self) -> None:
        for _, obj, state in self.loads:
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(state, strict=True)
            else:
                obj.load_state_dict(state)


def plan_extra(run: Run, step: int, given: Mapping[str, Any] | None) -> ExtraPlan:
    """Check ``extra_state=`` of restore against step ``step``: every name given must be held by the
    run (RestoreMismatchError), names the run holds that were not given are logged as a warning, and
    each object must be able to load its state (checked on its state_dict's structure for a module,
    else by loading into a copy). Nothing is changed here."""
    if given is not None and not isinstance(given, Mapping):
        raise ConfigError(f"extra_state= takes a dict of name -> object (as given to the Recorder), got "
                          f"{type(given).__name__}")
    given = dict(given or {})
    for name, obj in given.items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise ConfigError(f"extra_state[{name!r}] is a {type(obj).__name__}, which has no load_state_dict()")
    held = names(run, step)
    absent = [n for n in given if n not in held]
    if absent:
        what = ", ".join(map(repr, held)) or "no extra state"
        raise RestoreMismatchError(
            f"extra_state {absent[0]!r}: step {step} of {run.path} holds {what}, so {absent[0]!r} cannot be restored "
            "and nothing was changed; record it with Recorder(..., extra_state={...}) or leave it out of restore")
    left = [n for n in held if n not in given]
    if left:
        log.warning("stepdump: step %d of %s also holds extra state %s, which restore was not given: left as it is "
                    "(pass extra_state={%s} to restore it)", step, run.path, ", ".join(map(repr, left)),
                    ", ".join(f"{n!r}: ..." for n in left))
    plan = ExtraPlan()
    for name, obj in given.items():
        state = extra_state_dict(run, step, name)
        _check_loadable(name, obj, state, step)
        plan.loads.append((name, obj, state))
    return plan


def _check_loadable(name: str, obj: Any, state: Any, step: int) -> None:
    fix = f"build {name!r} as the recorded run did (same model, same class), or leave it out of restore"
    if isinstance(obj, torch.nn.Module):
        if not isinstance(state, dict):
            raise RestoreMismatchError(f"extra_state {name!r}: step {step} holds a {type(state).__name__}, not a "
                                       f"module's state_dict; nothing was changed. {fix}")
        _same_structure(name, obj.state_dict(), state, step, fix, strict_keys=True)
        return
    try:
        twin = copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - an object that cannot be copied: compare its state's structure instead
        live = obj.state_dict()
        _same_structure(name, live, state, step, fix, strict_keys=True)
        return
    try:
        twin.load_state_dict(copy.deepcopy(state))
    except Exception as e:  # noqa: BLE001 - whatever its load_state_dict raises: nothing was changed
        raise RestoreMismatchError(
            f"extra_state {name!r} ({type(obj).__name__}) cannot load the state recorded at step {step} "
            f"({type(e).__name__}: {e}); nothing was changed. {fix}") from e


def _same_structure(name: str, live: Any, recorded: Any, step: int, fix: str, *, strict_keys: bool,
                    path: str = "") -> None:
    """The recorded state has the live state's keys and its tensors' shapes and dtypes."""
    where = f"extra_state {name!r}" + (f" at {path!r}" if path else "")
    if isinstance(live, torch.Tensor) or isinstance(recorded, torch.Tensor):
        if not (isinstance(live, torch.Tensor) and isinstance(recorded, torch.Tensor)):
            raise RestoreMismatchError(f"{where}: the run has a {type(recorded).__name__}, the object a "
                                       f"{type(live).__name__}; nothing was changed. {fix}")
        if tuple(live.shape) != tuple(recorded.shape) or live.dtype != recorded.dtype:
            raise RestoreMismatchError(f"{where}: the run has {recorded.dtype} {tuple(recorded.shape)} (step {step}), "
                                       f"the object has {live.dtype} {tuple(live.shape)}; nothing was changed. {fix}")
        return
    if isinstance(live, Mapping) and isinstance(recorded, Mapping):
        if strict_keys and set(live) != set(recorded):
            extra = sorted(map(str, set(recorded) - set(live)))[:3]
            lacking = sorted(map(str, set(live) - set(recorded)))[:3]
            raise RestoreMismatchError(f"{where}: the run's state has keys {extra} the object lacks and lacks "
                                       f"{lacking}; nothing was changed. {fix}")
        for k in live:
            if k in recorded:
                _same_structure(name, live[k], recorded[k], step, fix, strict_keys=strict_keys,
                                path=f"{path}/{k}" if path else str(k))
        return
    if isinstance(live, (list, tuple)) and isinstance(recorded, (list, tuple)):
        if len(live) != len(recorded):
            raise RestoreMismatchError(f"{where}: the run has {len(recorded)} entries, the object {len(live)}; "
                                       f"nothing was changed. {fix}")
        for i, (a, b) in enumerate(zip(live, recorded, strict=True)):
            _same_structure(name, a, b, step, fix, strict_keys=strict_keys, path=f"{path}/{i}")
