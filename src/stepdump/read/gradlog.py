"""Gradient log: params and optimizer state at any step, rebuilt by re-applying recorded updates.

A gradient-log run (``Recorder(..., gradient_log=K)``, docs/gradient-log.md) stores the
gradients of every step in full, and params and optimizer state in full only at keyframes
(every K steps); at the other steps they have stats and exact fingerprints. Record *t* holds
the state before update *t*, the grads update *t* used and the param groups'
hyperparameters it used, so the state before update *s* is::

    keyframe k (the latest full step <= s); for t in k .. s-1: set each group's
    hyperparameters to step t's, p.grad = recorded grad of t, optimizer.step() unless t was skipped

No user code, no data, no forward or backward: a fresh optimizer of the recorded
``torch.optim`` class over stand-in parameters does it.

Nothing unverified is returned. After every re-applied update the rebuilt params and optimizer
tensors are compared with the fingerprints recorded at that step (xxh3-64 of the exact bytes,
the same hash a stored blob is checked against, so at a keyframe it is a bitwise comparison
with the stored tensors); the first difference raises :class:`~stepdump.errors.RebuildError`
naming the step and tensor. A target step without fingerprints is verified by running on to
the next step that has them. What cannot be re-run at all (a closure optimizer such as LBFGS,
a class outside ``torch.optim``, a missing gradient blob, a device this machine lacks) is
refused up front with the same error.

One chain is cached per run: reading steps in order re-applies one update per step, and
reading several tensors of one step rebuilds it once.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.dtypes import DTYPE_NAMES
from stepdump.core.hashing import fingerprint
from stepdump.errors import RebuildError, StepNotFoundError, nearest_steps
from stepdump.read.state import (
    assemble_model_state,
    assemble_optimizer_state,
    param_indices,
    recorded_groups,
)
from stepdump.store.format import LEVEL_FULL, LEVEL_STATS, format_shape

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.run import Run

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: The kinds a gradient log rebuilds; grads are stored at every step, buffers only at keyframes.
REBUILT_KINDS = ("params", "optimizer")
# Optimizers whose recorded (dense) gradients cannot drive them: SparseAdam refuses dense grads,
# and the sparse index set it updates is not kept by the dense record.
_NEEDS_SPARSE_GRADS = ("SparseAdam",)


@dataclass
class _Chain:
    """Stand-in params and a live optimizer holding the state before update ``step``."""

    keyframe: int
    step: int
    params: dict[str, torch.Tensor]  # recorded name -> the leaf tensor the optimizer steps
    groups: list[list[str]]  # every group's recorded names (also those not rebuilt: include/exclude)
    optimized: set[str]  # the params of ``params`` the optimizer steps
    optimizer: torch.optim.Optimizer
    checked: bool = False  # the state at ``step`` matched that step's record
    rows: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # step's rows: (dtype, shape, fp, blob)


@dataclass
class _Snapshot:
    """The verified state of one step: private copies, handed out as clones."""

    step: int
    tensors: dict[Key, torch.Tensor]
    per_param: dict[str, dict[str, torch.Tensor]]


class GradientLog:
    """The rebuild engine of one run (a :class:`~stepdump.read.run.Run` holds one when its meta
    says ``gradient_log``).

    Args:
        run: The run read from.
        blobs: Its blob reader (grads are decoded straight from their rows).
        keyframe: Which steps the chains start from (default: the steps stored in full). A
            predicate such as ``lambda s: s % K == 0`` treats a run recorded in full as a
            gradient log, which is how the engine is tested against stored truth.
    """

    def __init__(self, run: Run, blobs: BlobReader, keyframe: Callable[[int], bool] | None = None) -> None:
        self._run = run
        self._blobs = blobs
        self._keyframe = keyframe
        self._chain: _Chain | None = None
        self._snapshot: _Snapshot | None = None
        self._refusal: RebuildError | None | bool = False  # False: not decided yet
        self.updates_applied = 0  # optimizer steps re-run so far (what a read costs)

    # -- which steps ---------------------------------------------------------------
    def keyframes(self) -> list[int]:
        """Steps the chains start from: stored in full (params and optimizer state)."""
        full = self._run.catalog.steps(LEVEL_FULL)
        return full if self._keyframe is None else [s for s in full if self._keyframe(s)]

    def rebuilds(self, step: int, kind: str | None) -> bool:
        """Whether ``kind`` at ``step`` comes from a rebuild (``None``: any of the rebuilt kinds):
        a recorded non-keyframe step at or after the first keyframe."""
        if kind is not None and kind not in REBUILT_KINDS:
            return False
        return self._log_step(step) and not self._is_keyframe(step)

    def readable(self, step: int, kind: str | None) -> bool:
        """Whether ``kind`` (``None``: the step's non-tensor state) may be read at ``step`` although
        the step is not stored in full: every step of the log keeps its grads and its state."""
        return kind in (None, "grads", *REBUILT_KINDS) and self._log_step(step)

    def readable_steps(self) -> list[int]:
        """Keyframes, and every later recorded step when the optimizer can be re-run."""
        keys = self.keyframes()
        if not keys or self.refusal() is not None:
            return keys
        return sorted(set(keys) | {s for s in self._run.catalog.steps(LEVEL_STATS) if s >= keys[0]})

    def _is_keyframe(self, step: int) -> bool:
        level = self._run.catalog.level(step)
        if self._keyframe is not None:
            return level is not None and level >= LEVEL_FULL and self._keyframe(step)
        return level is not None and level >= LEVEL_FULL

    def _log_step(self, step: int) -> bool:
        level = self._run.catalog.level(step)
        if not isinstance(level, int) or level < LEVEL_STATS:
            return False
        first = self._run.catalog.steps(LEVEL_FULL)
        return bool(first) and step >= first[0]

    # -- reading -------------------------------------------------------------------
    def tensor(self, name: str, step: int, kind: str) -> torch.Tensor:
        """The rebuilt ``kind`` tensor ``name`` at ``step`` (a fresh copy)."""
        snap = self._state(step)
        try:
            return snap.tensors[(kind, name)].clone()
        except KeyError:
            if kind == "params" or self._run.catalog.series_id(kind, name) is None:
                raise RebuildError(f"{kind} {name!r} at step {step} of {self._run.path} is not rebuilt: its "
                                   "gradients or keyframe values were not recorded (include= / exclude=)") from None
            raise StepNotFoundError(f"{kind} {name!r} has no value at step {step} (optimizer state not created "
                                    "yet for that parameter)") from None

    def tensors(self, step: int, kind: str) -> dict[str, torch.Tensor]:
        """Every rebuilt ``kind`` tensor at ``step``, by name, in recording order of the params."""
        snap = self._state(step)
        return {n: t.clone() for (k, n), t in snap.tensors.items() if k == kind}

    def names(self, step: int, kind: str) -> list[str]:
        """Names :meth:`tensors` returns at ``step``."""
        return list(self.tensors(step, kind))

    def state_dict(self, step: int) -> OrderedDict[str, torch.Tensor]:
        """``model.state_dict()`` at ``step``: rebuilt params; buffers only where stored."""
        snap = self._state(step)
        stored = {n: row for n, row in self._rows(step).items() if n[0] == "buffers" and row[3] is not None}

        def load(kind: str, name: str) -> torch.Tensor | None:
            if kind == "params":
                t = snap.tensors.get(("params", name))
                return None if t is None else t.clone()
            row = stored.get((kind, name))
            if row is None:
                raise RebuildError(
                    f"{kind} {name!r} is not stored at step {step} of {self._run.path}: a gradient log keeps "
                    "module buffers (BatchNorm running stats) at keyframes only, and they cannot be rebuilt "
                    f"from gradients; {nearest_steps(step, self.keyframes())} have them"
                )
            return self._blobs.tensor(row[3], row[0], row[1], row[2])

        return assemble_model_state(self._run, step, load)

    def optimizer_state_dict(self, step: int) -> dict[str, Any]:
        """``optimizer.state_dict()`` at ``step``: rebuilt tensors, recorded groups and extras."""
        snap = self._state(step)
        per_param = {n: {k: v.clone() for k, v in st.items()} for n, st in snap.per_param.items()}
        return assemble_optimizer_state(self._run, step, self._run.step_state(step), per_param)

    # -- the chain -------------------------------------------------------------------
    def _state(self, step: int) -> _Snapshot:
        """The verified state before update ``step``; cached, and built from the cached chain
        when it is at or before ``step`` in the same segment."""
        if self._snapshot is not None and self._snapshot.step == step:
            return self._snapshot
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        keys = [k for k in self.keyframes() if k <= step]
        if not keys:
            raise RebuildError(f"step {step} of {self._run.path} comes before the first keyframe, so there is "
                               f"nothing to rebuild it from; {nearest_steps(step, self.keyframes())}")
        chain = self._chain
        if chain is None or not keys[-1] <= chain.step <= step:
            chain = self._chain = self._start(keys[-1])
        try:
            while chain.step < step:  # checked at ``step`` only: a difference on the way shows there too
                self._advance(chain, target=step, check=chain.step + 1 == step)
            snap = self._take(chain)
            last = self._run.catalog.last_step()
            while not chain.checked:  # no fingerprints at ``step``: verified by the next step that has them
                if last is None or chain.step >= last:
                    raise RebuildError(
                        f"step {step} of {self._run.path} has no fingerprints of its params and optimizer state, "
                        "and no later step has them either, so its rebuild cannot be verified; read a keyframe "
                        f"({nearest_steps(step, self.keyframes())})"
                    )
                self._advance(chain, target=step, check=True)
        except RebuildError as e:
            self._chain = None  # never continue from a state that failed (or half-applied) an update
            if e.kind in REBUILT_KINDS:
                self._locate(keys[-1], step)  # name the first step that differs (the error path only)
            raise
        except BaseException:
            self._chain = None
            raise
        self._snapshot = snap
        return snap

    def _locate(self, k: int, step: int) -> None:
        """Re-run keyframe ``k`` .. ``step`` checking every step: raises at the first that differs."""
        chain = self._start(k)
        while chain.step < step:
            self._advance(chain, target=step, check=True)

    def _start(self, k: int) -> _Chain:
        """Stand-in params and a fresh optimizer loaded with keyframe ``k``."""
        run = self._run
        cls = getattr(torch.optim, run.meta["optimizer_class"])  # refusal() checked it is one
        state = run.step_state(k)
        groups = [list(g["params"]) for g in recorded_groups(run, k, state)]
        hyper = [dict(g["hyper"]) for g in recorded_groups(run, k, state)]
        stored = [n for (kind, n), row in self._rows(k).items() if kind == "params" and row[3] is not None]
        device = self._device()
        # Every param stored at the keyframe: those the optimizer steps, and the model's others
        # (not optimized: they keep their keyframe value, which each step's fingerprints confirm).
        order = {n: i for i, n in enumerate([*param_indices(groups), *stored])}
        params: dict[str, torch.Tensor] = {}
        for n in sorted(stored, key=order.__getitem__):
            # A private copy: the decoded tensor may share memory with the reader's buffers.
            t = run.tensor(n, k, "params").to(device, copy=True)
            params[n] = torch.nn.Parameter(t, requires_grad=t.is_floating_point() or t.is_complex())
        if not any(n in params for g in groups for n in g):
            raise RebuildError(f"keyframe {k} of {run.path} stores no optimized params, so nothing can be rebuilt "
                               "from it; record with capture including 'params'")
        # The constructor's own flags (fused, foreach, capturable, differentiable, ...) decide
        # which kernel runs: give it group 0's recorded values; each group keeps its own too.
        accepted = set(inspect.signature(cls).parameters)
        kwargs = {key: v for key, v in hyper[0].items() if key in accepted and key != "params"}
        arg = [{**h, "params": [params[n] for n in g if n in params]} for g, h in zip(groups, hyper, strict=True)]
        osd = run.optimizer_state_dict(k)
        # load_state_dict keeps tensors already of the param's dtype and device as they are: give it
        # private copies (decoded blobs may be views of read buffers, and slow to update in place).
        for st in osd["state"].values():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[key] = v.clone()
        # Renumber the recorded state for the params rebuilt (a subset under include=/exclude=).
        old = param_indices(groups)
        new = param_indices([[n for n in g if n in params] for g in groups])
        osd = {"state": {new[n]: osd["state"][old[n]] for n in new if old[n] in osd["state"]},
               "param_groups": [{**pg, "params": [new[n] for n in g if n in params]}
                                for pg, g in zip(osd["param_groups"], groups, strict=True)]}
        try:
            opt = cls(arg, **kwargs)
            opt.load_state_dict(osd)
        except Exception as e:  # torch refuses this configuration here (fused on this device, ...)
            raise RebuildError(f"cannot rebuild from keyframe {k} of {run.path}: building a {cls.__name__} with the "
                               f"recorded hyperparameters and state failed on {device} ({type(e).__name__}: {e})") from e
        chain = _Chain(keyframe=k, step=k, params=params, groups=groups,
                       optimized={n for g in groups for n in g if n in params}, optimizer=opt)
        self._check(chain)
        if not chain.checked:
            log.debug("stepdump: keyframe %s of %s has no fingerprints to check its loaded state against", k, run.path)
        return chain

    def _advance(self, chain: _Chain, target: int, check: bool) -> None:
        """Re-apply update ``chain.step``; with ``check``, verify the state it gives at the next step."""
        run, t = self._run, chain.step
        state = run.step_state(t)
        groups = recorded_groups(run, t, state)
        if [list(g["params"]) for g in groups] != chain.groups:
            raise self._error(target, t, None, None, f"the optimizer's param groups at step {t} differ from those "
                              f"of keyframe {chain.keyframe} (add_param_group between keyframes), so its updates "
                              "cannot be re-applied; read a keyframe instead")
        opt = chain.optimizer
        for live, g in zip(opt.param_groups, groups, strict=True):
            live.update({k: v for k, v in g["hyper"].items() if k != "params"})
        rows = chain.rows if chain.rows else self._rows(t)
        for n, p in chain.params.items():
            if n not in chain.optimized:
                continue
            row = rows.get(("grads", n))
            if row is None:
                p.grad = None  # no gradient at this step: the optimizer leaves p (and its state) alone
                continue
            if row[3] is None:
                raise self._error(target, t, "grads", n, f"the gradient of {n!r} at step {t} has stats only, its "
                                  f"values were not stored, so update {t} cannot be re-applied")
            grad = self._blobs.tensor(row[3], row[0], row[1], row[2]).to(p.device)
            if grad.dtype != p.dtype or grad.shape != p.shape:
                raise self._error(target, t, "grads", n, f"the gradient of {n!r} at step {t} is {grad.dtype} "
                                  f"{tuple(grad.shape)} but the param is {p.dtype} {tuple(p.shape)}")
            p.grad = grad
        if not self._skipped(t):
            try:
                opt.step()
            except Exception as e:
                raise self._error(target, t, None, None, f"{type(opt).__name__}.step() failed re-applying update "
                                  f"{t} ({type(e).__name__}: {e})") from e
            self.updates_applied += 1
        for p in chain.params.values():
            p.grad = None
        chain.step, chain.rows, chain.checked = t + 1, {}, False
        if check:
            self._check(chain, target)

    def _check(self, chain: _Chain, target: int | None = None) -> None:
        """Compare the chain's state with the fingerprints recorded at its step (raises on a difference)."""
        step = chain.step
        rows = self._rows(step)
        chain.rows = rows
        recorded = {key: row for key, row in rows.items() if key[0] in REBUILT_KINDS}
        if not any(key[0] == "params" for key in recorded):
            return  # no stats at this step: checked at a later one
        live = self._live(chain)
        captured = set(self._run.meta.get("capture") or REBUILT_KINDS)
        for key in sorted(set(recorded) | set(live), key=lambda k: (k[0] != "params", k[1])):
            if key[0] not in captured:
                continue
            row, t = recorded.get(key), live.get(key)
            if row is None:
                why = "exists in the rebuild but not in the record"
            elif t is None:
                why = "is in the record but the rebuild has none"
            elif DTYPE_NAMES.get(t.dtype) != row[0] or format_shape(t.shape) != row[1]:
                why = f"is {t.dtype} {tuple(t.shape)} in the rebuild, {row[0]} {row[1]} in the record"
            elif fingerprint(t) != row[2]:
                why = "differs from its recorded fingerprint"
            else:
                continue
            raise self._error(step if target is None else target, step, key[0], key[1],
                              f"re-applying the recorded updates from keyframe {chain.keyframe} gives {key[0]} "
                              f"{key[1]!r} at step {step} that {why}", mismatch=True)
        chain.checked = True

    def _live(self, chain: _Chain) -> dict[Key, torch.Tensor]:
        out: dict[Key, torch.Tensor] = {}
        for n, p in chain.params.items():
            out[("params", n)] = p.detach()
        for n, p in chain.params.items():
            for k, v in chain.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):  # sparse state: its record is the dense series
                    out[("optimizer", f"{n}.{k}")] = v.detach() if v.layout == torch.strided else v.to_dense()
        return out

    def _take(self, chain: _Chain) -> _Snapshot:
        tensors: dict[Key, torch.Tensor] = {}
        per_param: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in chain.params.items():
            tensors[("params", n)] = p.detach().clone()
        for n, p in chain.params.items():
            for k, v in chain.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                    c = v.detach().clone()
                    tensors[("optimizer", f"{n}.{k}")] = c
                    per_param.setdefault(n, {})[k] = c
        return _Snapshot(chain.step, tensors, per_param)

    # -- what the run says -------------------------------------------------------------
    def _rows(self, step: int) -> dict[Key, tuple[Any, ...]]:
        """(kind, name) -> (dtype, shape, fingerprint, blob) of every tensor row at ``step``."""
        return {(kind, name): (dtype, shape, fp, blob)
                for _, kind, name, dtype, shape, fp, blob in self._run.catalog.fingerprint_block(step, step)}

    def _skipped(self, step: int) -> bool:
        return any(bool(v) for _, v in self._run.catalog.skipped_flags(step))

    def refusal(self) -> RebuildError | None:
        """Why this run's optimizer cannot be re-run at all (None: it can)."""
        if self._refusal is False:
            self._refusal = self._why_not()
        return self._refusal  # type: ignore[return-value]

    def _why_not(self) -> RebuildError | None:
        name = self._run.meta.get("optimizer_class")
        cls = getattr(torch.optim, name, None) if isinstance(name, str) else None
        where = f"{self._run.path} (a gradient log)"
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            return RebuildError(f"{where} was recorded with optimizer {name!r}, which is not a torch.optim class, so "
                                "its updates cannot be re-applied here; only keyframes are readable")
        closure = inspect.signature(cls.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            return RebuildError(f"{where} was recorded with {name}, which re-evaluates the loss inside step() (a "
                                "closure), so its updates cannot be re-applied from recorded gradients; only "
                                "keyframes are readable (record with keyframe_every=K and use stepdump.replay, or "
                                "record every step in full)")
        if name in _NEEDS_SPARSE_GRADS:
            return RebuildError(f"{where} was recorded with {name}, which needs sparse gradients; a run stores them "
                                "dense, so its updates cannot be re-applied; only keyframes are readable")
        device = self._run.meta.get("device")
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            return RebuildError(f"{where} was recorded on {device}; its updates must be re-applied by the same "
                                "kernels, and this machine has no CUDA device; only keyframes are readable here")
        return None

    def _device(self) -> torch.device:
        device = self._run.meta.get("device")
        return torch.device(device) if isinstance(device, str) and device.startswith("cuda") else torch.device("cpu")

    def _error(self, target: int, step: int, kind: str | None, name: str | None, what: str, *,
               mismatch: bool = False) -> RebuildError:
        meta = self._run.meta
        text = f"step {target} of {self._run.path} cannot be rebuilt from the gradient log: {what}"
        if mismatch:
            text += (f". The values are not returned. Likely causes: other kernels than the recording's (recorded "
                     f"with torch {meta.get('torch_version')} on {meta.get('device', 'an unrecorded device')}, "
                     f"rebuilding with torch {torch.__version__} on {self._device()}), sparse gradients (stored "
                     "dense), or a damaged gradient or hyperparameter record (`stepdump verify` checks the bytes)")
        text += f". Steps stored in full read as recorded ({nearest_steps(target, self.keyframes())})"
        err = RebuildError(text)
        err.step, err.kind, err.name = step, kind, name
        return err

