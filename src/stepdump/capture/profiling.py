"""Cheap per-step resource readings for the ``sys/*`` scalars."""

from __future__ import annotations

import os

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last call (then reset). CPU: current process RSS."""
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:  # not Linux: the lifetime peak is the best cheap number
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
