"""One re-execution of a recorded step: reach its state, feed its batch and RNG, run the user's
iteration once, and fingerprint what it computed.

The state is reached with the engine replay and restore already use (``run.restore``: a full
step or a gradient log's rebuild; :func:`stepdump.read.replay.replay`: from the nearest keyframe),
or taken from the live objects when they already hold the step (checked by fingerprints: a lean
run's step 0 from a freshly built, seeded model). Each repeat starts from an in-memory copy of
that state, so ``repeat=N`` costs N iterations, not N restores.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from stepdump.capture.activations import input_name
from stepdump.core import tjson
from stepdump.core.hashing import XXH3, fingerprint, fingerprint_as
from stepdump.core.layout import build_layout
from stepdump.core.optrace import OpRecord, OpTracer
from stepdump.core.rng import ForwardRng, get_rng_state, set_rng_state
from stepdump.core.wrappers import inner_optimizer
from stepdump.errors import BatchMismatchError, ConfigError, ReplayDiverged, StepNotFoundError
from stepdump.read.replay import _live_tensors, batch_calls, recorded_batch, replay
from stepdump.read.rows import fp_kind_map
from stepdump.reexec.capture import Captured, capturing
from stepdump.store.format import (
    STATE_AFTER_UPDATE,
    STATE_CARRIED_GRADS,
    STATE_FORWARD_RNG,
    STATE_OUTSIDE_OPTIMIZER,
    Key,
)

TrainStep = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]

# Where each compared quantity comes from: the loss (a logged scalar), the grads the update used
# (record k), and the params / optimizer state the update left (record k+1).
LOSS, GRADS, PARAMS_AFTER, OPT_AFTER = "loss", "grads", "params after the update", "optimizer after the update"
ORDER = {LOSS: 0, GRADS: 1, PARAMS_AFTER: 2, OPT_AFTER: 3}


def float_bits(x: float) -> int:
    """A float's exact bits as an int (NaN equals the same NaN; 0.0 and -0.0 differ)."""
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


@dataclass
class Execution:
    """What one re-execution computed, as fingerprints (``(quantity, name) -> int``)."""

    fps: dict[Key, int] = field(default_factory=dict)
    ops: OpTracer | None = None
    forwards: int = 0  # training forwards the iteration made
    forward_rng: bool = False  # each of them started from the RNG recorded at that forward
    captured: Captured | None = None  # activations / activation grads of the modules asked for (capture.py)


@dataclass
class Prepared:
    """The state to start every repeat from, and how it was reached."""

    how: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: Any
    scaler_state: Any
    rng: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    #: (kind, name) -> fingerprint kind of the run's series that are not xxh3: every execution
    #: fingerprints a tensor under its series' kind, so it compares with the record like for like.
    fp_kinds: dict[tuple[str, str], str] = field(default_factory=dict)
    #: The RNG state at each training forward of the step, as recorded (empty: not recorded; an
    #: entry None: the step's start RNG, nothing drew before that forward).
    forward_rng: list[dict[str, Any] | None] = field(default_factory=list)
    #: Params the loop changed after this step's update, before the next record: name -> the
    #: exact (xxh3) fingerprint of what the update left in them (compared instead of record k+1's).
    edited: dict[str, int] = field(default_factory=dict)
    #: The state was reached through a verified replay or restore (not taken from the objects as given).
    verified: bool = True
    #: Grads the recorded loop carried into the iteration (state ``carried_grads``), by param name.
    carried: dict[str, torch.Tensor] = field(default_factory=dict)

    def fingerprint(self, kind: str, name: str, t: torch.Tensor) -> int:
        """``t``'s fingerprint under the kind of the run's series (``kind``, ``name``); an edited
        param's output under xxh3, the kind of the ``after_update`` fingerprints."""
        fk = XXH3 if kind == "params" and name in self.edited else self.fp_kinds.get((kind, name), XXH3)
        return fingerprint(t) if fk == XXH3 else fingerprint_as(fk, t)


def recorded_inputs(run: Any, step: int) -> dict[str, int]:
    """The recorded batch fingerprints of ``step``: ``inputs`` name -> fingerprint."""
    return {n: fp for (k, n), fp in run.fingerprints(step, kinds=("inputs",)).items() if n.startswith("batch")}


def batch_fingerprints(batch: Any, calls: int, fp_kinds: dict[tuple[str, str], str] | None = None) -> dict[str, int]:
    """``inputs`` names -> fingerprints of a batch as ``log_batch`` would have named it: one batch,
    or (``calls`` > 1) a list with what each log_batch call of the iteration got. ``fp_kinds``:
    the run's series that are not xxh3 (each input is fingerprinted under its series' kind)."""
    kinds = fp_kinds or {}
    out: dict[str, int] = {}
    items = batch if calls > 1 else [batch]
    if calls > 1 and (not isinstance(items, (list, tuple)) or len(items) != calls):
        raise BatchMismatchError(f"the step's batch was logged in {calls} log_batch calls (micro-batches): pass a "
                                 f"list of {calls} batches, one per call, in order")
    for i, b in enumerate(items):
        suffix = "" if i == 0 else f"#{i}"

        def put(ref: str, t: torch.Tensor, suffix: str = suffix) -> None:
            name = input_name(ref) + suffix
            out[name] = fingerprint_as(kinds.get(("inputs", name), XXH3), t)

        tjson.encode(b, put)
    return out


def check_batch(run: Any, step: int, batch: Any) -> None:
    """Raise :class:`BatchMismatchError` unless ``batch`` is the batch recorded at ``step``."""
    recorded = recorded_inputs(run, step)
    if not recorded:
        raise BatchMismatchError(f"step {step} of {run.path} has no batch fingerprint (the loop did not call "
                                 "rec.log_batch), so the batch given cannot be checked against it")
    given = batch_fingerprints(batch, len(batch_calls(recorded)), fp_kind_map(run.catalog))
    for name in sorted(set(recorded) | set(given)):
        if recorded.get(name) != given.get(name):
            what = "is missing from" if name not in given else \
                "is not in the record of" if name not in recorded else "differs from what was logged at"
            raise BatchMismatchError(f"this is not the batch of step {step}: {name!r} {what} step {step} (the "
                                     "fingerprints of the batch given and of the recorded one differ)")


def stored_batch(run: Any, step: int, state: dict[str, Any]) -> Any:
    """The batch of ``step`` as stored (several log_batch calls: a list, one per call), as replay
    hands it to ``train_step`` (:func:`stepdump.read.replay.recorded_batch`)."""
    names = recorded_inputs(run, step)
    try:
        if state.get("batch") is not None and names:
            return recorded_batch(run, step, state)
    except StepNotFoundError:  # only its fingerprint was stored
        pass
    raise ConfigError(
        f"step {step} of {run.path} holds " + ("only the fingerprint of its batch" if names else "no batch")
        + ": pass batch= (it is checked against the fingerprint), or record with keyframe_every=K or "
        "gradient_log=K and rec.log_batch(batch) in every iteration")


def _state_of(run: Any, step: int) -> dict[str, Any]:
    return run.step_state(step) if run.catalog.has_state(step) else {}


def _live_matches(run: Any, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    recorded = run.fingerprints(step, kinds=("params", "optimizer"))
    live = _live_tensors(build_layout(model, optimizer), optimizer)
    keys = [k for k in recorded if k in live]
    kinds = fp_kind_map(run.catalog)  # each live tensor under its series' fingerprint kind
    return bool(keys) and all(fingerprint_as(kinds.get(k, XXH3), live[k]) == recorded[k] for k in keys) and \
        not [k for k in recorded if k not in live]


def edits_watched(run: Any, step: int) -> bool:
    """Whether record ``step + 1`` was compared with what update ``step`` left (its state holds
    ``after_update``, empty when the loop changed nothing): an edit by the loop is then excluded
    or accounted for."""
    return step + 1 in set(run.stats_steps) and STATE_AFTER_UPDATE in _state_of(run, step + 1)


def edits_after(run: Any, step: int) -> dict[str, int]:
    """Params the loop changed between update ``step`` and record ``step + 1`` (that record's state
    ``outside_optimizer``), with what the update left in them (``after_update``; FORMAT.md)."""
    st = _state_of(run, step + 1) if step + 1 in set(run.stats_steps) else {}
    after = st.get(STATE_AFTER_UPDATE) or {}
    return {n: int(after[n]) for n in st.get(STATE_OUTSIDE_OPTIMIZER) or [] if n in after}


def prepare(run: Any, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_step: TrainStep,
            scheduler: Any = None, scaler: Any = None) -> Prepared:
    """Put the objects in the state of record ``step`` and keep a copy of it for the repeats."""
    notes: list[str] = []
    verified, replayed = True, None  # replayed: the start RNG of the step as a replay reached it
    keyframes = [s for s in run.steps if s <= step]
    if step in run.steps or (run.gradient_log is not None and step in run.stats_steps):
        run.restore(step, model, optimizer, scheduler, scaler)
        how = "restored (a gradient-log run: rebuilt and verified)" if run.gradient_log is not None \
            else "restored (stored in full)"
    elif keyframes and _state_of(run, step).get("batch") is not None:
        res = replay(run, step, model, optimizer, train_step, scheduler, scaler, verify_step_grads=False)
        how = f"replayed from keyframe {res.keyframe} ({res.steps_replayed} iterations, each verified)"
        replayed = res.rng
    elif _live_matches(run, step, model, optimizer):
        how = "the objects given already hold the step's state (every recorded fingerprint matches)"
        verified = False
    elif keyframes:  # a lean run: no batches stored; train_step(model, optimizer, None) draws its own
        res = replay(run, step, model, optimizer, train_step, scheduler, scaler, verify_step_grads=False,
                     batches=False)
        how = (f"replayed from step {res.keyframe} with train_step drawing its own batches (none stored; "
               f"{res.steps_replayed} iterations, each checked against its recorded fingerprints)")
        replayed = res.rng
    else:
        raise StepNotFoundError(
            f"step {step} of {run.path} cannot be rebuilt: it is not stored in full, not in a gradient log, and no "
            "step before it is stored in full to replay from; record with keyframe_every=K or gradient_log=K "
            "(and rec.log_batch), or pass objects that already hold the step's state")
    state = _state_of(run, step)
    rng = state.get("rng") or replayed  # at a step with none: the one a verified replay reached
    if rng is None:
        notes.append(f"the RNG state of step {step} was not recorded: every repeat starts from this process's "
                     "RNG as it is now, so a step that draws random numbers (dropout) may differ from the record")
        rng = get_rng_state()
    for p in model.parameters():
        p.grad = None  # replay stops with the step's grads in place; an iteration starts without them
    return Prepared(
        how=how, model_state={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer_state=copy.deepcopy(optimizer.state_dict()),
        scheduler_state=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        scaler_state=copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
        rng=rng, notes=notes, fp_kinds=fp_kind_map(run.catalog), forward_rng=list(state.get(STATE_FORWARD_RNG) or []),
        edited=edits_after(run, step), verified=verified,
        carried={n: run.tensor(n, step, kind="grads") for n in state.get(STATE_CARRIED_GRADS) or []})


class _NoStep(Exception):
    pass


def execute(prep: Prepared, batch: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            train_step: TrainStep, scheduler: Any = None, scaler: Any = None, *, trace: bool = False,
            source: bool = True, capture: tuple[list[str], list[str]] | None = None,
            forward_rng: bool = True) -> Execution:
    """Run the iteration once from ``prep``'s state: grads at the optimizer's pre-hook, params and
    optimizer state after ``train_step`` returns, and its return value as the loss. ``capture``:
    (activation globs, activation-grad globs) whose modules' outputs and grads are kept.
    ``forward_rng``: set the RNG recorded at each training forward there (core.rng.ForwardRng)."""
    model.load_state_dict(prep.model_state)
    optimizer.load_state_dict(copy.deepcopy(prep.optimizer_state))
    if scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(prep.scheduler_state))
    if scaler is not None:
        scaler.load_state_dict(copy.deepcopy(prep.scaler_state))
    for p in model.parameters():
        p.grad = None
    set_rng_state(prep.rng)
    layout = build_layout(model, optimizer)
    for name, g in prep.carried.items():  # grads the loop carried into the iteration (capture/carried.py)
        if name in layout.params:
            layout.params[name].grad = g.clone()
    ex = Execution()

    def pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if any(kind == GRADS for kind, _ in ex.fps):
            return  # a second step() in one iteration: the first is the recorded update
        for (kind, name), t in _live_tensors(layout, opt).items():
            if kind == "grads":
                ex.fps[(GRADS, name)] = prep.fingerprint(kind, name, t)

    handle = inner_optimizer(optimizer).register_step_pre_hook(pre_hook)  # accelerate's wrapper has no hooks
    forwards = ForwardRng(model)
    forwards.start(prep.forward_rng if forward_rng else None, prep.rng)
    try:
        with ExitStack() as stack:
            activations, activation_grads = capture or ([], [])
            if activations or activation_grads:
                ex.captured = stack.enter_context(capturing(model, activations, activation_grads))  # filled at its end
            if trace:
                ex.ops = OpTracer(source=source)
                with ex.ops.tracing(model):
                    out = train_step(model, optimizer, batch)
            else:
                out = train_step(model, optimizer, batch)
    finally:
        handle.remove()
        forwards.remove()
    ex.forwards, ex.forward_rng = forwards.seen, forwards.matched
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        # Every NaN alike: a logged NaN is stored as NULL, its sign and payload bits are not kept.
        ex.fps[(LOSS, "loss")] = float_bits(float("nan") if out != out else out)
    for (kind, name), t in _live_tensors(layout, optimizer).items():
        if kind == "params":
            ex.fps[(PARAMS_AFTER, name)] = prep.fingerprint(kind, name, t)
        elif kind == "optimizer":
            ex.fps[(OPT_AFTER, name)] = prep.fingerprint(kind, name, t)
    return ex


def recorded(run: Any, step: int, loss: str | None) -> dict[Key, int]:
    """The record's side of every quantity :func:`execute` fingerprints."""
    out = {(GRADS, n): fp for (k, n), fp in run.fingerprints(step, kinds=("grads",)).items()}
    if step + 1 in set(run.stats_steps):
        for (k, n), fp in run.fingerprints(step + 1, kinds=("params", "optimizer")).items():
            out[(PARAMS_AFTER if k == "params" else OPT_AFTER, n)] = fp
        # The params the loop changed after the update: what the update left in them, not the edit.
        out.update({(PARAMS_AFTER, n): fp for n, fp in edits_after(run, step).items()})
    if loss is not None:
        for _, name, value in run.scalar_rows(step):
            if name == loss and value is not None:
                out[(LOSS, "loss")] = float_bits(value)
    return out


def differing(a: dict[Key, int], b: dict[Key, int], *, both: bool = True) -> list[Key]:
    """Keys whose fingerprints differ, in the order of the iteration (loss, grads, then the update).
    ``both``: only keys present on both sides (else a key missing on either side differs too)."""
    keys = (set(a) & set(b)) if both else (set(a) | set(b))
    return sorted((k for k in keys if a.get(k) != b.get(k)), key=_in_iteration_order)


def _in_iteration_order(key: Key) -> tuple[int, str]:
    kind, name = key
    return ORDER.get(kind, 9), name


def first_nonfinite(ex: Execution) -> OpRecord | None:
    return ex.ops.first_nonfinite if ex.ops is not None else None


__all__ = ["Execution", "Prepared", "ReplayDiverged", "check_batch", "execute", "prepare", "recorded",
           "stored_batch", "differing"]
