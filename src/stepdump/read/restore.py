"""Restore a recorded step into live model / optimizer / scheduler / scaler / RNG / extra state.

Atomic: everything is read and checked first, the parts whose ``load_state_dict`` runs
unknown code (scheduler, scaler, extra-state objects, the RNG) by loading into a copy
(read/restore_checks.py, read/extra.py); only then is anything changed, so a mismatch
leaves the caller's objects exactly as they were and a RestoreMismatchError names the
part and the fix. One path for plain models and for models whose parameters are DTensors
(FSDP2 / tensor parallel: one rank's recorded shards go into its DTensors);
:func:`stepdump.replay` starts from it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.rng import set_rng_state
from stepdump.errors import ConfigError, RestoreMismatchError
from stepdump.read.extra import plan_extra
from stepdump.read.restore_checks import check_scaler, fingerprint_model_state, trial_rng, trial_scheduler
from stepdump.read.state import layout_entries as _state_dict_entries
from stepdump.store.format import STATE_CARRIED_GRADS

if TYPE_CHECKING:
    from stepdump.read.run import Run


def restore(run: Run, step: int, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
            scaler: Any = None, *, rng: bool = True, extra_state: Mapping[str, Any] | None = None) -> None:
    prepare(run, step, model, optimizer, scheduler, scaler, rng=rng, extra_state=extra_state)()


def prepare(run: Run, step: int, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
            scaler: Any = None, *, rng: bool = True,
            extra_state: Mapping[str, Any] | None = None) -> Callable[[], None]:
    """Check every part of a restore, changing nothing; return the function that loads it
    (a joint run checks every pair before it loads any: read/joint.py)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"restore needs the model (a torch.nn.Module), got {type(model).__name__}")
    from stepdump.core.dtensor import is_dtensor
    from stepdump.core.layout import unwrap
    from stepdump.core.wrappers import inner_optimizer, inner_scheduler

    model = unwrap(model)  # a torch.compile wrapper: the run names the inner module's tensors
    # accelerate's wrappers: the run holds the state of the torch objects inside (core/wrappers.py)
    optimizer, scheduler = inner_optimizer(optimizer), inner_scheduler(scheduler)
    sharded = any(is_dtensor(p) for p in model.parameters())
    meta = run.meta
    if meta.get("frozen") == "fingerprint" and not sharded:
        sd = fingerprint_model_state(run, step, model)  # frozen params: the live ones, checked bit for bit
    else:
        sd = run.state_dict(step)
    if sharded:
        _check_sharded_model(model, sd)
    else:
        _check_model(run, model, sd, step)
    osd = None
    plan = OptimizerPlan()
    if optimizer is not None:
        _check_class("optimizer", optimizer, meta)
        osd = run.optimizer_state_dict(step)
        if sharded:
            _shard_optimizer_state(osd, optimizer)
        else:
            plan = _check_optimizer(run, step, model, optimizer)
    if scheduler is not None:
        _check_class("scheduler", scheduler, meta)
    state = side_state(run, step, scheduler, scaler, rng)
    extra = plan_extra(run, step, extra_state)
    if scheduler is not None:
        trial_scheduler(scheduler, state["scheduler"], step, optimizer, plan.new_groups)
    if scaler is not None:
        check_scaler(scaler, state["scaler"], step)
    if rng:
        trial_rng(state["rng"], step)
    # All checks passed: apply. Nothing below is expected to fail; if it does, say what is half done.
    def load() -> None:
        done: list[str] = []
        try:
            done.append("optimizer's param groups")
            plan.add_groups(optimizer)
            apply(model, sd, optimizer, osd, scheduler, scaler, state, rng, done)
            done.append("extra state")
            extra.apply()
            done.append("params outside the model")
            plan.write_outside_params()
            done.append("grads carried into the iteration")
            set_carried_grads(run, step, model, optimizer, state)
        except Exception as e:
            loaded = ", ".join(done[:-1]) or "nothing"
            raise RestoreMismatchError(
                f"restoring step {step}: every part passed its checks, then loading the "
                f"{done[-1] if done else 'model'} failed ({type(e).__name__}: {e}); already restored: {loaded}. "
                "Restore again into freshly built objects") from e

    return load


def set_carried_grads(run: Run, step: int, model: torch.nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """The grads the recorded loop carried into iteration ``step`` (state ``carried_grads``: a zero
    grad kept by ``zero_grad(set_to_none=False)``, a grad nobody zeroes), set as the record holds
    them: the optimizer steps from them as it did (capture/carried.py). Every other grad stays as
    it is (a freshly built model's: None)."""
    names = state.get(STATE_CARRIED_GRADS) or []
    if not names:
        return
    from stepdump.core.layout import build_layout

    params = build_layout(model, optimizer).params if optimizer is not None else dict(model.named_parameters())
    for name in names:
        p = params.get(name)
        if p is not None:
            p.grad = run.tensor(name, step, kind="grads").to(p.device).clone()


def side_state(run: Run, step: int, scheduler: Any, scaler: Any, rng: bool) -> dict[str, Any]:
    """The step's scheduler / scaler / RNG state, checked against what the caller wants restored."""
    state = run.step_state(step)
    if scheduler is not None and state.get("scheduler") is None:
        raise RestoreMismatchError(f"{run.path} recorded no LR scheduler; call restore without scheduler=")
    if scaler is not None and state.get("scaler") is None:
        raise RestoreMismatchError(f"{run.path} recorded no GradScaler; call restore without scaler=")
    if rng and "rng" not in state:
        raise RestoreMismatchError(f"step {step} has no RNG state; pass rng=False to restore without it")
    return state


def apply(model: torch.nn.Module, sd: Any, optimizer: Any, osd: Any, scheduler: Any, scaler: Any,
          state: dict[str, Any], rng: bool, done: list[str] | None = None) -> None:
    """Load checked state into the live objects (nothing is checked here); ``done`` gets the name of
    each part as its load starts."""
    done = [] if done is None else done
    done.append("model")
    model.load_state_dict(sd, strict=True)
    if optimizer is not None:
        done.append("optimizer")
        optimizer.load_state_dict(osd)
    if scheduler is not None:
        done.append("scheduler")
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None:
        done.append("GradScaler")
        scaler.load_state_dict(state["scaler"])
    if rng:
        done.append("RNG")
        set_rng_state(state["rng"])


def _check_sharded_model(model: torch.nn.Module, sd: dict[str, Any]) -> None:
    """This rank's recorded shards against the live (DTensor) model; each shard is wrapped as a
    DTensor placed like the live parameter, so the live model must be sharded as the recorded
    one was (same world size, mesh and placements)."""
    from stepdump.core.dtensor import is_dtensor

    live = model.state_dict()
    for key in live:
        if key not in sd:
            raise RestoreMismatchError(f"the model has {key!r}, which the run did not record; restore into the "
                                       "same architecture")
    for key, t in sd.items():
        if key not in live:
            raise RestoreMismatchError(f"the run has {key!r}, which the model does not")
        target = live[key]
        local = target.to_local() if is_dtensor(target) else target
        if tuple(local.shape) != tuple(t.shape) or local.dtype != t.dtype:
            raise RestoreMismatchError(
                f"{key!r}: this rank recorded a {t.dtype} shard of shape {tuple(t.shape)}, the live model holds "
                f"{local.dtype} {tuple(local.shape)} here; restore with the same world size and sharding"
            )
        if is_dtensor(target):
            sd[key] = _as_dtensor(t, target)


def _shard_optimizer_state(osd: dict[str, Any], optimizer: Any) -> None:
    """Wrap the shard-shaped state of DTensor parameters in ``osd`` as DTensors placed like them."""
    from stepdump.core.dtensor import is_dtensor
    from stepdump.read.state import param_indices

    if len(osd["param_groups"]) != len(optimizer.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(osd["param_groups"], optimizer.param_groups)
    ):
        raise RestoreMismatchError("the run's optimizer param groups differ from this optimizer's; build the "
                                   "optimizer with the same groups")
    by_id = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    # The live optimizer numbers its parameters as the recorded state_dict does.
    params = [by_id[i] for i in param_indices([id(p) for p in g["params"]] for g in optimizer.param_groups)]
    for i, st in osd["state"].items():
        p = params[i]
        if not is_dtensor(p):
            continue
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.to_local().shape):
                st[k] = _as_dtensor(v, p)


def _as_dtensor(local: torch.Tensor, like: Any) -> torch.Tensor:
    """``local`` (this rank's recorded shard) as a DTensor placed like ``like``."""
    from torch.distributed.tensor import DTensor

    local = local.to(like.device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _check_class(what: str, obj: Any, meta: Mapping[str, Any]) -> None:
    """``obj`` is of the class the run recorded for ``what``: by module and qualified name (torch's
    and transformers' ``Adafactor`` differ), by bare name for a run that recorded only that."""
    from stepdump.core.classes import class_id, described, dotted, recorded_class, same_class

    if not same_class(obj, meta, what):
        given = dotted(class_id(type(obj))) if recorded_class(meta, what)[0] is not None else type(obj).__name__
        raise RestoreMismatchError(
            f"the run recorded a {described(meta, what)} {what}, but a {given} was given; build the same {what} "
            "as the recorded run"
        )


def _check_model(run: Run, model: torch.nn.Module, sd: dict[str, Any], step: int) -> None:
    from stepdump.read.state import layout_at

    live = model.state_dict()
    layout = layout_at(run, step)
    kept = layout.get("not_recorded", [])
    for key in live:
        if key in kept and key not in sd:  # extra state stepdump could not store: left as it is
            sd[key] = live[key]
            continue
        if key not in sd:
            raise RestoreMismatchError(
                f"the model has {key!r}, which the run did not record at step {step} (recorded model: "
                f"{run.meta.get('model_class')}){_structure_note(run, step)}; restore into the same architecture"
            )
    for key, t in sd.items():
        if key in kept:
            continue
        if key not in live:
            raise RestoreMismatchError(f"the run has {key!r} at step {step}, which the model does not"
                                       f"{_structure_note(run, step)}; restore into the same architecture")
        lt = live[key]
        if tuple(lt.shape) != tuple(t.shape) or lt.dtype != t.dtype:
            raise RestoreMismatchError(
                f"{key!r}: the run has {t.dtype} {tuple(t.shape)}, the model has {lt.dtype} {tuple(lt.shape)}; "
                "restore into the same architecture and dtype"
            )


def _structure_note(run: Run, step: int) -> str:
    """Where the run's model changed structure mid-run (pruning, a parametrization): which one
    record ``step`` holds, so that a refused restore says what model to build."""
    from stepdump.read.state import describe_change, layout_changes

    changes = layout_changes(run)
    if not changes:
        return ""
    said = "; ".join(f"at step {s} {describe_change(before, after)}" for s, before, after in changes)
    return f" (the run's model changed structure mid-run: {said}; restore step {step} into the model as it was then)"


@dataclass
class OptimizerPlan:
    """What restoring the optimizer changes beyond ``load_state_dict``, decided before anything is.

    ``new_groups``: param groups added after the run started (``add_param_group``,
    unfreezing) that the live optimizer does not have yet: they are added back, from
    the model's parameters of the recorded names. ``outside``: parameters the
    optimizer steps that the model does not own (a learnable temperature): the model's
    ``load_state_dict`` does not reach them, so their recorded values are copied in.
    """

    new_groups: list[dict[str, Any]] = field(default_factory=list)
    outside: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add_groups(self, optimizer: Any) -> None:
        for group in self.new_groups:
            optimizer.add_param_group(group)

    def write_outside_params(self) -> None:
        with torch.no_grad():
            for live, recorded in self.outside:
                live.copy_(recorded)


def _check_optimizer(run: Run, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerPlan:
    """Match the live optimizer's parameters to the recorded ones by name, group by group."""
    from stepdump.core.layout import build_layout

    recorded = run.step_state(step)["groups"]
    live_groups = build_layout(model, optimizer).groups
    plan = OptimizerPlan()
    if len(live_groups) > len(recorded):
        raise RestoreMismatchError(
            f"the run's optimizer had {len(recorded)} param groups at step {step}, this one has "
            f"{len(live_groups)}; build the optimizer with the groups it had at that step"
        )
    by_name = dict(model.named_parameters())
    for i in range(len(live_groups), len(recorded)):
        missing = [n for n in recorded[i]["params"] if n not in by_name]
        if missing:
            raise RestoreMismatchError(
                f"the run's optimizer had {len(recorded)} param groups at step {step}, this one has "
                f"{len(live_groups)}, and group {i} holds {missing[0]!r}, which is not a parameter of the model; "
                "build the optimizer with the groups it had at that step"
            )
        plan.new_groups.append({**recorded[i]["hyper"], "params": [by_name[n] for n in recorded[i]["params"]]})
        live_groups.append(list(recorded[i]["params"]))
    stored = set(run.stored_names(step, "params"))
    in_model = {name for _, kind, name in _state_dict_entries(run, step) if kind == "params"}
    live_params = [g["params"] for g in optimizer.param_groups]
    for i, (rec_names, live_names) in enumerate(zip((g["params"] for g in recorded), live_groups, strict=True)):
        if len(rec_names) != len(live_names):
            raise RestoreMismatchError(
                f"param group {i}: the run had {len(rec_names)} parameters at step {step}, this optimizer has "
                f"{len(live_names)}; build the optimizer with the same parameters"
            )
        for j, (name, live_name) in enumerate(zip(rec_names, live_names, strict=True)):
            if name != live_name:
                raise RestoreMismatchError(
                    f"param group {i}, parameter {j}: the run has {name!r} there at step {step}, this optimizer "
                    f"has {live_name!r}{_structure_note(run, step)}; pass the parameters to the optimizer in the "
                    "same order as the recorded run"
                )
            if name not in stored and name not in in_model:
                raise RestoreMismatchError(
                    f"step {step} did not record {name!r}, a parameter the optimizer steps that is not part of "
                    "the model, so restore cannot set it; record it (include= / capture='params') or restore "
                    "into an optimizer without it"
                )
            if i >= len(live_params) or name in in_model:
                continue  # a group restore adds (params from the model), or set by model.load_state_dict
            live = live_params[i][j]
            value = run.tensor(name, step, kind="params")
            if tuple(value.shape) != tuple(live.shape) or value.dtype != live.dtype:
                raise RestoreMismatchError(
                    f"param group {i}, parameter {j} ({name!r}): the run has {value.dtype} {tuple(value.shape)}, "
                    f"the optimizer's parameter is {live.dtype} {tuple(live.shape)}; pass the same parameters"
                )
            plan.outside.append((live, value))
    return plan
