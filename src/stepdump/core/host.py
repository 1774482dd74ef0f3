"""Which CPU kernels this process computes with: the ATen CPU capability and the BLAS.

Two hosts can run the same code on the same data and still differ in the last bits: ATen picks
its vectorized kernels (``DEFAULT``, ``AVX2``, ``AVX512``, ...) from the CPU's flags (or from
``ATEN_CPU_CAPABILITY``), and matmuls go through whichever BLAS torch was built with. The
Recorder writes both into a run's meta (``cpu_capability``, ``blas``: FORMAT.md) so that a
rebuild or replay that does not reproduce on another host can name the difference.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

#: torch's ``BLAS_INFO`` build setting -> the library's usual name.
_BLAS_NAMES = {"open": "openblas", "mkl": "mkl", "accelerate": "accelerate", "blis": "blis", "flexi": "flexiblas"}


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` (e.g. ``"AVX2"``), or ``"unknown"`` on a torch
    without it."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    try:
        return str(get()) if get is not None else "unknown"
    except Exception:  # an odd build: the run is still recorded, without the answer
        return "unknown"


@functools.lru_cache(maxsize=1)
def blas() -> str:
    """The BLAS torch was built with, short: ``"mkl 2024.2"``, ``"openblas"``, ``"accelerate"``;
    ``"none"`` when torch has none, ``"unknown"`` when its build config does not say."""
    try:
        config = torch.__config__.show()
    except Exception:
        return "unknown"
    return parse_blas(config)


def parse_blas(config: str) -> str:
    """The short BLAS name in the text of ``torch.__config__.show()`` (see :func:`blas`)."""
    m = re.search(r"BLAS_INFO=([^,\s]*)", config)
    if m is None:
        return "unknown"
    raw = m.group(1).strip().lower()
    if not raw:
        return "none"
    name = _BLAS_NAMES.get(raw, raw)
    if name == "mkl":  # the one BLAS whose version the config prints
        v = re.search(r"Math Kernel Library Version ([0-9][0-9.]*)", config)
        if v is not None:
            name = f"mkl {v.group(1).rstrip('.')}"
    return name


def kernels_meta() -> dict[str, Any]:
    """The run-meta keys that name this host's kernels (FORMAT.md, ``meta``)."""
    return {"cpu_capability": cpu_capability(), "blas": blas()}


def kernel_difference(meta: dict[str, Any]) -> str | None:
    """How the kernels recorded in a run's ``meta`` differ from this process's, in words
    (``"CPU capability AVX512 when recorded, AVX2 here"``); None when they match or the run
    did not record them (runs made before these keys existed)."""
    here = kernels_meta()
    parts = []
    for key, label in (("cpu_capability", "CPU capability"), ("blas", "BLAS")):
        then = meta.get(key)
        if isinstance(then, str) and then != here[key]:
            parts.append(f"{label} {then} when recorded, {here[key]} here")
    return "; ".join(parts) or None
