"""Export a recorded step as an ordinary checkpoint: a torch.save dict, a safetensors file,
or a checkpoint the Hugging Face Trainer or Lightning resumes from (read/export_trainers.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stepdump.errors import ConfigError, TensorNotFoundError
from stepdump.read.export_files import save_atomically

if TYPE_CHECKING:
    from stepdump.read.run import Run

FORMATS = ("torch", "safetensors", "hf-trainer", "lightning")


def export(run: Run, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False,
           trainer: Mapping[str, Any] | None = None, rank: int | None = None) -> Path:
    """Write step ``step`` of ``run`` to ``path``.

    The one implementation behind ``run.export``, ``stepdump.export.export_checkpoint`` and
    ``stepdump export``: all three take these arguments and write the same checkpoint.

    Record *t* is the state after *t* optimizer steps: params, buffers and optimizer /
    scheduler / scaler state before update *t*, and the RNG at the start of iteration *t*.

    Formats:
        ``torch``: a dict with ``model``, ``optimizer``, ``scheduler``, ``scaler`` and
        ``step`` that ``torch.load(path, weights_only=True)`` reads and each object's
        ``load_state_dict`` accepts. ``safetensors``: the params (and with ``grads``
        the grads, as ``grads/<name>``; a sparse grad as the dense tensor it stands for,
        ``to_dense()``) of the step, by recorded name.
        ``hf-trainer``: a folder for ``Trainer.train(resume_from_checkpoint=path)``.
        ``lightning``: a ``.ckpt`` for ``Trainer.fit(model, ckpt_path=path)``.

    Args:
        trainer: For ``hf-trainer`` and ``lightning``: the training setup the checkpoint's
            loop counters need (``train_batch_size``; ``num_training_batches``,
            ``accumulate_grad_batches``), over what the stepdump callback recorded.
        rank: For a run recorded on several ranks: export rank ``rank``'s store as it was
            recorded (its shards under FSDP2) instead of the consolidated full tensors.

    Raises:
        ConfigError: an unknown format, options that do not fit it, or a setup the run lacks.
        StepNotFoundError: ``step`` is not stored in full (nor rebuildable).
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if rank is not None:
        run = _rank_store(run, rank)
    out = Path(path)
    if format in ("hf-trainer", "lightning"):
        from stepdump.read import export_trainers

        if grads:
            raise ConfigError(f"a {format} checkpoint holds no gradients; drop grads=True (--grads)")
        if format == "hf-trainer":
            return export_trainers.export_hf_trainer(run, step, out, trainer)
        return export_trainers.export_lightning(run, step, out, trainer)
    if trainer is not None:
        raise ConfigError(f"trainer= is for the hf-trainer and lightning formats, not {format}")
    if format == "torch":
        ckpt: dict[str, Any] = {
            "model": run.state_dict(step),
            "optimizer": run.optimizer_state_dict(step),
            "scheduler": run.scheduler_state_dict(step),
            "scaler": run.scaler_state_dict(step),
            "step": step,
        }
        return save_atomically(out, lambda tmp: torch.save(ckpt, tmp))
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in run.tensors(step, "params").items()}
    if grads:
        found = run.tensors(step, "grads")
        if not found:
            raise TensorNotFoundError(
                f"step {step} of {run.path} has no gradients (the run was recorded without them, or this is "
                "the final record, taken after the last update); export it without grads (leave out --grads)"
            )
        # safetensors has no sparse layout: a sparse grad goes out as the dense tensor it stands for.
        tensors.update({f"grads/{n}": (t.to_dense() if t.layout != torch.strided else t).contiguous()
                        for n, t in found.items()})
    meta = {"stepdump_step": str(step), "stepdump_run": str(run.path)}
    return save_atomically(out, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def _rank_store(run: Run, rank: int) -> Run:
    """Rank ``rank``'s store of a multi-rank run; a single store refuses ``rank=``."""
    from stepdump.read.reader import ranked_stores

    if not ranked_stores(run):
        raise ConfigError(f"rank= is for a run recorded on several ranks; {run.path} is one store: leave rank "
                          "out (--rank)")
    return run.rank(rank)  # type: ignore[attr-defined, no-any-return]  # a DistributedRun: it names a missing rank
