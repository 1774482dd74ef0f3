"""Lean capture: stats and fingerprints of the live tensors, off the training thread, no copy.

A stats-only record does not need the tensors' bytes, only what they say: their
health stats and an exact fingerprint. Copying the whole record into staging to
compute those later is what made stats-only steps cost ~1.3x. Here the
training thread hands *references* to a worker thread, which reads the live
tensors while they cannot change:

* params and optimizer state as they are before update *t* do not change from
  the first training forward of iteration *t* until ``optimizer.step()`` begins
  (the forward and backward only read them; user code that edits weights, such
  as clamping after the step, runs before the forward). The Recorder submits
  them when the forward starts (:meth:`LeanWorker.submit`) and collects the
  result at the optimizer pre-hook (:meth:`LeanJob.rows_for`);
* grads are final at the pre-hook and no torch optimizer writes into them, so
  they are submitted there and collected at the post-hook, while the update runs.

Every tensor's version counter (``Tensor._version``, bumped by every in-place
op) is read when it is submitted and again when its result is used: a tensor
that changed in between, or that is not the same object any more (a new param
group, ``load_state_dict``), is computed again on the training thread, so a
row always describes the tensor as it was at the moment the record is of.

Stats per tensor: numel, NaN/+Inf/-Inf counts (exact), min, max and L2 norm,
the norms of the large float tensors from one fused ``torch._foreach_norm``;
small tensors (most of a transformer's, few of its bytes) get every stat of
:func:`stepdump.core.stats.compute_stats`. The fingerprint is the same exact
xxh3 of the bytes as at a full step, so ``diff`` and gradient-log verification
can trust it. Three passes over the bytes in all: norm, aminmax, hash.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from stepdump.capture.staging import storable
from stepdump.core.dtensor import local_part
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import StatsTuple, compute_stats
from stepdump.store.format import format_shape

log = logging.getLogger(__name__)

# Tensors up to this many elements go through compute_stats (its numpy path is
# cheaper than four torch dispatches); larger fp32/fp64 ones take the fused path.
_SMALL = 4096
_FUSED_DTYPES = (torch.float32, torch.float64)


class LeanRow(NamedTuple):
    """One tensor's row of a stats-only record, ready for the catalog."""

    kind: str
    name: str
    param: str | None
    key: str | None
    dtype: str
    shape: str
    stats: StatsTuple
    fp: int


Entry = tuple  # (kind, name, tensor, full, param, key), as capture.naming.tensor_entries makes them


def lean_rows(entries: Sequence[Entry], warned: set[tuple[str, str]]) -> list[LeanRow]:
    """Stats and fingerprint rows of ``entries`` (live tensors), computed now, on this thread."""
    rows: list[LeanRow | None] = [None] * len(entries)
    fused: list[tuple[int, torch.Tensor]] = []
    with torch.no_grad():
        tensors: list[torch.Tensor | None] = []
        for i, (kind, name, tensor, _full, _param, _key) in enumerate(entries):
            t = storable(kind, name, local_part(tensor.detach()), warned)
            tensors.append(t)
            if t is None:
                continue
            if (t.dtype in _FUSED_DTYPES and t.numel() > _SMALL and t.device.type == "cpu"
                    and t.layout == torch.strided):  # a sparse grad: compute_stats, over its values
                fused.append((i, t))
        norms = torch._foreach_norm([t for _, t in fused]) if fused else []
        large = {i: (t, norm) for (i, t), norm in zip(fused, norms, strict=True)}
        for i, (kind, name, _tensor, _full, param, key) in enumerate(entries):
            t = tensors[i]
            if t is None:
                continue
            if i in large:
                stats = _large_stats(t, large[i][1])
            else:
                stats = compute_stats(t) if kind != "state" else (t.numel(),) + (None,) * 9  # type: ignore[assignment]
            rows[i] = LeanRow(kind, name, param, key, stored_dtype(t), format_shape(t.shape), stats,
                              fingerprint(t))
    return [r for r in rows if r is not None]


def _large_stats(t: torch.Tensor, norm_t: torch.Tensor) -> StatsTuple:
    """Stats of a large fp32/fp64 tensor given its fused norm: one more pass (aminmax).

    Mean, std and the zero fraction would take two more passes over every large
    tensor (a sum; ``count_nonzero``, the costliest of all), which is most of
    what a stats-only step costs; they are NULL ("not measured", FORMAT.md) at
    lean steps, except a zero fraction that min and max prove to be 0. A tensor
    whose norm is not finite gets every stat, the exact counts included.
    """
    norm = float(norm_t)
    if not math.isfinite(norm):  # a NaN or Inf somewhere (rare): the exact counts, the slow way
        return compute_stats(t)
    x = t.reshape(-1)
    n = x.numel()
    vmin, vmax = (float(v) for v in torch.aminmax(x))
    zero_frac = 0.0 if vmin > 0 or vmax < 0 else None
    return (n, 0, 0, 0, vmin, vmax, None, None, norm, zero_frac)


class LeanJob:
    """Rows being computed on the worker for tensors whose versions were noted at submit."""

    def __init__(self, entries: list[Entry], pool: ThreadPoolExecutor,
                 compute: Callable[[list[Entry]], list[LeanRow | None]]) -> None:
        self._entries = entries
        self._versions = [_version(e[2]) for e in entries]  # before the worker may read them
        self._future: Future[list[LeanRow | None]] = pool.submit(compute, entries)

    def rows_for(self, entries: Sequence[Entry], warned: set[tuple[str, str]],
                 recompute: bool = True) -> tuple[list[LeanRow], int]:
        """Rows for ``entries`` (the tensors as they are now): the worker's where the same
        tensor is unchanged since submit, else computed here (``recompute``) or left out;
        and how many were not the worker's."""
        results = self._future.result()
        # A row is good for an entry when it was computed from the same tensor object,
        # and no in-place op touched that tensor from submit until now.
        ready: dict[tuple[str, str], tuple[torch.Tensor, LeanRow]] = {}
        for (kind, name, tensor, *_), v0, row in zip(self._entries, self._versions, results, strict=True):
            if row is not None and _version(tensor) == v0:
                ready[(kind, name)] = (tensor, row)
        out: list[LeanRow] = []
        redo: list[Entry] = []
        for e in entries:
            hit = ready.get((e[0], e[1]))
            if hit is not None and hit[0] is e[2]:
                out.append(hit[1])
            else:
                redo.append(e)
        if redo and recompute:
            out.extend(lean_rows(redo, warned))
        return out, len(redo)


def _version(t: torch.Tensor) -> int:
    return int(t._version)


class LeanWorker:
    """One background thread computing lean rows (torch reductions and xxh3 release the GIL)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepdump-stats")
        self._warned: set[tuple[str, str]] = set()

    @property
    def warned(self) -> set[tuple[str, str]]:
        return self._warned

    def submit(self, entries: Sequence[Entry]) -> LeanJob:
        return LeanJob(list(entries), self._pool, self._compute)

    def _compute(self, entries: list[Entry]) -> list[LeanRow | None]:
        rows = {(r.kind, r.name): r for r in lean_rows(entries, self._warned)}
        return [rows.get((e[0], e[1])) for e in entries]

    def close(self) -> None:
        self._pool.shutdown(wait=True)



# Optimizer state at a lean step only every this many steps. Adam's state is two
# thirds of the bytes a stats-only step reads; its stats move slowly, and the
# fingerprints of the params (every step) show the first step an update differed.
OPTIMIZER_EVERY = 10


def _before_update(step: int, entries: list[Entry], every: int | None) -> list[Entry]:
    """What the worker reads before update ``step``: params, and optimizer state every ``every``
    steps (None: OPTIMIZER_EVERY)."""
    every = OPTIMIZER_EVERY if every is None else every
    return [e for e in entries if e[0] != "grads" and (e[0] != "optimizer" or step % every == 0)]


class LeanCapture:
    """The Recorder's side of lean capture: when to submit what, and the message held
    until the step's grads are read (the post-hook sends it). Not ``enabled`` (the ring,
    CUDA): every method is a no-op and stats-only steps are copied like full ones."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # Steps between reads of the optimizer state (None: OPTIMIZER_EVERY); a gradient log
        # reads it every step, so that a rebuild is verified at the step it is read at.
        self.optimizer_every: int | None = None
        self._worker = LeanWorker()
        self._before: LeanJob | None = None  # params + optimizer state of the coming update
        self._pending: tuple[Any, LeanJob, list[Entry]] | None = None  # (message, grads job, grad entries)
        self._grads_now = False  # grads computed at the pre-hook (after one was changed during a step)

    def forward_started(self, step: int, entries: list[Entry]) -> None:
        """The iteration's first training forward: its params and optimizer state are final."""
        if self._before is None:
            self._before = self._worker.submit(_before_update(step, entries, self.optimizer_every))

    def take(self, msg: Any, entries: list[Entry]) -> bool:
        """Fill ``msg.lean`` for the step's ``entries`` (live tensors, none stored in full); the
        grads' rows follow in :meth:`finish`, so the message is held until then (True; False:
        no grads among ``entries``, the message is complete)."""
        before = _before_update(msg.step, entries, self.optimizer_every)
        grads = [e for e in entries if e[0] == "grads"]
        job, self._before = self._before, None
        if job is not None:
            rows, _ = job.rows_for(before, self._worker.warned)
        else:  # no forward seen (a closure optimizer, a model called through something else)
            rows = lean_rows(before, self._worker.warned)
        msg.lean.extend(rows)
        if self._grads_now:
            msg.lean.extend(lean_rows(grads, self._worker.warned))
            grads = []
        if not grads:
            return False
        self._pending = (msg, self._worker.submit(grads), grads)
        return True

    def finish(self) -> Any:
        """The update is over: the held message, complete (None if there is none)."""
        if self._pending is None:
            return None
        msg, job, grads = self._pending
        self._pending = None
        rows, changed = job.rows_for(grads, self._worker.warned, recompute=False)
        msg.lean.extend(rows)
        if changed and not self._grads_now:
            self._grads_now = True
            log.warning("stepdump: %d grad(s) changed in place during optimizer.step() at step %s before stepdump "
                        "read them; their stats are left out of that step, and from now on grads are read "
                        "before the update (slower)", changed, msg.step)
        return msg

    def drop(self) -> None:
        """Forget what is in flight (the Recorder stepped aside)."""
        self._before, self._pending = None, None

    def close(self) -> None:
        self.drop()
        self._worker.close()
