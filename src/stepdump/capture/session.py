"""Setting up a run directory for a Recorder: checks, catalog creation, resuming."""

from __future__ import annotations

import logging
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stepdump
from stepdump.capture.guard import ON_ERROR
from stepdump.errors import ConfigError, RunExistsError, RunLockedError
from stepdump.store import catalog
from stepdump.store.codecs import get_codec
from stepdump.store.delta import MAX_DELTA_CHAIN
from stepdump.store.format import CATALOG_FILE, LOCK_FILE
from stepdump.store.lock import is_locked

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


def _creation_leftover(name: str) -> bool:
    """What a Recorder killed before its catalog existed leaves: the LOCK file, a partial catalog."""
    return name == LOCK_FILE or name.startswith(CATALOG_FILE + catalog.PARTIAL_SUFFIX)


def init_catalog(path: Path, meta: dict[str, Any], resume: bool, start_step: int | None) -> int:
    """Create the catalog (or check it for resuming); return the number of the first step."""
    meta = {
        "stepdump_version": stepdump.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "created": time.time(),
        # Identifies this run among runs recorded at the same path (a URL reader's cache keys on it).
        "run_id": uuid.uuid4().hex,
        "num_threads": torch.get_num_threads(),
        **meta,
    }
    if not (path / CATALOG_FILE).exists():
        catalog.create(path, meta)
        return 0 if start_step is None else start_step
    catalog.check_writable_layout(path)  # links / FIFOs planted in a shared run dir: refused before writing
    con = catalog.connect_reader(path)
    try:
        old = catalog.read_meta(con)
        last = con.execute("SELECT max(step) FROM steps").fetchone()[0]
    finally:
        con.close()
    layout = old.get("layout")
    if not isinstance(layout, dict) or layout.get("groups") != meta["layout"]["groups"]:
        raise ConfigError(
            f"cannot resume {path}: the optimizer's parameters differ from the recorded run's; "
            "record into a new directory"
        )
    nxt = 0 if last is None else last + 1
    if start_step is not None and start_step < nxt:
        raise ConfigError(f"start_step={start_step} but the run already has steps up to {last}")
    return nxt if start_step is None else start_step

def run_meta(rec: Any, *, keyframe_every: int | None, codec: str, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """What a new run's catalog says about how it was recorded (FORMAT.md, ``meta``)."""
    for key in rec._layout.not_recorded:
        log.warning("stepdump: model.state_dict() entry %r is not a tensor; stepdump records tensors only, "
                    "and restore leaves it as it is in the model restored into", key)
    return {
        "model_class": type(rec.model).__name__,
        "optimizer_class": type(rec.optimizer).__name__,
        "scheduler_class": type(rec.scheduler).__name__ if rec.scheduler is not None else None,
        "scaler": rec.scaler is not None,
        "capture": list(rec.kinds),
        "every": rec._full.description,
        "keyframe_every": keyframe_every,
        "stats_every": rec._stats.description,
        "codec": codec,
        "layout": rec._layout.to_meta(),
        "user": metadata or {},
        **rec._target.meta(rec._layout.params),
    }


def check_arguments(model: Any, optimizer: Any, scheduler: Any, scaler: Any, *, durability: str, on_error: str,
                    queue_depth: int, codec: str, every: Any, stats_every: Any, keyframe_every: int | None,
                    ring: int | None, delta_chain: int = 8, ring_options: tuple[Any, Any] = (None, None)) -> Any:
    """Validate the Recorder's arguments; return the effective ``every`` (keyframe and ring modes set it)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise ConfigError("scheduler must have state_dict()/load_state_dict() (a torch LR scheduler)")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("step", "update", "state_dict")):
        raise ConfigError("scaler must be a torch.amp.GradScaler")
    if durability not in ("flush", "fsync"):
        raise ConfigError(f"durability={durability!r}: choose 'flush' or 'fsync'")
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error={on_error!r}: choose 'raise' or 'warn'")
    if queue_depth < 1:
        raise ConfigError("queue_depth must be at least 1")
    get_codec(codec)  # fail now, not in the writer
    if isinstance(delta_chain, bool) or not isinstance(delta_chain, int) or not 1 <= delta_chain <= MAX_DELTA_CHAIN:
        raise ConfigError(f"delta_chain={delta_chain!r}: give a number of blobs from 1 (no deltas) to "
                          f"{MAX_DELTA_CHAIN} (readers follow no longer chains)")
    if keyframe_every is not None:
        if isinstance(keyframe_every, bool) or not isinstance(keyframe_every, int) or keyframe_every < 1:
            raise ConfigError(f"keyframe_every={keyframe_every!r}: give a positive number of steps")
        if every != 1 or stats_every != 1:
            raise ConfigError("keyframe_every sets every= and stats_every= itself; pass only keyframe_every")
        every = keyframe_every
    if ring is None and any(v is not None for v in ring_options):
        raise ConfigError("trigger= and after= apply to the flight-recorder ring only; pass ring=N (steps kept in "
                          "memory) with them, or leave them out")
    if ring is not None:
        from stepdump.capture.triggers import resolve

        resolve(ring_options[0])  # a misspelt trigger name fails here, before anything is created
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise ConfigError(f"ring={ring!r}: give the number of steps to keep in memory")
        if every != 1 or keyframe_every is not None:
            raise ConfigError("ring= decides which steps are stored in full; do not combine it with every= "
                              "or keyframe_every=")
        every = None
    return every
