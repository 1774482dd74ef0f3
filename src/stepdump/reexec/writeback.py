"""Write a re-execution back into its run: ``reexecute(..., write_back=True)``, ``stepdump reexecute --write-back``.

What is written, in one catalog transaction after the bytes are on disk (FORMAT.md,
"Re-executions written back"):

* the activations and activation grads captured, as tensors of kinds ``reexec_activations`` and
  ``reexec_activation_grads`` at the step (stored in full, raw, in a segment of their own): kinds
  of their own, so no reader takes them for what the recording captured;
* the verdict and its evidence (and the first NaN/Inf op of ``find_nan``) under
  ``meta.reexecutions[str(step)]``, which ``check`` (rule ``reexecution``) and the report read;
* the run's ``stats.parquet`` (core/stats_file.py) again, with the rows written back.

Writing again for the same step replaces what the earlier write-back left for it (its tensors and
its verdict), so a step holds one re-execution: the latest. The replaced rows go from the catalog;
their bytes stay in their segment, unreferenced (the store is append-only, as after a resume).

It takes the run's writer lock as a Recorder does: a run being recorded is refused
(:class:`stepdump.errors.RunLockedError`), and a Recorder cannot start while a write-back holds it.
A bundle (a read-only snapshot of one step), a remote run and a multi-rank run are refused too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import stepdump
from stepdump.core import stats_file
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import fingerprint_bytes, raw_bytes
from stepdump.core.optrace import OpRecord
from stepdump.core.stats import compute_stats
from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store import bounded_json
from stepdump.store.catalog import CatalogWriter
from stepdump.store.format import META_REEXECUTIONS, REEXEC_KINDS, SEGMENT_DIR, format_shape
from stepdump.store.lock import RunLock
from stepdump.store.storage import LocalStorage

# captured kind -> the kind it is written back as
WRITTEN_AS = {"activations": REEXEC_KINDS[0], "activation_grads": REEXEC_KINDS[1]}
_MAX_DIFFERING = 100  # quantities listed in the written verdict (the count is always there)


def check_writable(run: Any) -> Path:
    """The local directory a write-back goes into, or the reason it cannot (before any work)."""
    from stepdump.read.remote import RemoteRun

    if isinstance(run, RemoteRun) or not isinstance(run.path, Path):
        raise ConfigError(f"cannot write a re-execution back into {getattr(run, 'url', run.path)}: write-back "
                          "needs a local run "
                          "directory (download the run, or re-execute without write_back)")
    stores = list(run.stores())
    if len(stores) != 1 or stores[0][0] is not None:
        raise ConfigError(f"{run.path} holds one store per rank: write back into one rank's store, "
                          "stepdump.open('<run>/rank-N')")
    made = run.meta.get("bundle")
    if made is not None:  # whatever the value (a damaged one too): a bundle is never written to
        what = (f"a read-only snapshot of step {made.get('step')} of {made.get('source')}" if isinstance(made, dict)
                else "a read-only snapshot of one step; its meta.bundle is damaged")
        raise ConfigError(f"{run.path} is a bundle ({what}): write-back is refused, so that a bundle "
                          "stays the record it was made from; write back into the source run instead")
    # Checked now, before any re-execution runs (write_back takes the lock again to write).
    probe = RunLock(run.path)
    probe.acquire()  # RunLockedError naming the Recorder that holds it
    probe.release()
    return run.path


def op_record(op: OpRecord | None) -> dict[str, Any] | None:
    """An op of the tracer as JSON (what the verdict stores of ``op`` and ``nan_op``)."""
    if op is None:
        return None
    return {"op": op.op, "module": op.module, "phase": op.phase, "source": op.source, "where": op.where(),
            "index": op.index, "input_stats": op.input_stats}


def verdict_record(result: Any, captured: dict[str, list[str]]) -> dict[str, Any]:
    """The verdict and its evidence as the JSON stored under ``meta.reexecutions[str(step)]``."""
    return {
        "verdict": result.verdict, "cause": result.cause, "summary": result.summary(),
        "first": list(result.first) if result.first else None,
        "differing": [list(k) for k in result.differing[:_MAX_DIFFERING]], "n_differing": len(result.differing),
        "op": op_record(result.op), "op_reason": result.op_reason, "nan_op": op_record(result.nan_op),
        "environment": list(result.environment), "repeats": result.repeats, "compared": result.compared,
        "how": result.how, "notes": list(result.notes), "captured": captured,
        "time": time.time(), "stepdump_version": stepdump.__version__,
    }


def write_back(run: Any, result: Any, captured: dict[str, dict[str, torch.Tensor]]) -> None:
    """Store ``captured`` (kind -> name -> tensor) and ``result``'s verdict at ``result.step`` of
    ``run``, replacing what an earlier write-back left for that step. Atomic: all or nothing."""
    path = check_writable(run)
    step = int(result.step)
    lock = RunLock(path)
    lock.acquire()
    try:
        tensors = [(WRITTEN_AS[kind], name, t.detach().cpu().contiguous())
                   for kind in ("activations", "activation_grads") for name, t in captured.get(kind, {}).items()]
        names = {kind: list(captured.get(kind, {})) for kind in ("activations", "activation_grads")}
        had_stats = stats_file.remove(path)  # it would miss these rows: written again once they are committed
        cat = CatalogWriter(path, synchronous="FULL")
        try:
            cat.set_meta(stats_file.META_KEY, None)
            cat.drop_tensors(step, REEXEC_KINDS)
            key = _write_segment(path, [raw_bytes(t) for _, _, t in tensors]) if tensors else None
            offset, blobs, rows = 0, [], []
            for kind, name, t in tensors:
                data = raw_bytes(t)
                fp = fingerprint_bytes(data)
                bid = cat.new_blob_id()
                blobs.append((bid, cat.segment_id(key), offset, len(data), "raw", len(data), fp, None))  # type: ignore[arg-type]
                rows.append((cat.series_id(kind, name), step, stored_dtype(t), format_shape(t.shape), bid,
                             *compute_stats(t), fp))
                offset += len(data)
            cat.add_blobs(blobs)
            cat.add_tensors(rows)
            cat.drop_empty_series(REEXEC_KINDS)  # those the earlier write-back named and this one does not
            marks = _read_marks(cat)
            marks[str(step)] = verdict_record(result, names)
            cat.set_meta(META_REEXECUTIONS, dict(sorted(marks.items(), key=lambda kv: int(kv[0]))))
        except BaseException:
            cat.abort()
            raise
        cat.close()  # commits
        if had_stats:  # best effort, as at close(): the catalog holds the rows either way
            stats_file.compact(path)
    finally:
        lock.release()


def _read_marks(cat: CatalogWriter) -> dict[str, Any]:
    text = cat.meta_text(META_REEXECUTIONS)
    if text is None:
        return {}
    try:
        marks = bounded_json.loads(text, f"meta.{META_REEXECUTIONS}")
    except (TypeError, ValueError, CorruptDataError):
        marks = None
    if not isinstance(marks, dict):
        raise CorruptDataError(f"meta.{META_REEXECUTIONS} of the run is not a JSON object: the catalog is damaged "
                               "(`stepdump verify`); nothing was written back")
    return marks


def _write_segment(path: Path, parts: list[memoryview]) -> str:
    """A new segment with ``parts`` back to back, synced before the catalog names it."""
    storage = LocalStorage(path)
    try:
        seq = 0
        while True:  # the next missing or empty segment, as the capture writer picks its own
            seq += 1
            key = f"{SEGMENT_DIR}/{seq:06d}.seg"
            if storage.size(key) == 0:
                break
        for data in parts:
            storage.append(key, data)
        storage.sync(key, durable=True)
        storage.close_writer(key)
        return key
    finally:
        storage.close()
