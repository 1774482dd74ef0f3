"""Export a recorded step as an ordinary checkpoint (torch.save dict or safetensors)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stepdump.errors import ConfigError

if TYPE_CHECKING:
    from stepdump.read.run import Run

FORMATS = ("torch", "safetensors")


def export(run: Run, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False) -> Path:
    """Write step ``step`` of ``run`` to ``path``.

    ``torch``: a dict with ``model``, ``optimizer``, ``scheduler``, ``scaler`` and
    ``step`` that ``torch.load(path, weights_only=True)`` reads and each object's
    ``load_state_dict`` accepts. ``safetensors``: the params (and with ``grads``
    the grads, as ``grads/<name>``) of the step, by recorded name.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose {' or '.join(FORMATS)}")
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; give a file path for the checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    if format == "torch":
        ckpt: dict[str, Any] = {
            "model": run.state_dict(step),
            "optimizer": run.optimizer_state_dict(step),
            "scheduler": run.scheduler_state_dict(step),
            "scaler": run.scaler_state_dict(step),
            "step": step,
        }
        torch.save(ckpt, tmp)
    else:
        from safetensors.torch import save_file

        tensors = {name: t.contiguous() for name, t in run.tensors(step, "params").items()}
        if grads:
            tensors.update({f"grads/{n}": t.contiguous() for n, t in run.tensors(step, "grads").items()})
        save_file(tensors, str(tmp), metadata={"stepdump_step": str(step), "stepdump_run": str(run.path)})
    # Write then rename, so a failed export never leaves a half checkpoint at ``path``.
    os.replace(tmp, out)
    return out
