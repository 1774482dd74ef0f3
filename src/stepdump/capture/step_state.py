"""What one record holds, read from the live objects: its state JSON and its tensor entries.

The state a record holds besides tensors (param groups, optimizer extras, scheduler, scaler,
the RNG and buffers taken when the iteration begins) as typed JSON, and the list of live
tensors it takes at the pre-hook. (Names come from core/layout.py.) ``Run.step_state`` reads
back what :func:`state_json` writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from stepdump.core import tjson
from stepdump.core.layout import Layout
from stepdump.errors import StepdumpError
from stepdump.store.format import STATE_EXTRA, STATE_FORWARD_RNG
from stepdump.store.records import as_records


def full_state(layout: Layout, optimizer: torch.optim.Optimizer, scheduler: object, scaler: object,
               opt_state: Mapping[Any, Mapping[str, Any]] | None = None,
               extra: dict[str, dict[str, object]] | None = None) -> dict:
    """The non-tensor state of a full record: param groups by name, optimizer extras, scheduler, scaler
    (``opt_state``: the optimizer's per-param state to read, None: ``optimizer.state`` now; ``extra``:
    its extras, walked already by the caller: ``walk(list(layout.params.items()), opt_state).extra``)."""
    opt_state = optimizer.state if opt_state is None else opt_state
    groups = []
    for names, group in zip(layout.groups, optimizer.param_groups, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": names})
    if extra is None:
        extra = walk(list(layout.params.items()), opt_state).extra
    state: dict[str, object] = {"groups": groups, "optimizer_extra": extra}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()  # type: ignore[attr-defined]
    if scaler is not None:
        state["scaler"] = scaler.state_dict()  # type: ignore[attr-defined]
    return state


class Entry(NamedTuple):
    """One live tensor a record takes, on its way to staging (its bytes) or to the lean path
    (its stats and fingerprint)."""

    kind: str  # params, grads, optimizer, buffers, state, extra
    name: str  # the series name (an optimizer state's: "<param>.<key>")
    tensor: torch.Tensor  # the live tensor (not a copy)
    full: bool  # its bytes are stored; False: its stats and fingerprint only
    param: str | None = None  # optimizer state: the param it belongs to
    key: str | None = None  # optimizer state: its key in that param's state ("exp_avg")


NO_OPT_STATE: dict[str, Any] = {}  # a param without state (never changed: only read)


class StateWalk(NamedTuple):
    """What a walk of the optimizer's state for some params found."""

    entries: list[Entry]  # each tensor value, as a stats-only entry ("optimizer", "<param>.<key>")
    extra: dict[str, dict[str, object]]  # param -> {key: value} of the values that are not strided tensors


def walk(params: list[tuple[str, torch.Tensor]], state: Mapping[Any, Mapping[str, Any]]) -> StateWalk:
    """The optimizer state of ``params`` (name, param) in ``state`` (``optimizer.state``), walked now."""
    entries: list[Entry] = []
    extra: dict[str, dict[str, object]] = {}
    for n, p in params:
        for k, v in state.get(p, NO_OPT_STATE).items():
            if isinstance(v, torch.Tensor):
                entries.append(Entry("optimizer", f"{n}.{k}", v, False, n, k))
            # Sparse state goes to extra as well, kept sparse (indices + values in their order):
            # its dense series serves reading; restore needs the exact sparse tensor.
            if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
                extra.setdefault(n, {})[k] = v
    return StateWalk(entries, extra)


def stored_in_full(entries: Iterable[Entry]) -> list[Entry]:
    """``entries``, each with its bytes stored (``e._replace(full=True)`` without its Python calls
    per entry: a gradient log stores every step's grads so, on the training thread)."""
    return as_records(Entry, [(e.kind, e.name, e.tensor, True, e.param, e.key) for e in entries])


def tensor_entries(layout: Layout, optimizer: torch.optim.Optimizer, kinds: tuple[str, ...],
                   selected: Callable[[str], bool], full: bool, buffers: dict[str, torch.Tensor],
                   opt_state: Mapping[Any, Mapping[str, Any]] | None = None) -> list[Entry]:
    """An :class:`Entry` for every live tensor a record takes at the pre-hook
    (``opt_state``: the optimizer's per-param state to read, None: ``optimizer.state`` now)."""
    opt_state = optimizer.state if opt_state is None else opt_state
    out: list[Entry] = []
    params = [(n, p) for n, p in layout.params.items() if selected(n)]
    if "params" in kinds:
        out.extend(Entry("params", n, p, full) for n, p in params)
    if "grads" in kinds:
        out.extend(Entry("grads", n, p.grad, full) for n, p in params if p.grad is not None)
    if "optimizer" in kinds:
        for n, p in params:
            for k, v in opt_state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out.append(Entry("optimizer", f"{n}.{k}", v, full, n, k))
    out.extend(Entry("buffers", n, b, True) for n, b in buffers.items())
    return out


def begin_state(layout: Layout, buffers: Callable[[str], bool] | None) -> dict[str, Any]:
    """What a record takes at the start of its iteration: the RNG state, and private
    copies of the module buffers ``buffers`` selects (None: no buffers)."""
    from stepdump.core.rng import get_rng_state

    rng = get_rng_state()
    if buffers is None or not layout.buffers:  # (no clone: no torch.no_grad() and its Python calls)
        return {"rng": rng, "buffers": {}}
    with torch.no_grad():
        return {"rng": rng, "buffers": {n: b.detach().clone() for n, b in layout.buffers.items() if buffers(n)}}


def state_json(state: dict[str, Any], begin: dict[str, Any] | None, batch: Any, entries: list[Entry],
               extra: dict[str, Any] | None = None, memo: tjson.Memo | None = None) -> str:
    """The record's typed-JSON state (FORMAT.md); its tensors are appended to ``entries`` as kind ``state``.
    ``extra``: the extra state's tree, already encoded (capture/extra.py), stored as it is.
    ``memo``: the last state's text of one series of records (a gradient log's steps), whose parts
    that are the same now (param groups, hyperparameters) are not encoded again; the same text."""
    if begin is not None:
        state["rng"] = begin["rng"]
        if begin.get(STATE_FORWARD_RNG):
            state[STATE_FORWARD_RNG] = begin[STATE_FORWARD_RNG]
    if batch is not None:
        state["batch"] = batch

    def put(ref: str, tensor: torch.Tensor) -> None:
        entries.append(Entry("state", ref, tensor, True))

    if memo is not None:
        return memo.dumps(state, put, {STATE_EXTRA: extra} if extra else None)
    tree = tjson.encode(state, put)
    if extra:
        tree[STATE_EXTRA] = extra
    return tjson.dumps(tree)


class StateBefore:
    """``optimizer.state`` as it is when ``step()`` begins, for a record taken later (after a
    closure's first call): each param's dict and lists copied (keys and plain values as of
    now, e.g. LBFGS's ``func_evals``), tensors by reference. A tensor of it changed in place
    before the record is taken cannot be recorded as it was: :meth:`state` refuses, rather
    than record the changed one as the state before the step (no torch optimizer does that:
    they call the closure before they change anything)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._state: dict[Any, dict[str, Any]] = {}
        self._versions: list[tuple[torch.Tensor, int]] = []
        for p, s in optimizer.state.items():
            own = self._state[p] = dict(s)
            for k, v in own.items():
                if type(v) is list:  # LBFGS's history: appended to and popped during the step
                    own[k] = v = list(v)
                for x in v if type(v) in (list, tuple) else (v,):
                    if isinstance(x, torch.Tensor):
                        self._versions.append((x, x._version))

    def state(self, step: int | None) -> dict[Any, dict[str, Any]]:
        """The state as of ``step()``'s start (raises StepdumpError when a tensor of it changed since)."""
        if any(t._version != v for t, v in self._versions):
            raise StepdumpError(
                f"the optimizer changed its state in place at step {step} before it called the closure, so "
                "stepdump cannot record the state as it was before the step; to record it, compute the grads "
                "before optimizer.step() (call the closure once yourself), create the Recorder with "
                "auto_capture=False and call Recorder.capture() right before optimizer.step()")
        return self._state
