"""Export a recorded step as a checkpoint a training framework resumes from natively.

* ``hf-trainer``: a folder that ``transformers.Trainer.train(resume_from_checkpoint=folder)``
  reads, laid out as the Trainer's own ``checkpoint-N``: ``model.safetensors``,
  ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (fp16 only), ``rng_state.pth`` and
  ``trainer_state.json``.
* ``lightning``: a ``.ckpt`` file that ``lightning.Trainer.fit(model, ckpt_path=...)`` reads:
  ``state_dict``, ``optimizer_states``, ``lr_schedulers``, the precision plugin's scaler,
  ``epoch``, ``global_step`` and the fit loop's progress counters.

Record *t* holds the state after *t* optimizer steps (params and optimizer state before
update *t*), which is what a framework saves when ``global_step == t``. The loop counters
a framework needs beyond the tensors (batch size, batches per epoch, gradient
accumulation) are not part of a plain record: the stepdump callbacks store them in the
run's metadata (``meta["user"]["stepdump.trainer"]``), and ``trainer=`` gives or overrides
them. Neither framework is imported here: the files are written with torch, safetensors
and json only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.rng import numpy_set_state_arg
from stepdump.errors import ConfigError
from stepdump.read.export_files import save_atomically

if TYPE_CHECKING:
    from stepdump.read.run import Run

log = logging.getLogger(__name__)

#: Key in the run's user metadata under which the framework callbacks store the training setup.
TRAINER_META_KEY = "stepdump.trainer"

HF_KEYS = ("train_batch_size", "logging_steps", "eval_steps", "save_steps", "max_steps", "num_train_epochs",
           "steps_per_epoch", "epoch")
LIGHTNING_KEYS = ("num_training_batches", "accumulate_grad_batches", "scheduler_interval")


def trainer_setup(run: Run, framework: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The training setup of ``run`` for ``framework``: what its callback recorded, updated by ``given``."""
    allowed = HF_KEYS if framework == "hf-trainer" else LIGHTNING_KEYS
    given = dict(given or {})
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"trainer= has {unknown} that a {framework} checkpoint does not use; "
                          f"it takes {', '.join(allowed)}")
    user = run.meta.get("user")
    recorded = user.get(TRAINER_META_KEY) if isinstance(user, dict) else None
    setup: dict[str, Any] = {}
    if isinstance(recorded, dict) and recorded.get("framework") == framework:
        setup.update({k: v for k, v in recorded.items() if k in allowed})
    setup.update(given)
    return setup


# -- Hugging Face Trainer ----------------------------------------------------------------
def export_hf_trainer(run: Run, step: int, out: Path, trainer: Mapping[str, Any] | None = None) -> Path:
    """Write ``step`` as a Hugging Face ``Trainer`` checkpoint folder at ``out``."""
    from safetensors.torch import save_file

    setup = trainer_setup(run, "hf-trainer", trainer)
    if setup.get("train_batch_size") is None:
        raise ConfigError(
            f"{run.path} does not say the Trainer's train_batch_size (trainer_state.json needs it; the "
            "StepdumpTrainerCallback records it): pass trainer={'train_batch_size': per_device_train_batch_size "
            "* number of GPUs} (CLI: --trainer train_batch_size=N)"
        )
    # Read everything first: a step that cannot be read leaves nothing behind.
    weights = _unaliased(run.state_dict(step))
    optimizer = run.optimizer_state_dict(step)
    state = run.step_state(step)
    if state.get("scheduler") is None:
        log.warning("stepdump: %s recorded no LR scheduler; the Trainer loads optimizer.pt only when scheduler.pt "
                    "is there too, so its optimizer state will start fresh", run.path)
    rng = state.get("rng")
    if rng is None:
        log.warning("stepdump: step %d of %s has no RNG state; the resumed Trainer draws other dropout masks",
                    step, run.path)
    trainer_state = _hf_trainer_state(run, step, setup)

    tmp = _fresh_dir(out)
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(optimizer, tmp / "optimizer.pt")
        if state.get("scheduler") is not None:
            torch.save(state["scheduler"], tmp / "scheduler.pt")
        if state.get("scaler") is not None:
            torch.save(state["scaler"], tmp / "scaler.pt")
        if rng is not None:
            torch.save(_hf_rng(rng), tmp / "rng_state.pth")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _unaliased(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without the second name of a shared tensor (tied embeddings), as the
    Trainer saves it: safetensors refuses shared storage, and loading the first name fills both."""
    seen: set[tuple[Any, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.contiguous()
    return out


def _hf_rng(rng: Mapping[str, Any]) -> dict[str, Any]:
    """stepdump's RNG record in the layout of the Trainer's ``rng_state.pth``."""
    n, p = rng["numpy"], rng["python"]
    out: dict[str, Any] = {
        "python": (int(p["version"]), tuple(int(v) for v in p["state"].tolist()), p["gauss"]),
        # What np.random.set_state takes: MT19937's legacy tuple, another bit generator's dict form.
        "numpy": numpy_set_state_arg(n),
        "cpu": rng["torch"].to(torch.uint8),
    }
    cuda = rng.get("cuda")
    if cuda:
        # A single-process Trainer saves and loads one device's state; a distributed one, every device's.
        out["cuda"] = cuda[0].to(torch.uint8) if len(cuda) == 1 else [c.to(torch.uint8) for c in cuda]
    return out


def _hf_trainer_state(run: Run, step: int, setup: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer_state.json`` as the Trainer writes it after ``step`` optimizer steps."""
    history: dict[int, dict[str, float]] = {}
    if step > 0:
        for s, name, value in run.scalar_rows(range(step)):
            if name == "lr" or name.startswith("sys/"):
                continue  # added by the Recorder, not logged by the Trainer
            history.setdefault(s, {})[name] = math.nan if value is None else value
    epoch = setup.get("epoch")
    if epoch is None:
        # The epoch the Trainer logged with update step-1 is its state.epoch at the checkpoint.
        epoch = history.get(step - 1, {}).get("epoch")
    if epoch is None and setup.get("steps_per_epoch"):
        epoch = step / float(setup["steps_per_epoch"])
    return {
        "epoch": float(epoch or 0.0),
        "global_step": step,
        "max_steps": int(setup.get("max_steps") or 0),
        "num_train_epochs": int(setup.get("num_train_epochs") or 0),
        "logging_steps": setup.get("logging_steps", 500),
        "eval_steps": setup.get("eval_steps", 500),
        "save_steps": setup.get("save_steps", 500),
        "train_batch_size": int(setup["train_batch_size"]),
        "num_input_tokens_seen": 0,
        "total_flos": 0.0,
        # The Trainer's log entries carry the global step after the update: record s -> s + 1.
        "log_history": [{**v, "step": s + 1} for s, v in sorted(history.items())],
        "best_metric": None,
        "best_model_checkpoint": None,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "is_hyper_param_search": False,
        "trial_name": None,
        "trial_params": None,
        "stateful_callbacks": {},
    }


# -- PyTorch Lightning -------------------------------------------------------------------
def export_lightning(run: Run, step: int, out: Path, trainer: Mapping[str, Any] | None = None) -> Path:
    """Write ``step`` as a Lightning ``.ckpt`` at ``out``."""
    setup = trainer_setup(run, "lightning", trainer)
    ckpt: dict[str, Any] = {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": _lightning_version(),
        "state_dict": run.state_dict(step),
        "optimizer_states": [run.optimizer_state_dict(step)],
        "callbacks": {},
    }
    state = run.step_state(step)
    ckpt["lr_schedulers"] = [state["scheduler"]] if state.get("scheduler") is not None else []
    if state.get("scaler") is not None:
        ckpt["MixedPrecision"] = state["scaler"]  # the key Lightning's 16-mixed plugin saves under
    if step > 0:  # at step 0 there is no progress to restore: the fit starts from the beginning
        ckpt["epoch"], ckpt["loops"] = _lightning_loops(run, step, setup, state.get("scheduler") is not None)
    # Lightning keeps no RNG in its checkpoints; StepdumpCallback restores this one on load.
    ckpt["stepdump"] = {"run": str(run.path), "step": step, "rng": state.get("rng")}
    save_atomically(out, lambda tmp: torch.save(ckpt, tmp))
    return out


def _lightning_version() -> str:
    from importlib import metadata

    for dist in ("lightning", "pytorch-lightning"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "2.5.0"  # the loop layout written below is Lightning 2.x's


def _lightning_loops(run: Run, step: int, setup: Mapping[str, Any], scheduler: bool) -> tuple[int, dict[str, Any]]:
    """(epoch, loops) as a checkpoint saved at ``on_train_batch_end`` of the batch whose
    optimizer step made ``global_step == step`` holds them."""
    batches = setup.get("num_training_batches")
    accumulate = setup.get("accumulate_grad_batches") or 1
    if batches is None:
        raise ConfigError(
            f"{run.path} does not say how many batches an epoch had (the StepdumpCallback records it); pass "
            "trainer={'num_training_batches': len(train_dataloader), 'accumulate_grad_batches': N} "
            "(CLI: --trainer num_training_batches=N)"
        )
    batches = float(batches)
    per_epoch = math.inf if math.isinf(batches) else math.ceil(batches / accumulate)
    epoch = 0 if math.isinf(per_epoch) else (step - 1) // int(per_epoch)
    k = step - epoch * (0 if math.isinf(per_epoch) else int(per_epoch))  # steps taken in this epoch
    m = int(min(k * accumulate, batches))  # micro-batches fetched in this epoch
    total_m = (0 if math.isinf(batches) else epoch * int(batches)) + m
    by_epoch = setup.get("scheduler_interval") == "epoch"
    sched_total, sched_cur = (epoch, 0) if by_epoch else (step, k)
    if not scheduler:
        sched_total = sched_cur = 0

    def batch(cur: int, tot: int, last: bool) -> dict[str, Any]:
        # Saved inside on_train_batch_end: the batch is processed, not yet completed.
        return {"current": _counts(cur, done=cur - 1), "total": _counts(tot, done=tot - 1), "is_last_batch": last}

    def opt(cur: int, tot: int) -> dict[str, Any]:
        return {"current": {"ready": cur, "completed": cur}, "total": {"ready": tot, "completed": tot}}

    epochs = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
    idle = {"current": _counts(0, 0), "total": _counts(0, 0), "is_last_batch": False}
    fit = {
        "state_dict": {},
        "epoch_progress": {"current": dict(epochs), "total": dict(epochs)},
        "epoch_loop.state_dict": {"_batches_that_stepped": step - 1},
        "epoch_loop.batch_progress": batch(m, total_m, m == batches),
        "epoch_loop.scheduler_progress": opt(sched_cur, sched_total),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": opt(k, step),
            # zero_grad runs before each step's first micro-batch: as often as the steps taken.
            "zero_grad": {"current": {"ready": k, "started": k, "completed": k},
                          "total": {"ready": step, "started": step, "completed": step}},
        }},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": opt(0, 0),
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": dict(idle),
    }
    loops = {
        "fit_loop": fit,
        "validate_loop": {"state_dict": {}, "batch_progress": dict(idle)},
        "test_loop": {"state_dict": {}, "batch_progress": dict(idle)},
        "predict_loop": {"state_dict": {}, "batch_progress": {"current": _counts(0, 0), "total": _counts(0, 0)}},
    }
    return epoch, loops


def _counts(n: int, done: int) -> dict[str, int]:
    """A batch's progress counters: ``n`` fetched, started and processed, ``done`` completed."""
    return {"ready": n, "started": n, "processed": n, "completed": done}


# -- files ------------------------------------------------------------------------------
def _fresh_dir(out: Path) -> Path:
    """A new staging folder beside ``out``; ``out`` must not exist, or be an empty folder."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"{out} already exists; give a new folder for the checkpoint, or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an export that was killed
    tmp.mkdir()
    return tmp


def _move_into_place(tmp: Path, out: Path) -> None:
    # Write then rename, so a failed export never leaves half a checkpoint at ``out``.
    if out.is_dir():
        out.rmdir()  # empty (checked by _fresh_dir)
    os.replace(tmp, out)
