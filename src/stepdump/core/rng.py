"""RNG state of every generator a training step may draw from."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Torch CPU, every CUDA device (when present), numpy's global and Python's ``random``."""
    np_state: Any = np.random.get_state()  # a tuple (legacy=True); typed as dict | tuple
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "alg": np_state[0],
            "keys": torch.from_numpy(np.array(np_state[1], dtype=np.uint32)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        # MT19937 words (and the position, <= 624) all fit 32 bits: half the bytes of int64.
        # (np.fromiter then from_numpy: the same uint32 values as torch.tensor(py_internal), 4x faster.)
        "python": {"version": py_version,
                   "state": torch.from_numpy(np.fromiter(py_internal, dtype=np.uint32, count=len(py_internal))),
                   "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`get_rng_state`."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["alg"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([c.to(torch.uint8) for c in cuda])
