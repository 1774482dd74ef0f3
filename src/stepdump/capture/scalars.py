"""Checking and queueing the scalars given to ``Recorder.log``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stepdump.errors import ConfigError


def checked_scalar(name: str, value: Any) -> Any:
    """The value ``log(name=value)`` queues, or a ConfigError naming the key.

    Checked here, at the call, so that a value the writer could not store never
    reaches it: a failure there would stop the recording for good. Tensors stay
    tensors (a private 1-element copy: no device sync on the training thread;
    the writer reads it later and training may change the original in place);
    everything else becomes a Python float now.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"log({name}=...) got a tensor of shape {tuple(value.shape)}; log a single number")
        if value.is_complex():
            raise ConfigError(f"log({name}=...) got a complex tensor; log a real number (.real, .imag or .abs())")
        if value.device.type == "meta" or value.is_quantized:
            raise ConfigError(f"log({name}=...) got a {value.device.type} tensor with no value to store; log a number")
        value = value.detach()
        return (value.to_dense() if value.layout != torch.strided else value).reshape(()).clone()
    if isinstance(value, (np.ndarray, np.generic)):
        if value.size != 1:
            raise ConfigError(f"log({name}=...) got a numpy array of shape {value.shape}; log a single number")
        value = value.reshape(-1)[0].item()
    if isinstance(value, complex):
        raise ConfigError(f"log({name}=...) got a complex number; log a real number")
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ConfigError(f"log({name}=...) got {type(value).__name__}; log numbers (float, int, 1-element tensor)")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"log({name}=...) got {type(value).__name__} that is not a 64-bit float: {e}") from None


def scalar_rows(step: int, values: dict[str, Any]) -> list[tuple[int, str, Any]]:
    # Values stay as logged (maybe CUDA tensors): the writer thread turns them
    # into floats, so the training thread never waits on a device sync for them.
    return [(step, name, v) for name, v in values.items()]


def auto_scalars(slot: dict[str, Any], optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """Scalars every record gets without asking: the lr of each param group, the AMP scale."""
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if lr is not None:
            slot.setdefault("lr" if i == 0 else f"lr/{i}", float(lr))
    if scaler is not None and scaler.is_enabled():
        slot.setdefault("grad_scale", float(scaler.get_scale()))


def profile_scalars(slot: dict[str, Any], iter_s: float, overhead_s: float, device: torch.device,
                    background_s: float | None = None, waited_s: float = 0.0, unseen_s: float = 0.0,
                    gpu_wait_s: float = 0.0) -> None:
    """Iteration wall time; the recorder's cost to it (``sys/recorder_ms``): the wall time of every
    hook it runs on the training thread, the optimizer's and the forward's (``overhead_s``, said
    apart as ``sys/recorder_hooks_ms``), plus what its threads took from that thread outside the
    hooks: the larger of ``waited_s`` (the time the thread was seen waiting off its CPU, at most
    their CPU time: profiling.ThreadWaits; said apart as ``sys/recorder_wait_ms``) and ``unseen_s``
    (their CPU time, less the hooks' waits on them: ThreadWaits.unseen; it holds the
    GIL the training thread takes back after every torch op, or a core it would run on); the CPU
    time of all its threads (``sys/recorder_bg_ms``); peak memory. ``gpu_wait_s``: of the hooks' wall
    time, what they spent waiting for a writer that waited for the GPU (``sys/recorder_gpu_wait_ms``,
    CUDA only: profiling.GpuWaits), already taken out of ``overhead_s``."""
    from stepdump.capture.profiling import RSS_LATER, peak_memory_mb

    slot["sys/iter_ms"] = iter_s * 1000
    # Its threads' part is at most the iteration's time outside the hooks: their CPU can run on
    # another core while the training thread works, and no cost exceeds the iteration it is part of.
    slot["sys/recorder_ms"] = (overhead_s + min(max(waited_s, unseen_s), max(iter_s - overhead_s, 0.0))) * 1000
    slot["sys/recorder_hooks_ms"] = overhead_s * 1000
    slot["sys/recorder_wait_ms"] = waited_s * 1000
    if device.type == "cuda":
        slot["sys/recorder_gpu_wait_ms"] = gpu_wait_s * 1000
    if background_s is not None:
        slot["sys/recorder_bg_ms"] = background_s * 1000
    # CUDA: the allocator's peak since the last step, read (and reset) now; CPU: the RSS, read by the writer.
    slot["sys/peak_mem_mb"] = peak_memory_mb(device) if device.type == "cuda" else RSS_LATER
