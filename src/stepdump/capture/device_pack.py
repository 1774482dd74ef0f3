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
import math
from dataclasses import dataclass

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


def pack_on_device(entries: list[tuple], pin: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``lean_pack`` of the entries' tensors (``(kind, name, tensor, ...)``, all on one device),
    queued on the current stream, and its pinned host copy (``non_blocking``: filled when the
    stream gets there). Returns (device pack, host pack); the device one must live until then,
    which the caching allocator sees to (the copy is recorded on the stream that made it)."""
    pack = lean_pack([e[2] for e in entries])
    host = torch.empty(pack.shape, dtype=torch.int64, pin_memory=pin and pack.device.type == "cuda")
    host.copy_(pack, non_blocking=True)
    return pack, host


def heads(entries: list[tuple]) -> list[Head]:
    """The rows' heads: series names, and dtype and shape as the catalog writes them (the entries
    are dense: the sparse ones were staged apart). On the training thread, once a step: the
    texts are made once per dtype and shape, not per tensor."""
    return [(e[0], e[1], e[4], e[5], _dtype_text(e[2].dtype), _shape_text(e[2].shape)) for e in entries]


@functools.lru_cache(maxsize=64)
def _dtype_text(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


@functools.lru_cache(maxsize=4096)
def _shape_text(shape: torch.Size) -> str:
    return format_shape(shape)


def stats_of(values: list[float]) -> tuple[object, ...]:
    """A pack row's ten stats as the catalog stores them: counts as integers, NaN (no finite
    element, an empty tensor) as NULL, as :func:`stepdump.core.stats.compute_stats` gives None."""
    counts = tuple(int(v) for v in values[:4])
    return counts + tuple(None if math.isnan(v) else float(v) for v in values[4:])


def rows(pack: DevicePack) -> list[LeanRow]:
    """The catalog rows of a device pack, once its copy has landed (the writer waited on the
    slot's event): the stats' float64 bits and the dmix64 fingerprint of each tensor."""
    host = pack.host
    stats = host[:, :STATS_LEN].contiguous().view(torch.float64).tolist()
    fps = host[:, STATS_LEN].tolist()
    return [LeanRow(kind, name, param, key, dtype, shape, stats_of(s), fp, DEVICE_FP_KIND)  # type: ignore[arg-type]
            for (kind, name, param, key, dtype, shape), s, fp in zip(pack.heads, stats, fps)]
