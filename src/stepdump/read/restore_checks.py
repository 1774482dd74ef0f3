"""restore's checks of the parts whose ``load_state_dict`` runs code stepdump does not know.

A scheduler's, a GradScaler's or the RNG's load may fail half-way (``LambdaLR`` rebuilt with
fewer lambdas than the run recorded raises IndexError after it updated its ``__dict__``), so
restore tries each one first on a copy: the scheduler deep-copied with a stand-in for its
optimizer (the trial never reaches the caller's optimizer or params), the scaler deep-copied,
the RNG set and set back. Only when every part passed does restore change anything
(read/restore.py). The model of a run recorded with ``frozen="fingerprint"`` is checked here
too: its frozen params were stored by fingerprint only, so the live ones must match them.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.hashing import XXH3, fingerprint_as
from stepdump.errors import RestoreMismatchError
from stepdump.read.rows import fp_kind_map

if TYPE_CHECKING:
    from stepdump.read.run import Run

log = logging.getLogger(__name__)


class _OptimizerStandIn:
    """What a scheduler copy holds instead of the caller's optimizer during a trial load: its
    param groups as copies (the groups restore would add included), no state."""

    def __init__(self, optimizer: Any, new_groups: list[dict[str, Any]]) -> None:
        groups = list(getattr(optimizer, "param_groups", []))
        self.param_groups = [{**g, "params": list(g["params"])} for g in [*groups, *new_groups]]
        self.defaults = dict(getattr(optimizer, "defaults", {}))
        self.state: dict[Any, Any] = {}


def trial_scheduler(scheduler: Any, state: Any, step: int, optimizer: Any, new_groups: list[dict[str, Any]]) -> None:
    """Load ``state`` into a copy of ``scheduler``; a failure is a RestoreMismatchError."""
    target = getattr(scheduler, "optimizer", None) or optimizer
    memo: dict[int, Any] = {}
    for opt in {id(o): o for o in (target, optimizer) if o is not None}.values():
        memo[id(opt)] = _OptimizerStandIn(opt, new_groups if opt is optimizer else [])
    twin = _copy(scheduler, memo)
    if twin is None:
        return
    try:
        twin.load_state_dict(copy.deepcopy(state))
    except Exception as e:  # noqa: BLE001 - whatever its load_state_dict raises: nothing was changed
        raise RestoreMismatchError(
            f"the LR scheduler ({type(scheduler).__name__}) cannot load the state recorded at step {step} "
            f"({type(e).__name__}: {e}); nothing was changed. Build the scheduler as the recorded run had it at "
            f"that step ({_scheduler_hint(scheduler, state)}), or restore without scheduler=") from e


def _scheduler_hint(scheduler: Any, state: Any) -> str:
    lambdas = state.get("lr_lambdas") if isinstance(state, dict) else None
    live = getattr(scheduler, "lr_lambdas", None)
    if isinstance(lambdas, list) and isinstance(live, list) and len(lambdas) != len(live):
        return (f"the run's had {len(lambdas)} lr_lambdas, this one has {len(live)}: one per param group, "
                "including groups added with add_param_group")
    return "same class, arguments and param groups"


def check_scaler(scaler: Any, state: Any, step: int) -> None:
    """The GradScaler can take the recorded state: tried on a copy; a disabled scaler given an enabled
    one's state (torch's load_state_dict would silently do nothing) is refused too."""
    enabled = getattr(scaler, "is_enabled", None)
    if callable(enabled) and not enabled() and state:
        raise RestoreMismatchError(
            f"the run's GradScaler was enabled at step {step} (scale {state.get('scale')}), the one given is disabled, "
            "and a disabled GradScaler ignores load_state_dict; nothing was changed. Build it enabled, or restore "
            "without scaler=")
    twin = _copy(scaler, {})
    if twin is None:
        return
    try:
        twin.load_state_dict(copy.deepcopy(state))
    except Exception as e:  # noqa: BLE001 - nothing was changed
        raise RestoreMismatchError(
            f"the GradScaler cannot load the state recorded at step {step} ({type(e).__name__}: {e}); nothing was "
            "changed. Build it as the recorded run did (a run recorded with a disabled scaler holds no scaler state: "
            "give a disabled one, or restore without scaler=)") from e


def trial_rng(state: dict[str, Any], step: int) -> None:
    """Set the recorded RNG state and set the current one back: a state this process cannot take is a
    RestoreMismatchError before anything else changed."""
    from stepdump.core.rng import get_rng_state, set_rng_state

    now = get_rng_state()
    try:
        set_rng_state(state)
    except Exception as e:  # noqa: BLE001 - a malformed or foreign RNG state
        raise RestoreMismatchError(f"the RNG state recorded at step {step} cannot be set here "
                                   f"({type(e).__name__}: {e}); nothing was changed. Pass rng=False to restore "
                                   "without it") from e
    finally:
        set_rng_state(now)


def _copy(obj: Any, memo: dict[int, Any]) -> Any:
    try:
        return copy.deepcopy(obj, memo)
    except Exception as e:  # noqa: BLE001 - an object that cannot be copied is loaded without a trial
        log.debug("stepdump: restore cannot copy %s for a trial load (%s)", type(obj).__name__, e)
        return None


def fingerprint_model_state(run: Run, step: int, model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The model's state_dict at ``step`` of a run recorded with ``frozen="fingerprint"``: stored
    tensors from the run, each frozen one (a fingerprint row, no bytes) taken from the live model
    after checking it is the recorded one, bit for bit."""
    from stepdump.read.state import assemble_model_state, layout_entries

    rows = {(r.kind, r.name): r for r in run.catalog.fingerprint_block(step, step)}
    fp_kinds = fp_kind_map(run.catalog)  # a frozen tensor is checked under its series' fingerprint kind
    live = model.state_dict()
    key_of = {(kind, name): key for key, kind, name in layout_entries(run, step)}

    def load(kind: str, name: str) -> torch.Tensor | None:
        row = rows.get((kind, name))
        if row is None:
            return None
        dtype, shape, fp = row.dtype, row.shape, row.fingerprint
        if row.blob is not None:
            return run.tensor(name, step, kind=kind)
        key = key_of.get((kind, name))
        t = live.get(key) if key is not None else None
        if t is None:
            raise RestoreMismatchError(f"the run stored only the fingerprint of {name!r} at step {step} "
                                       "(frozen='fingerprint') and the model has no such tensor; nothing was changed. "
                                       "Build the model with the base the run was recorded with")
        from stepdump.core.dtypes import DTYPE_NAMES
        from stepdump.store.format import format_shape

        if DTYPE_NAMES.get(t.dtype) != dtype or format_shape(t.shape) != shape \
                or fingerprint_as(fp_kinds.get((kind, name), XXH3), t) != fp:
            raise RestoreMismatchError(
                f"the model's frozen {name!r} differs from the one recorded at step {step}, which the run holds "
                f"by fingerprint only (frozen='fingerprint'; the run: {dtype} [{shape}], the model: "
                f"{DTYPE_NAMES.get(t.dtype)} {list(t.shape)}); nothing was changed. Build the base from the same "
                "weights the run was recorded with")
        return t

    return assemble_model_state(run, step, load)
