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
reading several tensors of one step rebuilds it once; ``Run.close()`` drops it.

What a read costs beyond the optimizer steps is a copy and a hash per gradient, run beside
them: grads are read into buffers the chain keeps (fresh ones page-fault more than the update
costs), two per param, so that a worker thread reads and checks the grads of update t + 1 while
update t runs (pread, xxh3 and torch's kernels let go of the GIL): an update costs the longer
of the two, not their sum. The worker is the read call's own, joined when it ends however it
ends; what it could not read and verify the reading thread reads itself, raising the errors a
read without a worker raises. The keyframe is read once into the tensors the optimizer steps
(its params and the first update's grads on the worker, beside the optimizer state), and the
verified state is handed out from the chain itself (the cached state is dropped, not copied,
when the chain moves on). The catalog is read a window of steps at a time, and the check at the
target step hashes half its bytes on the worker.

This module is the engine; its collaborators, one idea each:

- gradlog_chain.py: the chain (stand-in params, live optimizer) and its grads read ahead;
- gradlog_keyframe.py: a chain's start, loaded from a keyframe;
- gradlog_window.py: the catalog facts of the updates, a window of steps at a time;
- gradlog_check.py: hashing a chain's state once to compare it with its record;
- gradlog_snapshot.py: the verified state of one step, cached and handed out;
- gradlog_budget.py: what a read call's rebuild may cost, checked before the work;
- gradlog_verify.py: ``stepdump verify`` of every segment;
- gradlog_why.py: why a rebuild cannot run, or does not reproduce its record.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.hashing import XXH3
from stepdump.errors import (
    CorruptDataError,
    ReadBudgetError,
    RebuildError,
    StepNotFoundError,
    nearest_steps,
)
from stepdump.read.blobs import check_layout
from stepdump.read.gradlog_budget import RebuildBudget
from stepdump.read.gradlog_chain import (
    REBUILT_KINDS,
    Chain,
    GroupsChanged,
    grad_buffer,
    halves,
    read_ahead,
    ready_grads,
)
from stepdump.read.gradlog_check import Trusted, fingerprints, live
from stepdump.read.gradlog_keyframe import read_tensor, start_chain
from stepdump.read.gradlog_snapshot import Snapshot, copied, take
from stepdump.read.gradlog_verify import SegmentReport, verify_segments
from stepdump.read.gradlog_why import mismatch_cause, refusal_of
from stepdump.read.gradlog_window import Window
from stepdump.read.rows import Recorded, differs_from_row
from stepdump.read.state import assemble_model_state, assemble_optimizer_state
from stepdump.store.format import (
    LEVEL_FULL,
    LEVEL_STATS,
    STATE_OUTSIDE_OPTIMIZER,
    Key,
    sparse_values_dtype,
)

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.run import Run

log = logging.getLogger(__name__)


def _params_first(key: Key) -> tuple[bool, str]:
    """The order the tensors of a step are compared in: params first, then by name."""
    kind, name = key
    return kind != "params", name

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
        self._chain: Chain | None = None
        self._snapshot: Snapshot | None = None
        self._refusal: RebuildError | None | bool = False  # False: not decided yet
        self._pool: ThreadPoolExecutor | None = None  # the worker of the read call under way (read_call)
        self._window = Window(run, blobs)  # the catalog facts of the updates, a window of steps at a time
        self.updates_applied = 0  # optimizer steps re-run so far (what a read costs)

    @property
    def run(self) -> Run:
        """The run read from."""
        return self._run

    def close(self) -> None:
        """Drop the cached rebuild (the run is closing): its params, optimizer state and buffers."""
        self._chain = self._snapshot = None
        self._window.clear()

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
        the step is not stored in full: every step of the log keeps its grads, module buffers and
        state (RNG included)."""
        return kind in (None, "grads", "buffers", *REBUILT_KINDS) and self._log_step(step)

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
        if kind == "params" and name in self._foreign():
            return self._borrow(name, step)
        snap = self._state(step, kind)
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
        snap = self._state(step, kind)
        foreign = self._foreign() if kind == "params" else {}
        return {n: self._borrow(n, step) if n in foreign else t.clone()
                for (k, n), t in snap.tensors.items() if k == kind}

    def names(self, step: int, kind: str) -> list[str]:
        """Names :meth:`tensors` returns at ``step``."""
        return list(self.tensors(step, kind))

    def state_dict(self, step: int) -> OrderedDict[str, torch.Tensor]:
        """``model.state_dict()`` at ``step``: rebuilt params, and the module buffers stored at that step."""
        snap = self._state(step, "params")
        stored = {(kind, n): row for (kind, n), row in self._rows(step).items()
                  if kind == "buffers" and row.blob is not None}

        foreign = self._foreign()

        def load(kind: str, name: str) -> torch.Tensor | None:
            if kind == "params" and name in foreign:
                return self._borrow(name, step)
            if kind == "params":
                t = snap.tensors.get(("params", name))
                return None if t is None else t.clone()
            row = stored.get((kind, name))
            if row is None:  # a log written before buffers were kept at every step, or include=/exclude=
                raise RebuildError(
                    f"{kind} {name!r} is not stored at step {step} of {self._run.path}, and module buffers "
                    f"(BatchNorm running stats) cannot be rebuilt from gradients; "
                    f"{nearest_steps(step, self.keyframes())} have them"
                )
            return self._blobs.tensor(row.blob, row.dtype, row.shape, row.fingerprint, row.fp_kind)

        return assemble_model_state(self._run, step, load)

    # -- a joint run's params that another pair's optimizer updates ---------------------------
    def _foreign(self) -> dict[str, tuple[str, str]]:
        """Meta ``joint_foreign`` (FORMAT.md): this pair's params another pair's optimizer updates,
        name -> (that pair, its name there). Replay of this pair's updates does not derive them."""
        meta = self._run.meta.get("joint_foreign")
        if meta is None:
            return {}
        if not (isinstance(meta, dict) and all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)
                                               for v in meta.values())):
            raise CorruptDataError(f"meta 'joint_foreign' in the catalog of {self._run.path} is malformed")
        return {n: (pair, name) for n, (pair, name) in meta.items()}

    def _borrow(self, name: str, step: int) -> torch.Tensor:
        """Param ``name`` at ``step``, from the pair whose optimizer updates it (its record at the
        matching moment, ``Run.foreign_source``), checked against this record's fingerprint."""
        pair, _ = self._foreign()[name]
        source = self._run.foreign_source
        if source is None:
            raise RebuildError(f"param {name!r} at step {step} of {self._run.path} is updated by pair {pair!r}'s "
                               "optimizer of a joint run: between keyframes its values are in that pair's record. "
                               "Open the joint run (stepdump.open of the parent directory) to read it")
        value = source(name, step)
        row = self._rows(step).get(("params", name))
        why = "has no record at that step" if row is None else differs_from_row(value, row, fp_kind=row.fp_kind)
        if why is not None:
            raise self._error(step, step, "params", name, f"param {name!r} taken from pair {pair!r} for step {step} "
                              f"{why}", mismatch=True)
        return value

    def optimizer_state_dict(self, step: int) -> dict[str, Any]:
        """``optimizer.state_dict()`` at ``step``: rebuilt tensors, recorded groups and extras."""
        snap = self._state(step, "optimizer")
        per_param = {n: {k: v.clone() for k, v in st.items()} for n, st in snap.per_param.items()}
        return assemble_optimizer_state(self._run, step, self._run.step_state(step), per_param)

    def verify_segments(self, progress: Callable[[int, int], None] | None = None) -> SegmentReport:
        """Re-apply every segment's recorded updates, keyframe to next keyframe, checking every step
        that has fingerprints: what ``stepdump verify`` adds for a gradient log (gradlog_verify.py).
        ``progress(done, total)``: after each segment."""
        return verify_segments(self, progress)

    # -- the chain -------------------------------------------------------------------
    @contextmanager
    def read_call(self) -> Iterator[RebuildBudget]:
        """The worker thread of one read call (``read_ahead``: the next update's grads), joined when
        the call ends, however it ends: no thread outlives a read, no buffer is written after; and
        the call's budget of rebuild work (gradlog_budget.py)."""
        pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepdump-gradlog")
        try:
            yield RebuildBudget()
        finally:  # (a chain's last Ahead, if any, is done now: its buffers hold verified grads)
            if self._pool is pool:  # not another thread's call since
                self._pool = None
            pool.shutdown(wait=True)

    def _state(self, step: int, kind: str) -> Snapshot:
        """The state before update ``step``, its ``kind`` verified; cached, and built from the
        cached chain when it is at or before ``step`` in the same segment."""
        if kind not in REBUILT_KINDS:
            raise StepNotFoundError(f"{kind} tensors are not rebuilt by a gradient log (only {REBUILT_KINDS})")
        snap = self._snapshot
        if snap is not None and snap.step == step and kind in snap.verified:
            return snap
        with self.read_call() as budget:
            return self._rebuild(step, kind, budget)

    def _rebuild(self, step: int, kind: str, budget: RebuildBudget) -> Snapshot:
        """:meth:`_state` past its cache, in the read call's :meth:`read_call`."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        keys = [k for k in self.keyframes() if k <= step]
        if not keys:
            raise RebuildError(f"step {step} of {self._run.path} comes before the first keyframe, so there is "
                               f"nothing to rebuild it from; {nearest_steps(step, self.keyframes())}")
        chain = self._chain
        if chain is None or not keys[-1] <= chain.step <= step:
            budget.reserve(self._run, keys[-1], step - 1, step)  # before the keyframe is even read
            self._chain = None
            chain = self._chain = self._start(keys[-1])
        else:
            budget.reserve(self._run, chain.step, step - 1, step)
        try:
            # Checked at ``step`` only (a difference on the way shows there too), and only the kind read
            # with the params: a state_dict() need not hash the optimizer state (for Adam twice the
            # params' bytes) at every step of a read in order; a later read of it here checks it then.
            want, moved = frozenset({"params", kind}), chain.step < step
            while chain.step < step:
                self._advance(chain, target=step, check=chain.step + 1 == step, kinds=want)
            if not moved and kind not in chain.checked:  # the chain was at ``step``, checked for another kind
                self._check(chain, step, kinds=frozenset({kind}))
            snap = take(chain)
            last = self._run.catalog.last_step()
            if kind not in snap.verified:  # no fingerprints at ``step``: verified by the next step that has them
                snap = copied(snap)  # the chain moves on from here
            while kind not in snap.verified:
                if last is None or chain.step >= last:
                    raise RebuildError(
                        f"step {step} of {self._run.path} has no fingerprints of its {kind}, and no later step "
                        "has them either, so its rebuild cannot be verified; read a keyframe "
                        f"({nearest_steps(step, self.keyframes())})"
                    )
                budget.reserve(self._run, chain.step, chain.step, step)
                self._advance(chain, target=step, check=True)
                snap.verified |= chain.checked
        except RebuildError as e:
            self._chain = None  # never continue from a state that failed (or half-applied) an update
            if e.kind in REBUILT_KINDS:
                self._locate(keys[-1], step, budget)  # name the first step that differs (the error path only)
            raise
        except BaseException:
            self._chain = None
            raise
        self._snapshot = snap
        return snap

    def _locate(self, k: int, step: int, budget: RebuildBudget) -> None:
        """Re-run keyframe ``k`` .. ``step`` checking every step: raises at the first that differs
        (returns, leaving the caller's error as it is, when that is over the read's budget)."""
        try:
            budget.reserve(self._run, k, step - 1, step)
        except ReadBudgetError:
            return
        self.replay(k, step)

    def replay(self, k: int, end: int) -> None:
        """Start a chain at keyframe ``k`` and re-apply its updates up to step ``end``, checking every
        step that has fingerprints (raises :class:`RebuildError` at the first that differs). Within
        a :meth:`read_call` whose budget has reserved the updates; the cached chain stays as it is."""
        chain = self._start(k)
        while chain.step < end:
            self._advance(chain, target=end, check=True)

    def _read(self, blob: Any, dtype: Any, shape: Any, fp: int, trusted: Trusted | None = None,
              fp_kind: str = XXH3) -> torch.Tensor:
        """A stored tensor in memory of its own (gradlog_keyframe.read_tensor)."""
        return read_tensor(self._blobs, blob, dtype, shape, fp, trusted, fp_kind)

    def _start(self, k: int) -> Chain:
        """Stand-in params and a fresh optimizer loaded with keyframe ``k`` (gradlog_keyframe.py)."""
        return start_chain(self._run, self._blobs, self._window, self._pool, k, self._device(),
                           lambda chain, trusted: self._check(chain, trusted=trusted))


    def _advance(self, chain: Chain, target: int, check: bool, kinds: frozenset[str] | None = None) -> None:
        """Re-apply update ``chain.step``; with ``check``, verify the state it gives at the next step
        (``kinds`` of it, default all)."""
        run, t = self._run, chain.step
        self._release(chain)  # the cached snapshot may be this chain's tensors, about to change
        groups = self._window.groups(t)
        if [list(g["params"]) for g in groups] != chain.groups:
            raise self._error(target, t, None, None, f"the optimizer's param groups at step {t} differ from those "
                              f"of keyframe {chain.keyframe} (add_param_group between keyframes), so its updates "
                              "cannot be re-applied; read a keyframe instead", cls=GroupsChanged)
        opt = chain.optimizer
        for group, g in zip(opt.param_groups, groups, strict=True):
            group.update({k: v for k, v in g["hyper"].items() if k != "params"})
        ahead, chain.ahead = chain.ahead, None
        rows = chain.rows or (ahead.rows if ahead is not None and ahead.step == t else self._rows(t))
        mine: list[str] = []
        theirs = [n for n in chain.params if n in chain.optimized]
        if self._pool is not None and (ahead is None or ahead.step != t):
            # Nothing read ahead (the first update of a read call that goes on from the cached chain:
            # reading steps in order): the worker reads half of the grads' bytes while this thread
            # reads the other half.
            half = halves({n: chain.params[n].numel() * chain.params[n].element_size() for n in theirs})[1]
            mine, theirs = [n for n in theirs if n not in half], [n for n in theirs if n in half]
            ahead = read_ahead(self._pool, self._blobs, {n: chain.params[n] for n in theirs}, chain.optimized,
                               chain.grads, t, rows, self._window.blob_row)
        for names, wait in ((mine, False), (theirs, True)):
            # name -> the row read from; waits for the worker: the buffers are ours
            ready: dict[str, Recorded] = ready_grads(ahead, t) if wait else {}
            for n in names:
                p, row = chain.params[n], rows.get(("grads", n))
                if row is None:
                    p.grad = None  # no gradient at this step: the optimizer leaves p (and its state) alone
                    continue
                p.grad = self._grad(chain, target, t, n, p, row, ready.get(n) == row)  # read ahead from this row
        if self._pool is not None and t + 1 < target:  # update t + 1 follows: read its grads meanwhile
            chain.ahead = read_ahead(self._pool, self._blobs, chain.params, chain.optimized, chain.grads, t + 1,
                                     self._rows(t + 1), self._window.blob_row)
        if not self._skipped(t):
            try:
                with torch.no_grad():  # as in training: no autograd bookkeeping of the in-place updates
                    opt.step()
            except Exception as e:
                raise self._error(target, t, None, None, f"{type(opt).__name__}.step() failed re-applying update "
                                  f"{t} ({type(e).__name__}: {e})") from e
            self.updates_applied += 1
        for p in chain.params.values():
            p.grad = None
        nxt = chain.ahead.rows if chain.ahead is not None and chain.ahead.step == t + 1 else {}
        chain.step, chain.rows, chain.checked = t + 1, nxt, frozenset()
        self._take_stored(chain, target)  # params changed outside the optimizer before update t + 1
        if check:
            self._check(chain, target, kinds=kinds)

    def _take_stored(self, chain: Chain, target: int) -> None:
        """Params that the record of ``chain.step`` stores because replay does not derive them (changed
        outside the optimizer after the previous update: capture/outside.py) replace the update's
        output: every param stored at a step between keyframes, and at a step stored in full the
        ones its state names (``outside_optimizer``)."""
        step = chain.step
        rows = chain.rows = chain.rows or self._rows(step)
        stored = {n: row for (kind, n), row in rows.items()
                  if kind == "params" and row.blob is not None and n in chain.params}
        if not stored:
            return
        level = self._run.catalog.level(step)
        if isinstance(level, int) and level >= LEVEL_FULL:
            named = self._run.step_state(step).get(STATE_OUTSIDE_OPTIMIZER)
            stored = {n: row for n, row in stored.items() if isinstance(named, list) and n in named}
        for n, row in stored.items():
            p, value = chain.params[n], self._read(row.blob, row.dtype, row.shape, row.fingerprint, fp_kind=row.fp_kind)
            if value.dtype != p.dtype or value.shape != p.shape:
                raise self._error(target, step, "params", n, f"param {n!r} is stored at step {step} as {value.dtype} "
                                  f"{tuple(value.shape)} but is {p.dtype} {tuple(p.shape)} at keyframe {chain.keyframe}")
            with torch.no_grad():
                p.copy_(value)

    def _grad(self, chain: Chain, target: int, t: int, n: str, p: torch.Tensor,
              row: Recorded, ready: bool) -> torch.Tensor:
        """The recorded gradient of ``n`` at step ``t``, in the chain's buffer for ``n`` and ``t``:
        read here unless ``ready`` (the worker read and verified it there, from this ``row``)."""
        dtype, shape, fp, blob, fk = row.dtype, row.shape, row.fingerprint, row.blob, row.fp_kind
        if blob is None:
            raise self._error(target, t, "grads", n, f"the gradient of {n!r} at step {t} has stats only, its "
                              f"values were not stored, so update {t} cannot be re-applied")
        if isinstance(dtype, str) and sparse_values_dtype(dtype) is not None:
            # A sparse grad: the very tensor the update was handed (indices in their order,
            # duplicates, coalesced flag), in memory of its own; nnz changes from step to step.
            g = self._blobs.sparse_tensor(blob, dtype, shape, fp, fk)
            if g.dtype != p.dtype or tuple(g.shape) != tuple(p.shape):
                raise self._error(target, t, "grads", n, f"the gradient of {n!r} at step {t} is a sparse {g.dtype} "
                                  f"{tuple(g.shape)} but the param is {p.dtype} {tuple(p.shape)}")
            return g if p.device.type == "cpu" else g.to(p.device)
        tdtype, dims, want = check_layout(dtype, shape)
        if tdtype != p.dtype or dims != tuple(p.shape):
            raise self._error(target, t, "grads", n, f"the gradient of {n!r} at step {t} is {tdtype} {dims} "
                              f"but the param is {p.dtype} {tuple(p.shape)}")
        buf = grad_buffer(chain.grads, t, n, tdtype, dims)
        if ready:
            with self._blobs.call() as scope:
                scope.returned += want  # what read_into counts: the call's decode budget stays the same
        else:
            self._blobs.read_into(buf, blob, dtype, shape, fp, fk)
        if p.device.type == "cpu":
            return buf
        # Another device: one buffer there too, filled from the host buffer (synchronously: then free).
        dev = chain.on_device.get(n)
        if dev is None:
            dev = chain.on_device[n] = torch.empty(dims, dtype=tdtype, device=p.device)
        return dev.copy_(buf)

    def _check(self, chain: Chain, target: int | None = None, trusted: Trusted | None = None,
               kinds: frozenset[str] | None = None) -> None:
        """Compare the chain's state with the fingerprints recorded at its step (raises on a
        difference); ``chain.checked`` says which kinds were compared, at this step so far.
        ``trusted``: the memory read verified since the chain started (a keyframe's tensors), not
        hashed again. ``kinds``: compare only these (default: every kind)."""
        step = chain.step
        rows = chain.rows = chain.rows or self._rows(step)
        recorded = {(kind, n): row for (kind, n), row in rows.items() if kind in REBUILT_KINDS}
        rebuilt = live(chain)
        foreign = self._foreign()  # not derived here: read from their pair, checked there (_borrow)
        if foreign:
            recorded = {(kind, n): r for (kind, n), r in recorded.items() if not (kind == "params" and n in foreign)}
            rebuilt = {(kind, n): t for (kind, n), t in rebuilt.items() if not (kind == "params" and n in foreign)}
        captured = set(self._run.meta.get("capture") or REBUILT_KINDS)
        # A kind is compared where the step records it: a stats-only step may leave the optimizer
        # state out (the lean capture reads it every few steps), a step without stats has none.
        compared = {kind for kind in REBUILT_KINDS if kind in captured and any(k == kind for k, _ in recorded)
                    and (kinds is None or kind in kinds)}
        # xxh3 hashed here, two threads (the fast path); a series of another kind by differs_from_row.
        fps = fingerprints(self._pool, {(kind, n): t for (kind, n), t in rebuilt.items() if kind in compared
                                        and (kind, n) in recorded and recorded[(kind, n)].fp_kind == XXH3},
                           trusted or {})
        for key in sorted(set(recorded) | set(rebuilt), key=_params_first):
            kind, name = key
            if kind not in compared:
                continue
            row, t = recorded.get(key), rebuilt.get(key)
            if row is None:
                why: str | None = "exists in the rebuild but not in the record"
            elif t is None:
                why = "is in the record but the rebuild has none"
            else:
                why = differs_from_row(t, row, fps.get(key), fp_kind=row.fp_kind)
            if why is None:
                continue
            raise self._error(step if target is None else target, step, kind, name,
                              f"re-applying the recorded updates from keyframe {chain.keyframe} gives {kind} "
                              f"{name!r} at step {step} that {why}", mismatch=True)
        # Nothing recorded and nothing rebuilt (a stateless SGD's optimizer state) agree as well.
        empty = {kind for kind in REBUILT_KINDS if not any(k == kind for k, _ in recorded)
                 and not any(k == kind for k, _ in rebuilt)}
        checked = compared | empty | chain.checked  # (kinds compared before at this same step stay so)
        chain.checked = frozenset(checked) if "params" in checked else frozenset()

    def _release(self, chain: Chain) -> None:
        """Before ``chain`` changes: a cached snapshot of its tensors is dropped. Copying it (the
        whole model and optimizer state, at every step of a read in order) cost a third of an
        update, to serve only a read that goes back a step; one state per run is kept, not two."""
        if self._snapshot is not None and self._snapshot.chain is chain:
            self._snapshot = None

    # -- what the run says -------------------------------------------------------------
    def _rows(self, step: int) -> dict[Key, Recorded]:
        """(kind, name) -> what the record says of each tensor at ``step``."""
        return self._window.rows(step)

    def _skipped(self, step: int) -> bool:
        return self._window.skipped(step)

    def refusal(self) -> RebuildError | None:
        """Why this run's optimizer cannot be re-run at all (None: it can)."""
        if self._refusal is False:
            self._refusal = refusal_of(self._run)
        return self._refusal  # type: ignore[return-value]

    def _device(self) -> torch.device:
        device = self._run.meta.get("device")
        return torch.device(device) if isinstance(device, str) and device.startswith("cuda") else torch.device("cpu")

    def _error(self, target: int, step: int, kind: str | None, name: str | None, what: str, *,
               mismatch: bool = False, cls: type[RebuildError] = RebuildError) -> RebuildError:
        text = f"step {target} of {self._run.path} cannot be rebuilt from the gradient log: {what}"
        if mismatch:
            text += f". The values are not returned. {mismatch_cause(self._run.meta, kind)}"
        text += f". Steps stored in full read as recorded ({nearest_steps(target, self.keyframes())})"
        err = cls(text)
        err.step, err.kind, err.name = step, kind, name
        return err

