"""Replay: rebuild any step of a keyframe recording by re-running the user's own step code.

From the nearest keyframe at or before the target step, each iteration is
redone with its recorded batch and RNG state, and at every replayed optimizer
step the live params, grads and optimizer state are checked against the
recorded fingerprints. The first mismatch stops the replay with
:class:`stepdump.ReplayDiverged`, naming the step and tensor.

What a deterministic replay needs (docs/replay.md): the same code for one
iteration (``train_step``), the same torch version and
``torch.get_num_threads()``, deterministic kernels
(``torch.use_deterministic_algorithms(True)`` on CUDA), and every random input
either recorded in the batch or drawn from the global RNGs (which are restored
at every step). Data-loader workers' own RNGs are not replayed: record their
output with ``rec.log_batch``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core import tjson
from stepdump.core.hashing import XXH3, fingerprint, fingerprint_as
from stepdump.core.layout import build_layout
from stepdump.core.rng import ForwardRng, get_rng_state, set_rng_state
from stepdump.core.sparse import as_recorded
from stepdump.core.wrappers import inner_optimizer, state_holder
from stepdump.errors import (
    ConfigError,
    ReplayDiverged,
    StepNotFoundError,
    nearest_steps,
)
from stepdump.read.rows import fp_kind_map
from stepdump.store.format import STATE_FORWARD_RNG, STATE_OUTSIDE_OPTIMIZER, Key

if TYPE_CHECKING:
    from stepdump.read.run import Run

TrainStep = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]


@dataclass
class ReplayResult:
    """The state at ``step`` as the replay rebuilt it (params, grads, optimizer)."""

    step: int
    keyframe: int
    tensors: dict[Key, torch.Tensor] = field(default_factory=dict)
    steps_replayed: int = 0
    #: The RNG state at the start of iteration ``step`` as the replay reached it (recorded, or, at a
    #: step that holds none, the one the verified replayed iterations left).
    rng: dict[str, Any] | None = None

    def tensor(self, name: str, kind: str = "params") -> torch.Tensor:
        try:
            return self.tensors[(kind, name)]
        except KeyError:
            raise StepNotFoundError(f"the replay of step {self.step} has no {kind} {name!r}") from None


class _Stop(Exception):
    """Raised from the optimizer pre-hook to stop train_step before the target update."""


def replay(run: Run, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_step: TrainStep,
           scheduler: Any = None, scaler: Any = None, *, verify: bool = True,
           verify_step_grads: bool = True, batches: bool = True) -> ReplayResult:
    """Rebuild step ``step`` of ``run`` into ``model`` / ``optimizer`` (and scheduler, scaler).

    Args:
        run: A run recorded with ``keyframe_every`` (or any run: then only its
            full steps are keyframes).
        step: The step to rebuild.
        model, optimizer, scheduler, scaler: Freshly built objects of the same
            kind as in the recording; they end in the state of record ``step``
            (params and optimizer before update ``step``, grads of ``step``).
        train_step: ``train_step(model, optimizer, batch)`` does one iteration
            exactly as the recorded loop did (zero_grad, forward, backward,
            ``optimizer.step()``, and the scheduler step if there was one).
        verify: Check every replayed step against the recorded fingerprints.
        verify_step_grads: Also check the grads of ``step`` itself (re-execution compares them
            on its own, to tell a step that differs from its record from a replay that diverged).
        batches: Every replayed step needs its recorded batch. False (a lean run, which stores
            none): ``train_step`` gets ``None`` where no batch was stored and draws its own, as the
            recorded loop did; the fingerprint checks at every step say whether it drew the same.

    Returns:
        The rebuilt tensors of ``step`` (``result.tensor(name, kind)``). The run
        is only read: ``run.tensor(...)`` still returns what was recorded.
    """
    if step not in set(run.stats_steps):
        raise StepNotFoundError(f"step {step} was not recorded in {run.path}; {nearest_steps(step, run.stats_steps)}")
    keyframes = [s for s in run.steps if s <= step]
    if not keyframes:
        raise StepNotFoundError(f"no step at or before {step} is stored in full, so there is nothing to replay from")
    k = keyframes[-1]
    run.restore(k, model, optimizer, scheduler, scaler)
    layout = build_layout(model, optimizer)
    result = ReplayResult(step=step, keyframe=k)
    state: dict[str, Any] = {"t": k, "fired": False}
    fp_kinds = fp_kind_map(run.catalog)  # the series not fingerprinted with xxh3 (one query)

    def pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t = state["t"]
        state["fired"] = True
        live = _live_tensors(layout, opt)
        if verify:
            _verify_lr(run, t, opt)
            _verify(run, t, live, step_grads=t < step or verify_step_grads, fp_kinds=fp_kinds)
        if t == step:
            result.tensors = {key: v.detach().clone() for key, v in live.items()}
            raise _Stop

    handle = inner_optimizer(optimizer).register_step_pre_hook(pre_hook)  # accelerate's wrapper has no hooks
    forwards = ForwardRng(model)
    try:
        for t in range(k, step + 1):
            state["t"], state["fired"] = t, False
            st = run.step_state(t) if t == k or _has_state(run, t) else {}
            if "batch" not in st and batches:
                raise ConfigError(
                    f"step {t} has no recorded batch: record with keyframe_every=K and call rec.log_batch(batch) "
                    "every iteration"
                )
            if t > k:
                _apply_edits(run, t, st, layout)
            if "rng" in st:
                set_rng_state(st["rng"])
            if t == step:
                result.rng = st["rng"] if "rng" in st else get_rng_state()
            forwards.start(st.get(STATE_FORWARD_RNG), st.get("rng"))
            batch = recorded_batch(run, t, st) if "batch" in st else None
            try:
                train_step(model, optimizer, batch)
            except _Stop:
                break
            result.steps_replayed += 1
            if not state["fired"] and t not in set(run.skipped_steps):
                raise ReplayDiverged(
                    f"replaying step {t}: optimizer.step() was not called (the GradScaler skipped it?), but the "
                    "recording did update at that step"
                )
    finally:
        handle.remove()
        forwards.remove()
    # Like restore, leave the RNG at the start of iteration ``step``.
    if result.rng is not None:
        set_rng_state(result.rng)
    return result


def _apply_edits(run: Run, t: int, st: dict[str, Any], layout: Any) -> None:
    """Record ``t`` names params the loop changed after update ``t-1`` (a clamp, a Lookahead sync):
    set them to their stored values, as the loop did, before iteration ``t`` is replayed."""
    for name in st.get(STATE_OUTSIDE_OPTIMIZER) or []:
        p = layout.params.get(name)
        if p is None:
            raise ReplayDiverged(f"replaying step {t}: the recording changed param {name!r} before this step, "
                                 "but the model given has no such param")
        with torch.no_grad():
            p.copy_(run.tensor(name, t, kind="params"))


def batch_calls(names: Any) -> list[int]:
    """The ``log_batch`` calls of one iteration, from its ``inputs`` names (``batch/0#1``: call 1)."""
    out = {0}
    for n in names:
        tail = n.rsplit("#", 1)
        if n.startswith("batch") and len(tail) == 2 and tail[1].isdigit():
            out.add(int(tail[1]))
    return sorted(out)


def recorded_batch(run: Run, step: int, state: dict[str, Any]) -> Any:
    """Step ``step``'s batch as ``train_step`` gets it from replay and re-execution: what
    ``log_batch`` was given, or, when the iteration called it several times (micro-batches of a
    gradient accumulation), a list with what each call was given, in order."""
    names = [n for _, n in run.fingerprints(step, kinds=("inputs",))]
    batches = [tjson.decode(state["batch"], functools.partial(_input_call, run, step, "" if c == 0 else f"#{c}"))
               for c in batch_calls(names)]
    return batches[0] if len(batches) == 1 else batches


def _input_call(run: Run, step: int, suffix: str, ref: str) -> torch.Tensor:
    return run.tensor(ref + suffix, step, kind="inputs")


def _has_state(run: Run, t: int) -> bool:
    return run.catalog.has_state(t)


def _live_tensors(layout: Any, opt: torch.optim.Optimizer) -> dict[Key, torch.Tensor]:
    """The live tensors as the record holds them: a sparse grad as it is, sparse optimizer state
    (SGD momentum of sparse grads) dense, as its series (FORMAT.md, "Sparse tensors"). The optimizer
    state is taken where the Recorder took it: inside accelerate's wrapper, and from the optimizer a
    Lookahead-style wrapper keeps its state in (core/wrappers.py)."""
    out: dict[Key, torch.Tensor] = {}
    state = state_holder(inner_optimizer(opt)).state
    for name, p in layout.params.items():
        out[("params", name)] = p
        if p.grad is not None:
            out[("grads", name)] = as_recorded("grads", p.grad)
        for key, v in state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[("optimizer", f"{name}.{key}")] = as_recorded("optimizer", v)
    return out


def _verify_lr(run: Run, t: int, opt: torch.optim.Optimizer) -> None:
    """Hyperparameters are not tensors, so no fingerprint sees them: compare lr with the logged lr scalars."""
    rows = {name: value for _, name, value in run.scalar_rows(t) if name.startswith("lr")}
    for i, group in enumerate(opt.param_groups):
        name = "lr" if i == 0 else f"lr/{i}"
        if name in rows and rows[name] is not None and float(group["lr"]) != rows[name]:
            err = ReplayDiverged(
                f"replay diverged at step {t}: param group {i} has lr {float(group['lr'])!r}, the recording had "
                f"{rows[name]!r}. The replayed train_step must set the learning rate as the recorded loop did "
                "(pass the scheduler to replay and step it inside train_step)."
            )
            err.step, err.kind, err.name = t, "scalar", name
            raise err


def _verify(run: Run, t: int, live: dict[Key, torch.Tensor], step_grads: bool = True,
            fp_kinds: dict[Key, str] | None = None) -> None:
    """Raise ReplayDiverged unless every live tensor has the fingerprint recorded at ``t``, each
    computed under its series' kind (``fp_kinds``: those not xxh3, :func:`fp_kind_map`)."""
    recorded = run.fingerprints(t, kinds=("params", "grads", "optimizer") if step_grads else ("params", "optimizer"))
    order = {"grads": 0, "optimizer": 1, "params": 2}
    kinds = fp_kind_map(run.catalog) if fp_kinds is None else fp_kinds

    def fp(key: Key) -> int:
        kind = kinds.get(key, XXH3)
        return fingerprint(live[key]) if kind == XXH3 else fingerprint_as(kind, live[key])

    def ranked(key: Key) -> tuple[int, str]:
        kind, name = key
        return order.get(kind, 9), name

    bad = [key for key in sorted(recorded, key=ranked) if key in live and fp(key) != recorded[key]]
    missing = [key for key in recorded if key not in live]
    if bad or missing:
        kind, name = (bad or missing)[0]
        threads = run.meta.get("num_threads")
        err = ReplayDiverged(
            f"replay diverged at step {t}: {kind} {name!r} "
            + ("differs from the recording" if bad else "is missing in the replay")
            + f" ({len(bad) + len(missing)} tensor(s) in all). Likely causes: non-deterministic kernels "
            "(use torch.use_deterministic_algorithms(True)), a different thread count "
            f"(recorded with {threads}, now {torch.get_num_threads()}), data-loader workers or augmentation "
            "outside the recorded batch, or a train_step that differs from the recorded loop.",
        )
        err.step, err.kind, err.name = t, kind, name
        raise err
