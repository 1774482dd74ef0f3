"""Setting up a run directory for a Recorder: checks, catalog creation, resuming."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import stepdump
from stepdump.capture.structure import resumed_layouts
from stepdump.core import stats_file
from stepdump.core.host import kernels_meta
from stepdump.errors import ConfigError, RunExistsError, RunLockedError
from stepdump.store import catalog
from stepdump.store.format import CATALOG_FILE, LOCK_FILE
from stepdump.store.lock import is_locked
from stepdump.store.queries import CatalogReader

if TYPE_CHECKING:
    from stepdump.capture.options import RecorderOptions
    from stepdump.core.layout import Layout

log = logging.getLogger(__name__)


def prepare_dir(p: Path, resume: bool) -> Path:
    """Check that ``p`` may be recorded into (new, empty, or a run with resume) and create it."""
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{p} exists and is a file; give a directory for the run")
    if (p / CATALOG_FILE).exists():
        if not resume and is_locked(p):  # resume=True would not help: say what would
            raise RunLockedError(
                f"{p} is being written by another Recorder right now. Record into a different "
                "directory, or close that Recorder and pass resume=True to append to the run."
            )
        if not resume:
            raise RunExistsError(
                f"{p} already holds a stepdump run. Record into a new directory, "
                "or pass resume=True to append steps to it."
            )
    elif p.exists() and any(not _creation_leftover(x.name) for x in p.iterdir()):
        raise RunExistsError(f"{p} exists and is not empty (and not a run); give a new or empty directory")
    p.mkdir(parents=True, exist_ok=True)
    return p


def discard_created(p: Path, there: set[str]) -> None:
    """Remove what a Recorder that failed while being built created in ``p`` (every entry not in
    ``there``, the directory's listing once it was locked), so that the directory takes a Recorder
    again; the LOCK stays (it is released, not removed: another process may be waiting on it)."""
    for name in sorted(set(os.listdir(p)) - there - {LOCK_FILE}):
        entry = p / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _creation_leftover(name: str) -> bool:
    """What a Recorder killed before its catalog existed leaves: the LOCK file, a partial catalog."""
    return name == LOCK_FILE or name.startswith(CATALOG_FILE + catalog.PARTIAL_SUFFIX)


def init_catalog(path: Path, meta: dict[str, Any], resume: bool, start_step: int | None) -> tuple[int, bool]:
    """Create the catalog (or check it for resuming); return the number of the first step, and
    whether resuming dropped recorded steps (from that step on) to record them again.

    Resuming goes on at the step after the run's last *update*: its final record *N*
    (``meta.final_step``, written by a clean ``close()``) is replaced by record *N* with its
    grads; after a crash (no final record) at the step after the last one committed. A
    ``start_step`` at or before the last recorded step drops the steps from there on
    (catalog rows only: their segment bytes stay, unreferenced), so the run stays one
    history; each resume is noted in ``meta.history``.
    """
    meta = {
        "stepdump_version": stepdump.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "created": time.time(),
        # Identifies this run among runs recorded at the same path (a URL reader's cache keys on it).
        "run_id": uuid.uuid4().hex,
        "num_threads": torch.get_num_threads(),
        # The kernels the numbers were computed with: a rebuild on another host names a difference.
        **kernels_meta(),
        **meta,
    }
    if not (path / CATALOG_FILE).exists():
        catalog.create(path, meta)
        return (0 if start_step is None else start_step), False
    catalog.check_writable_layout(path)  # links / FIFOs planted in a shared run dir: refused before writing
    reader = CatalogReader(path)
    try:
        old = reader.meta()
        last = reader.last_step()
    finally:
        reader.close()
    final = old.get("final_step")
    nxt = 0 if last is None else last if (isinstance(final, int) and final == last) else last + 1
    first = nxt if start_step is None else start_step
    # The model's structure may have changed mid-run (structure.py): the live one is compared with
    # the layout of the step resumed at (or the one before it), and the history cut there.
    earlier = resumed_layouts(old, meta["layout"], first)
    if earlier is None:
        raise ConfigError(
            f"cannot resume {path} at step {first}: the optimizer's parameters differ from the recorded run's "
            "there; resume with the model and optimizer as they were at that step, or record into a new directory"
        )
    dropped = last is not None and first <= last
    history = old.get("history")
    history = history if isinstance(history, list) else []
    entry = {"resumed_at": first, "dropped": [first, last] if dropped else None, "time": meta["created"]}
    layouts = {"layout": meta["layout"], "layouts": earlier} if earlier or old.get("layouts") else None
    # The run's stats.parquet describes it as it was: gone before anything changes (close() writes
    # it again), so no query in place reads a copy the resumed run has outgrown.
    stats_file.remove(path)
    catalog.resume(path, first if dropped else None, [*history, entry], {**(layouts or {}), stats_file.META_KEY: None})
    if dropped:
        log.info("stepdump: resuming %s at step %d; its steps %d..%d are dropped (recorded again from here)",
                 path, first, first, last)
    return first, dropped


def run_meta(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
             options: RecorderOptions, layout: Layout, extra: dict[str, Any]) -> dict[str, Any]:
    """What a new run's catalog says about how it was recorded (FORMAT.md, ``meta``); ``extra``:
    the target's (``distributed``, ``url``)."""
    from stepdump.capture.extra import extra_meta
    from stepdump.core.classes import classes_meta
    from stepdump.capture.options import GradientLogSchedule, KeyframeSchedule, schedule_meta

    for key in layout.not_recorded:
        log.warning("stepdump: model.state_dict() entry %r is not a tensor; stepdump records tensors only, "
                    "and restore leaves it as it is in the model restored into", key)
    return {
        "model_class": type(model).__name__,
        "optimizer_class": type(optimizer).__name__,
        "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
        # The classes by module and qualified name (the bare names above are for display): torch's
        # Adafactor is not transformers' (core/classes.py).
        "classes": classes_meta(model, optimizer, scheduler),
        "scaler": scaler is not None,
        "capture": list(options.record.capture),
        **schedule_meta(options.schedule),
        # The recorder stores params changed outside the optimizer (capture/outside.py): a reader
        # of a log without this key knows such a change may be what a rebuild cannot reproduce.
        # Re-execution tells an update's output from the loop's edit where the recorder watched (each
        # changed param named at the step it changed, with what the update left in it): a gradient log
        # and a keyframe run at every step, the other modes at the steps stored in full (outside.py).
        **({"outside_edits": "stored" if isinstance(options.schedule, GradientLogSchedule) else
            "watched" if isinstance(options.schedule, KeyframeSchedule) else "full steps"}
           if "params" in options.record.capture else {}),
        # The RNG state at each training forward is in the state of every step that holds an RNG state.
        "forward_rng": "recorded",
        "codec": options.store.codec,
        "device": str(next(iter(layout.params.values())).device) if layout.params else "cpu",
        "layout": layout.to_meta(),
        **extra_meta(options.record.extra_state),  # the objects of Recorder(extra_state=), capture/extra.py
        # Frozen params recorded by fingerprint only: restore checks the base it is given against them.
        **({"frozen": "fingerprint"} if options.record.frozen == "fingerprint" else {}),
        "user": dict(options.metadata or {}),
        **extra,
    }


def check_objects(model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    """Check the training objects given to the Recorder (its options check themselves)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise ConfigError("scheduler must have state_dict()/load_state_dict() (a torch LR scheduler)")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("step", "update", "state_dict")):
        raise ConfigError("scaler must be a torch.amp.GradScaler")
