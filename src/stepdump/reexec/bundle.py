"""One step as a store of its own: ``stepdump bundle RUN --step k -o step-k.stepdump``.

A bundle is an ordinary store (FORMAT.md) written by the capture writer, so ``stepdump.open``,
``verify``, ``reexecute`` and every CLI command read it like a run. It holds:

* step k in full (level 2): the params, buffers, optimizer state, extra state, the RNG at the start
  of iteration k and its batch, stored; the grads of k (and activations) as the record's stats and
  fingerprints only, which is what a re-execution compares with, so a bundle is about one step of
  state plus the batch;
* step k+1 as stats and fingerprints (level 1): the params and optimizer state the update left;
* the scalars logged at k, and the source's meta (torch, CPU capability, BLAS, threads, device: the
  environment a verdict compares with), plus ``meta.bundle`` naming the source and step.

The state of k comes from wherever the run holds it: stored in full, rebuilt from a gradient log, or
(a keyframe run between keyframes) replayed with the user's objects. Every tensor written is checked
against the fingerprint the run recorded for it, so a bundle holds the record, not an approximation.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stepdump.capture.lean import LeanRow
from stepdump.capture.step_state import full_state, tensor_entries
from stepdump.capture.session import prepare_dir
from stepdump.capture.staging import Item, StagingPool
from stepdump.capture.writer import StepMessage, Writer
from stepdump.core import tjson
from stepdump.core.hashing import XXH3, fingerprint_as
from stepdump.core.layout import build_layout
from stepdump.errors import ConfigError, CorruptDataError, StepNotFoundError, nearest_steps
from stepdump.read.opener import open as open_run
from stepdump.read.rows import fp_kind_map
from stepdump.reexec.engine import TrainStep, prepare
from stepdump.store import catalog
from stepdump.store.codecs import get_codec
from stepdump.store.format import LEVEL_FULL, LEVEL_STATS
from stepdump.store.lock import RunLock
from stepdump.store.queries import StepRow
from stepdump.store.storage import LocalStorage

log = logging.getLogger(__name__)

# What a re-execution starts from: stored in the bundle. Everything else at step k (grads,
# activations) is what it is compared with: the record's stats and fingerprints only.
STORED_KINDS = ("params", "buffers", "optimizer", "extra", "state", "inputs")
# Meta keys of the source that say how *it* was recorded or written, not what a bundle is.
_DROPPED_META = ("format_version", "run_id", "final_step", "history", "recording_stopped", "distributed", "url",
                 "outside_edits")


@dataclass
class BundleResult:
    """A bundle written: where, which step, how its state was reached, and its size.

    Attributes:
        path: The bundle's directory (a store). step: The step it holds.
        how: How the state of ``step`` was reached in the source run.
        bytes: The whole directory on disk (catalog + segments).
        tensor_bytes: Bytes of tensor data in its segments.
        state_bytes: Raw bytes of the params and optimizer state it stores (the model's training state).
        batch_bytes: Raw bytes of the batch it stores.
        notes: What the bundle could not hold (a tensor of step k the source had only as a fingerprint).
    """

    path: Path
    step: int
    how: str
    bytes: int = 0
    tensor_bytes: int = 0
    state_bytes: int = 0
    batch_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{self.path}: step {self.step} ({self.how}), {self.bytes} bytes on disk, of which "
                 f"{self.tensor_bytes} tensor data (params + optimizer state {self.state_bytes}, batch "
                 f"{self.batch_bytes})"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def bundle(run: Any, step: int, path: str | Path, *, model: torch.nn.Module | None = None,
           optimizer: torch.optim.Optimizer | None = None, train_step: TrainStep | None = None,
           scheduler: Any = None, scaler: Any = None) -> BundleResult:
    """Write step ``step`` of ``run`` as a small self-contained store at ``path`` (new or empty).

    ``model``, ``optimizer``, ``train_step`` (and ``scheduler``, ``scaler``), built as the recorded
    loop built them, are needed only where the run holds step ``step`` neither in full nor in a
    gradient log (a keyframe run between keyframes: the step is replayed, each replayed step
    verified). Raises StepNotFoundError when the run cannot give the step's state or batch.
    """
    from stepdump.reexec.verdict import refuse_joint

    refuse_joint(run, "bundled")
    stores = list(run.stores())
    if len(stores) != 1 or stores[0][0] is not None:
        raise ConfigError(f"{run.path} holds one store per rank: bundle one rank's store, "
                          "stepdump.open('<run>/rank-N')")
    if step not in run.stats_steps:
        raise StepNotFoundError(f"step {step} is not a recorded step of {run.path} "
                                f"({nearest_steps(step, run.stats_steps)})")
    live, how = _state_source(run, step, model, optimizer, train_step, scheduler, scaler)
    out = BundleResult(Path(path), step, how)
    fp_kinds = fp_kind_map(run.catalog)  # the bundle keeps each series' fingerprint kind
    items, lean, state_json = _step_k(run, step, live, out, fp_kinds)
    nxt = [_lean_row(r, fp_kinds) for r in run.catalog.step_rows(step + 1) if r.kind != "state"] \
        if step + 1 in run.stats_steps else []
    if not nxt:
        out.notes.append(f"step {step + 1} has no record: a re-execution cannot compare the update's result")
    meta = {k: v for k, v in run.meta.items() if k not in _DROPPED_META}
    meta.update(every=f"step {step} only (a bundle)", keyframe_every=None, gradient_log=None,
                bundle={"source": str(run.path), "source_run_id": run.meta.get("run_id"), "step": step, "how": how})
    codec = str(meta["codec"]) if isinstance(meta.get("codec"), str) else "raw"
    try:
        get_codec(codec)
    except ConfigError:
        codec = meta["codec"] = "raw"
    messages = [StepMessage(step, LEVEL_FULL, step in run.skipped_steps, items, state_json,
                            scalars=[(s, n, float("nan") if v is None else v) for s, n, v in run.scalar_rows(step)],
                            lean=lean)]
    if nxt:
        messages.append(StepMessage(step + 1, LEVEL_STATS, step + 1 in run.skipped_steps, lean=nxt))
    _write(out.path, meta, codec, messages)
    with open_run(out.path) as b:
        out.tensor_bytes = b.blob_bytes()[0]
    out.bytes = sum(p.stat().st_size for p in out.path.rglob("*") if p.is_file())
    log.info("stepdump: %s", out.summary())
    return out


def _state_source(run: Any, step: int, model: Any, optimizer: Any, train_step: Any, scheduler: Any,
                  scaler: Any) -> tuple[dict[tuple[str, str], torch.Tensor] | None, str]:
    """Where the state of ``step`` comes from: the run itself (None), or the live objects after
    a replay (their tensors by (kind, name), and the objects' state as the ``state`` JSON needs it)."""
    has_batch = run.catalog.has_state(step) and run.step_state(step).get("batch") is not None
    if step in run.steps:
        how = "rebuilt from the gradient log and verified" if run.gradient_log is not None and \
            run.gradient_log.rebuilds(step, None) else "stored in full"
        if not has_batch:
            raise StepNotFoundError(f"step {step} of {run.path} cannot be bundled: it holds no batch (the loop did "
                                    "not call rec.log_batch), so it could not be re-executed")
        return None, how
    earlier = [s for s in run.steps if s < step]
    if not earlier or not has_batch:
        raise StepNotFoundError(
            f"step {step} of {run.path} cannot be bundled: its state is not stored, not in a gradient log, and no "
            "keyframe before it has the batches to replay from; record with keyframe_every=K or gradient_log=K and "
            "rec.log_batch(batch), or bundle a step stored in full "
            f"({nearest_steps(step, run.steps)})")
    if model is None or optimizer is None or train_step is None:
        raise ConfigError(
            f"step {step} of {run.path} is rebuilt by replaying iterations from keyframe {earlier[-1]}, which runs "
            "your code: pass model=, optimizer=, train_step= (CLI: --entry pkg.module:factory), built as the "
            "recorded loop built them")
    prep = prepare(run, step, model, optimizer, train_step, scheduler, scaler)
    layout = build_layout(model, optimizer)
    # (kind, name) -> (tensor, param, key), named as the Recorder names them at a full step; a
    # keyframe run's step between keyframes has rows for some of them only (no optimizer state).
    live: dict[Any, Any] = {(e.kind, e.name): (e.tensor, e.param, e.key) for e in tensor_entries(
        layout, optimizer, ("params", "optimizer"), lambda n: True, True, dict(layout.buffers))}
    live[("$state", "")] = full_state(layout, optimizer, scheduler, scaler)
    return live, prep.how


def _lean_row(r: StepRow, fp_kinds: dict[tuple[str, str], str]) -> LeanRow:
    fk = fp_kinds.get((r.kind, r.name))  # None: xxh3 (LeanRow's convention)
    return LeanRow(r.kind, r.name, r.param, r.key, r.dtype, r.shape, r.stats, r.fingerprint, fp_kind=fk)


def _step_k(run: Any, step: int, live: dict[Any, Any] | None, out: BundleResult,
            fp_kinds: dict[tuple[str, str], str]) -> tuple[list[Item], list[LeanRow], str]:
    """Step k's stored tensors (as writer items, each checked against its recorded fingerprint
    under its series' kind, ``fp_kinds``), its fingerprint-only rows and its state JSON."""
    rows = run.catalog.step_rows(step)
    tree = tjson.loads(run.catalog.step_state(step), f"the recorded state of step {step} in {run.path}")
    live = dict(live) if live is not None else None
    state = live.pop(("$state", "")) if live is not None else None
    items: list[Item] = []
    lean: list[LeanRow] = []
    rebuilt: dict[str, dict[str, torch.Tensor]] = {}
    for r in rows:
        kind, name, param, key, fp, stored = r.kind, r.name, r.param, r.key, r.fingerprint, bool(r.stored)
        t: torch.Tensor | None = None
        if kind in STORED_KINDS:
            if stored:
                t = run.tensor(name, step, kind)
            elif live is not None and (kind, name) in live:
                t = live[(kind, name)][0]
            elif run.gradient_log is not None and run.gradient_log.rebuilds(step, kind):
                if kind not in rebuilt:
                    rebuilt[kind] = run.tensors(step, kind)
                t = rebuilt[kind].get(name)
            if t is None:
                out.notes.append(f"{kind} {name!r} of step {step} is in the source as its fingerprint only")
        if t is None:
            lean.append(_lean_row(r, fp_kinds))
            continue
        t = t.detach().cpu().contiguous()
        fk = fp_kinds.get((kind, name), XXH3)
        if fingerprint_as(fk, t) != fp:
            raise CorruptDataError(f"the {kind} tensor {name!r} of step {step} ({out.how}) does not match the "
                                   f"fingerprint ({fk}) {run.path} recorded for it: nothing was bundled")
        # A dmix64 series stays dmix64 in the bundle (the writer computes it again from these bytes).
        items.append(Item(kind, name, t, True, param, key, fp_kind=None if fk == XXH3 else fk))
        nbytes = t.numel() * t.element_size()
        if kind in ("params", "optimizer"):
            out.state_bytes += nbytes
        elif kind == "inputs":
            out.batch_bytes += nbytes
    if live is not None:
        seen = {(r.kind, r.name) for r in rows}
        for (kind, name), (t, param, key) in live.items():
            if (kind, name) not in seen:  # no recorded fingerprint: from the verified replay
                items.append(Item(kind, name, t.detach().cpu().contiguous(), True, param, key,
                                  fp_kind=fp_kinds.get((kind, name))))
                out.state_bytes += t.numel() * t.element_size() if kind in ("params", "optimizer") else 0
    if state is not None and isinstance(tree, dict) and "groups" not in tree:
        # A keyframe run's step between keyframes holds only its RNG and batch: the param groups,
        # optimizer extras, scheduler and scaler come from the objects replay put in that step.

        def put(ref: str, t: torch.Tensor) -> None:
            items.append(Item("state", ref, t.detach().cpu().contiguous(), True, fp_kind=fp_kinds.get(("state", ref))))

        tree.update(tjson.encode(state, put))
    return items, lean, tjson.dumps(tree)


def _write(path: Path, meta: dict[str, Any], codec: str, messages: list[StepMessage]) -> None:
    """Create the store and write ``messages`` through the capture writer (one transaction each)."""
    fresh = not path.exists()
    prepare_dir(path, resume=False)
    lock = RunLock(path)
    lock.acquire()
    ok = False
    try:
        catalog.create(path, meta)
        writer = Writer(path, StagingPool(1, None), codec, "fsync", 1 << 40, max_queue=len(messages) + 1,
                        storage=LocalStorage(path))
        writer.start()
        writer.wait_ready()
        for m in messages:
            writer.queue.put(m)
        writer.queue.put(None)
        writer.join()
        if writer.error is not None:
            raise writer.error
        ok = True
    finally:
        lock.release()
        if not ok and fresh:
            shutil.rmtree(path, ignore_errors=True)  # ours, half-written: gone rather than a broken store
