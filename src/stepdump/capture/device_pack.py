"""A lean step on a GPU: stats and fingerprints computed on the device, a few numbers copied back.

On the CPU a stats-only step reads the live tensors (capture/lean.py). On CUDA that path would
copy every recorded byte to the host to hash it (xxh3 is sequential); here, instead, the
step's tensors are described on the device, on the recorder's side stream, by one
:func:`stepdump.core.device_lean.lean_pack` (the fused kernel where Triton is there): ten
stats and the dmix64 fingerprint per tensor, one ``(n, STATS_LEN + 1)`` int64 tensor, copied
by one ``non_blocking`` copy into pinned host memory. The training thread never waits for
it: the side stream waited for the training stream (the grads are final), the training
stream waits for the side stream before the optimizer's kernels (both on the GPU), and the
writer thread waits on the slot's event before it reads the rows (:func:`rows`).

docs/cuda.md designs it; FORMAT.md defines dmix64 and the ``fp_kinds`` table that says which
series carry it.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from stepdump.capture.packed import LeanRow
from stepdump.core.device_lean import DEVICE_FP_KIND, lean_pack
from stepdump.core.dtypes import dtype_name
from stepdump.core.stats import STATS_LEN
from stepdump.store.format import format_shape

# (kind, name, param, key, stored dtype, shape) of one row
Head = tuple[str, str, "str | None", "str | None", str, str]


@dataclass
class DevicePack:
    """A lean step's rows on their way to the writer: the heads, and the pinned host tensor that
    the side stream's copy fills (read only after the slot's event has fired)."""

    heads: list[Head]
    host: torch.Tensor  # (n, STATS_LEN + 1) int64, pinned


def pack_on_device(entries: list[tuple], pin: bool = True) -> torch.Tensor:
    """``lean_pack`` of the entries' tensors (``(kind, name, tensor, ...)``, all on one device),
    queued on the current stream, copied into (pinned) host memory by one ``non_blocking`` copy:
    the host pack, filled when the stream gets there. The device pack is let go here; the caching
    allocator keeps its memory until the copy recorded on its stream has run."""
    pack = lean_pack([e[2] for e in entries])
    host = torch.empty(pack.shape, dtype=torch.int64, pin_memory=pin and pack.device.type == "cuda")
    host.copy_(pack, non_blocking=True)
    return host


def heads(entries: list[tuple]) -> list[Head]:
    """The rows' heads: series names, and dtype and shape as the catalog writes them (the entries
    are dense: the sparse ones were staged apart). On the training thread, once a step: C-level
    maps over the list, the texts made once per dtype and shape, not per tensor."""
    ts = list(map(_TENSOR, entries))
    return list(zip(map(_KIND, entries), map(_NAME, entries), map(_PARAM, entries), map(_KEY, entries),
                    map(_dtype_text, map(_DTYPE, ts)), map(_shape_text, map(_SHAPE, ts))))


_KIND, _NAME, _TENSOR, _PARAM, _KEY = (operator.itemgetter(i) for i in (0, 1, 2, 4, 5))
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


@functools.lru_cache(maxsize=64)
def _dtype_text(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


@functools.lru_cache(maxsize=4096)
def _shape_text(shape: torch.Size) -> str:
    return format_shape(shape)


def rows(pack: DevicePack) -> list[LeanRow]:
    """The catalog rows of a device pack, once its copy has landed (the writer waited on the
    slot's event): the stats' float64 bits and the dmix64 fingerprint of each tensor."""
    host = pack.host.numpy()
    values = host[:, :STATS_LEN].copy().view(np.float64)
    counts = values[:, :4].astype(np.int64).tolist()
    rest = values[:, 4:].astype(object)  # NaN (no value) -> None, in C rather than per element
    rest[np.isnan(values[:, 4:])] = None
    fps = host[:, STATS_LEN].tolist()
    return [LeanRow(kind, name, param, key, dtype, shape, (*c, *r), fp, DEVICE_FP_KIND)  # type: ignore[arg-type]
            for (kind, name, param, key, dtype, shape), c, r, fp in zip(pack.heads, counts, rest.tolist(), fps)]
