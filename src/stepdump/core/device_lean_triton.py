"""The fused device kernel of the lean path: a step's stats and dmix64 fingerprints in one read.

:func:`fused_pack` computes, for a list of tensors on one GPU, what
:func:`stepdump.core.device_lean.reference_pack` computes with plain torch ops (the ten
:func:`stepdump.core.stats.device_stats` and the dmix64 fingerprint of each tensor, packed as
``(n, STATS_LEN + 1)`` int64), in ``g + 1`` kernel launches for ``g`` dtypes in the list,
whatever the number of tensors (docs/cuda.md, "The fused kernel"):

1. per dtype, one launch over a table of chunks (tensor index, element start, element count) of
   at most ``_CHUNK`` (65,536) elements each: a chunk's program reads its elements once,
   ``_BLOCK`` at a time, as unsigned integers of the dtype's width, into per-lane accumulators
   reduced once at its end, and writes its partials: the finite, NaN, +Inf, -Inf and zero
   counts, min and max over its finite elements (float32 for float32 and narrower floats: the
   same values), their sum, sum of squares and M2 (float64, shifted by the mean of the chunk's
   first block: exact terms, see the kernel), and the fingerprint's partial sum
   ``sum fmix(w_i + (i + 1) * K1)`` over the chunk's 8-byte words (words built from the
   elements, so a tensor's bytes are never read past its end and a view at any element offset
   is read right: the last partial word is zero-padded by the masked load);
2. one launch, one program per tensor, that combines the tensor's tile partials in tile order
   (Chan's formula for M2) and writes the packed row.

No atomics and a fixed tile order: the same input gives the same bits at every call. Counts,
min, max, the zero fraction and the fingerprint equal the reference bit for bit; mean, std
and norm are sums in another order (within 1e-12 relative).

The tile tables are cached per structure (:func:`bind`: each tensor's dtype, numel, contiguity
and device, four C-level reads per tensor mapped over the list, no Python loop body), so a
steady step launches the same kernels on the same tables; the data pointers go to the device
with each launch (:func:`launch`: one small copy on the launch's stream), whose reading of
them (whole blocks as words where a dtype's tensors all start on an 8-byte boundary) is
decided there. A caller that tracks the structure itself (capture/device_pack.DeviceLean)
binds once per structure and launches with the pointers of the step.

Returns None, for the whole list, where it does not apply (the caller then uses the torch-ops
reference): Triton not importable, tensors not all on one CUDA device, a tensor that is
sparse, not contiguous, or of a dtype outside :data:`SUPPORTED_DTYPES`. Under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, set before this module is imported) the private
``_allow_cpu=True`` lets the kernels run on CPU tensors: that is how the CPU-only development
machine and ``tests_gpu/test_device_lean_triton.py`` run them without a GPU.
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stepdump.core.stats import STATS_LEN

from stepdump.core.device_lean_kernels import tl, triton  # None, None without Triton

log = logging.getLogger(__name__)

# dtype -> (bytes per element, value kind, value type name); each is loaded as the unsigned
# integer of its width (its exact bits: the fingerprint's input).
# Value kinds: 0 float (bitcast to the value type), 1 signed int (bitcast), 2 unsigned, 3 bool,
# 4 bfloat16 (shifted into a float32: exact, without relying on a bfloat16 type).
_DTYPES: dict[torch.dtype, tuple[int, int, str]] = {
    torch.float32: (4, 0, "float32"),
    torch.float16: (2, 0, "float16"),
    torch.bfloat16: (2, 4, "uint16"),
    torch.float64: (8, 0, "float64"),
    torch.int64: (8, 1, "int64"),
    torch.int32: (4, 1, "int32"),
    torch.int16: (2, 1, "int16"),
    torch.int8: (1, 1, "int8"),
    torch.uint8: (1, 2, "uint8"),
    torch.bool: (1, 3, "uint8"),
}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPES)

_BLOCK = 512  # elements a chunk's program reads at a time: a power of two, a multiple of 8 (whole words)
_CHUNK = 65536  # elements per chunk, one program each: a multiple of _BLOCK
# Measured on an H200 (torch 2.11, Triton 3.6), GPT-2 small's 592 fp32 tensors (1.99 GB), chunks of
# 65,536 (benchmarks/device_lean_bench.py --sweep). Whole blocks read as words: 512 x 8 warps 1.37 ms
# (1,458 GB/s), 512 x 4 1.43, 1,024 x 8 1.61 (1.32 with 3 pipelining stages), 2,048 x 8 2.18,
# 2,048 x 16 1.72, 4,096 x 16 1.92; chunks of 131,072 or 32,768 at 1,024 x 8: 1.46 / 1.78; the floor
# (one _foreach_norm over the same bytes) 1.09. Read element by element instead (~100 instructions
# an element, issue-bound: pipelining and block sizes moved it by 5% only): 512 x 8 2.04-2.06 ms.
_NUM_WARPS = 8
# Software pipelining (tl.range's num_stages=3) was tried by the same sweep: 1.32 ms at 1,024 x 8,
# within 3% of 512 x 8 without it; not kept (plain range: long-standing Triton, no version floor).
_COMBINE_BLOCK = 256  # tile partials a combining program reads at a time
_CACHE_SIZE = 16  # structures kept (a run has a few: lean steps, full steps)

if triton is not None:
    from stepdump.core.device_lean_kernels import _chunk_kernel, _combine_kernel


@dataclass
class _Plan:
    """The device tables of one structure (a list's dtypes and sizes, on one device): all but the
    data pointers, so tensors given new memory (grads set to None and allocated again) reuse them."""

    device: torch.device
    n_tensors: int
    n_tiles: int
    tile_tensor: torch.Tensor  # int64, one per tile, tiles grouped by dtype
    tile_start: torch.Tensor  # int64 element start within the tensor
    tile_count: torch.Tensor  # int64 elements in the tile (1 .. _BLOCK)
    tensor_first: torch.Tensor  # int64 first tile row of each tensor
    tensor_tiles: torch.Tensor  # int64 tiles of each tensor (0 for an empty tensor)
    tensor_numel: torch.Tensor
    tensor_nbytes: torch.Tensor
    groups: list[tuple[torch.dtype, int, int]]  # (dtype, first tile row, tiles) per launch
    members: list[np.ndarray]  # the tensors of each group (their indices), for the alignment check


# The structure (dtypes, numels, contiguity, devices) -> its tables, or why the kernel declines it.
# Data pointers are not part of it: they go to the device at each launch (a table of n int64 from
# the caching allocator, on the launch's stream, let go after it). Tables kept per address set
# held device memory that moved the next step's small grads elsewhere, so no address set came
# back and each step bound again (the H200: 20 binds in 20 GPT-2-small steps, ~1 ms each).
_structures: OrderedDict[tuple[Any, ...], _Plan | str] = OrderedDict()
_T = torch.Tensor
_dtype_of = operator.attrgetter("dtype")


def fused_pack(tensors: Sequence[torch.Tensor], *, _allow_cpu: bool = False) -> torch.Tensor | None:
    """``(n, STATS_LEN + 1)`` int64 on the tensors' device: row i is ``device_stats(tensors[i])``
    as float64 bits, then the dmix64 fingerprint of ``tensors[i]``; queued on the current stream,
    never waited for. None where the kernel does not take the list (module docstring): the
    caller then uses :func:`stepdump.core.device_lean.reference_pack`. ``_allow_cpu`` is for
    tests under Triton's CPU interpreter only."""
    if not tensors:  # nothing to launch, with or without Triton
        return torch.empty((0, STATS_LEN + 1), dtype=torch.int64)
    plan = bind(tensors, _allow_cpu=_allow_cpu)
    return None if plan is None else launch(plan, list(map(_T.data_ptr, tensors)))


def bind(tensors: Sequence[torch.Tensor], *, _allow_cpu: bool = False) -> _Plan | None:
    """The tables of the list's structure (built once per structure, cached), or None where the
    kernel does not take the list. :func:`launch` them with the tensors' data pointers at each
    call: a caller that knows the structure has not changed (the same dtypes, sizes, contiguity
    and device) launches the same plan again without binding."""
    if triton is None:
        return None
    if not (_allow_cpu or tensors[0].is_cuda):  # a CPU list (a dmix64 CPU run): no key, no tables
        return None
    try:
        # Four C-level reads per tensor, mapped over the list (no Python loop body): the structure;
        # and the data pointer, which raises for sparse and other storage-less layouts.
        key = (*map(_dtype_of, tensors), *map(_T.numel, tensors), *map(_T.is_contiguous, tensors),
               *map(_T.get_device, tensors))
        tensors[0].data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    plan = _structures.get(key)
    if plan is None:
        plan = _plan(tensors)
        if isinstance(plan, str):
            log.debug("fused_pack: not taken, the torch-ops reference is used: %s", plan)
        _remember(_structures, key, plan)
    else:
        _structures.move_to_end(key)
    return None if isinstance(plan, str) else plan


def _remember(cache: OrderedDict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> None:
    cache[key] = value
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 table on the device, queued on the current stream without a host wait: through
    pinned memory from torch's caching host allocator, which keeps the block until the copy ran."""
    host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cuda":  # the interpreter's CPU tensors: the table itself
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _refusal(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why the kernel does not take the list, or None when it does."""
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            return f"tensor {i} is {t.layout}"
        if t.device != dev:
            return f"tensor {i} is on {t.device}, tensor 0 on {dev}"
        if t.dtype not in _DTYPES:
            return f"tensor {i} is {t.dtype}"
        if not t.is_contiguous():
            return f"tensor {i} is not contiguous"
    if dev.type not in ("cuda", "cpu"):  # cpu: under the interpreter only (fused_pack checks)
        return f"the tensors are on {dev}, not a CUDA device"
    return None


def _plan(tensors: Sequence[torch.Tensor]) -> _Plan | str:
    """The tile tables of a layout, built with numpy (no per-tile Python) and moved to the device once."""
    why = _refusal(tensors)
    if why is not None:
        return why
    dev = tensors[0].device
    n = len(tensors)
    numel = np.array([t.numel() for t in tensors], dtype=np.int64)
    itemsize = np.array([t.element_size() for t in tensors], dtype=np.int64)
    tiles = (numel + _CHUNK - 1) // _CHUNK
    order: list[int] = []
    groups: list[tuple[torch.dtype, int, int]] = []
    group_members: list[np.ndarray] = []
    row = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # dtypes in order of first appearance
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        count = int(tiles[members].sum())
        if count:
            groups.append((dtype, row, count))
            group_members.append(np.array(members, dtype=np.int64))
        order.extend(members)
        row += count
    order_a = np.array(order, dtype=np.int64)
    tiles_in_order = tiles[order_a]
    first = np.zeros(n, dtype=np.int64)
    first[order_a] = np.cumsum(tiles_in_order) - tiles_in_order
    tile_tensor = np.repeat(order_a, tiles_in_order)
    # Tile (chunk) k of a tensor starts at element k * _CHUNK: k = row - the tensor's first row.
    tile_k = np.arange(row, dtype=np.int64) - first[tile_tensor]
    tile_start = tile_k * _CHUNK
    tile_count = np.minimum(numel[tile_tensor] - tile_start, _CHUNK)

    # One copy to the device, then views of it: the tables, in _Plan's order.
    parts = [tile_tensor, tile_start, tile_count, first, tiles, numel, numel * itemsize]
    table = _to_device(np.concatenate(parts), dev)
    tile_tensor_d, tile_start_d, tile_count_d, first_d, tiles_d, numel_d, nbytes_d = torch.split(
        table, [len(x) for x in parts])
    return _Plan(dev, n, row, tile_tensor_d, tile_start_d, tile_count_d, first_d, tiles_d, numel_d, nbytes_d, groups,
                 group_members)


def launch(plan: _Plan, data_ptrs: Sequence[int]) -> torch.Tensor:
    """The pack of the tensors at ``data_ptrs`` (in the list's order), of ``plan``'s structure
    (:func:`bind`): their pointer table copied to the device, then g + 1 launches, all on the
    current stream; fresh pointer, partial and output buffers each call (the caching allocator
    makes them cheap and reuses them in stream order, and a result the caller still holds is never
    rewritten). A dtype with a tensor not on an 8-byte boundary is read element by element."""
    addr = np.array(data_ptrs, dtype=np.uint64)
    odd = addr % 8 != 0
    unaligned = frozenset(g[0] for g, m in zip(plan.groups, plan.members) if odd[m].any()) if odd.any() else frozenset()
    ptrs = _to_device(addr.view(np.int64), plan.device)
    if plan.device.type == "cuda":
        with torch.cuda.device(plan.device):  # Triton launches on the current device
            return _launch_here(plan, ptrs, unaligned)
    return _launch_here(plan, ptrs, unaligned)


def _launch_here(plan: _Plan, ptrs: torch.Tensor, unaligned: frozenset[torch.dtype]) -> torch.Tensor:
    fpart = torch.empty((max(plan.n_tiles, 1), 5), dtype=torch.float64, device=plan.device)
    ipart = torch.empty((max(plan.n_tiles, 1), 6), dtype=torch.int64, device=plan.device)
    out = torch.empty((plan.n_tensors, STATS_LEN + 1), dtype=torch.int64, device=plan.device)
    tile_kernel: Any = _chunk_kernel  # Triton's launch syntax, untyped for mypy wherever Triton is installed
    combine_kernel: Any = _combine_kernel
    for dtype, first_row, count in plan.groups:
        size, kind, value_type = _DTYPES[dtype]
        tile_kernel[(count,)](ptrs, plan.tile_tensor, plan.tile_start, plan.tile_count, first_row,
                              fpart, ipart, BLOCK=_BLOCK, R=8 // size, KIND=kind,
                              VT=getattr(tl, value_type), F32=kind in (0, 4) and size < 8,
                              ALIGNED=dtype not in unaligned, num_warps=_NUM_WARPS)
    combine_kernel[(plan.n_tensors,)](plan.tensor_first, plan.tensor_tiles, plan.tensor_numel, plan.tensor_nbytes,
                                      fpart, ipart, out, CB=_COMBINE_BLOCK, OUT_LEN=STATS_LEN + 1, num_warps=4)
    return out
