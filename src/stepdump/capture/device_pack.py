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
from itertools import compress, repeat
from typing import Any

import numpy as np
import torch

from stepdump.capture.packed import LeanRow, RowHead
from stepdump.capture.step_state import Entry
from stepdump.core.device_lean import DEVICE_FP_KIND, fused_module, lean_pack, reference_pack
from stepdump.core.dtypes import dtype_name
from stepdump.core.stats import STATS_LEN
from stepdump.store.format import format_shape
from stepdump.store.records import as_records



@dataclass
class DevicePack:
    """A lean step's rows on their way to the writer: the heads, and the pinned host tensor that
    the side stream's copy fills (read only after the slot's event has fired)."""

    heads: list[RowHead]
    host: torch.Tensor  # (n, STATS_LEN + 1) int64, pinned


def pack_on_device(entries: list[Entry], pin: bool = True) -> torch.Tensor:
    """``lean_pack`` of the entries' tensors (all on one device),
    queued on the current stream, copied into (pinned) host memory by one ``non_blocking`` copy:
    the host pack, filled when the stream gets there. The device pack is let go here; the caching
    allocator keeps its memory until the copy recorded on its stream has run."""
    return _to_host(lean_pack([e.tensor for e in entries]), pin)


def _to_host(pack: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(pack.shape, dtype=torch.int64, pin_memory=pin and pack.device.type == "cuda")
    host.copy_(pack, non_blocking=True)
    return host


@dataclass
class Prepared:
    """A lean step's entries ready to pack on the device (:meth:`DeviceLean.prepare`)."""

    tensors: list[torch.Tensor]
    heads: list[RowHead]
    plan: Any  # device_lean_triton's tables of the structure, or None: the torch-ops reference packs them
    ptrs: tuple[int, ...]  # the tensors' data pointers

    def launch(self, pin: bool = True) -> DevicePack:
        """Queue the pack on the current stream and its copy into (pinned) host memory."""
        if self.plan is not None:  # (bind() made it: the module is there)
            pack = fused_module().launch(self.plan, self.ptrs)
        else:
            pack = reference_pack(self.tensors)
        return DevicePack(self.heads, _to_host(pack, pin))


class DeviceLean:
    """The all-device lean step (a stats-only step whose every entry is a plain, dense tensor on
    one CUDA device): each tensor's layout read once a step, by C-level maps over the list (data
    pointer, dtype, shape, contiguity, device), the structure compared with the last step's. A
    steady step reuses the last step's heads and kernel tables (the data pointers, which may move
    from step to step, go to the device with each launch): no per-tensor Python, no second read
    of any attribute, no key to hash (three passes over GPT-2 small's 740 entries, and a bind of
    the pointer table at every step, cost the training thread ~2.4 ms on the H200's host before). ``device_type``: "cuda"; the CPU tests use
    "cpu" (the torch-ops reference packs there)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._layout: tuple[list[Any], ...] | None = None  # the last structure taken, its heads and tables
        self._heads: list[RowHead] = []
        self._plan: Any = None

    def prepare(self, entries: list[Entry]) -> Prepared | None:
        """The step's pack, ready to launch; None where an entry is stored in full or is not a
        plain dense tensor on the one device (the staging path takes the step)."""
        ts = list(map(_TENSOR, entries))
        if not ts or any(map(_FULL, entries)) or not frozenset(map(type, ts)) <= _PLAIN_TYPES:
            return None
        try:
            ptrs = tuple(map(_T.data_ptr, ts))
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return None
        layout = (list(map(_DTYPE, ts)), list(map(_SHAPE, ts)), list(map(_T.is_contiguous, ts)),
                  list(map(_T.get_device, ts)), list(map(_KIND, entries)), list(map(_NAME, entries)),
                  list(map(_PARAM, entries)), list(map(_KEY, entries)))
        if layout != self._layout:  # another structure: checked, its heads and tables made once
            if not self._takes(ts, layout[0], layout[3]):
                return None
            dtypes, shapes, _, _, kinds, names, params, keys = layout
            self._heads = _make_heads(kinds, names, params, keys, dtypes, shapes)
            self._plan = _bind(ts, self.device_type)
            self._layout = layout
        return Prepared(ts, self._heads, self._plan, ptrs)

    def _takes(self, ts: list[torch.Tensor], dtypes: list[torch.dtype], devices: list[int]) -> bool:
        """Every tensor on the one device of ``device_type``, strided, of a dtype with stats."""
        return (all(t.device.type == self.device_type for t in ts) and len(set(devices)) == 1
                and set(map(_LAYOUT, ts)) == {torch.strided} and not set(dtypes) & _QUANTIZED)


def _bind(ts: list[torch.Tensor], device_type: str) -> Any:
    """The fused kernel's tables for the structure of ``ts``, or None (no Triton, or a list it declines)."""
    fused = fused_module() if device_type == "cuda" else None
    return None if fused is None else fused.bind(ts)


def heads(entries: list[Entry]) -> list[RowHead]:
    """The rows' heads: series names, and dtype and shape as the catalog writes them (the entries
    are dense: the sparse ones were staged apart). On the training thread, once a step: C-level
    maps over the list, the texts made once per dtype and shape, not per tensor."""
    return HeadsCache()(entries)


class HeadsCache:
    """:func:`heads` of a step, the same list object while the entries' kinds, names, params, keys,
    dtypes and shapes stay those of the last call: a steady run's steps share one heads list, on
    which the writer keys the rows' series ids (writer_lean.LeanRows.device_rows), so neither
    thread does Python per tensor for them at a steady step."""

    def __init__(self) -> None:
        self._key: tuple[list[Any], ...] | None = None
        self._heads: list[RowHead] = []

    def __call__(self, entries: list[Entry]) -> list[RowHead]:
        ts = list(map(_TENSOR, entries))
        key = (list(map(_KIND, entries)), list(map(_NAME, entries)), list(map(_PARAM, entries)),
               list(map(_KEY, entries)), list(map(_DTYPE, ts)), list(map(_SHAPE, ts)))
        if key != self._key:  # element-wise: strings, dtypes, torch.Size (the same objects, mostly)
            self._heads = _make_heads(*key)
            self._key = key
        return self._heads


def _make_heads(kinds: list[str], names: list[str], params: list[str | None], keys: list[str | None],
                dtypes: list[torch.dtype], shapes: list[torch.Size]) -> list[RowHead]:
    return as_records(RowHead, zip(kinds, names, params, keys, map(_dtype_text, dtypes), map(_shape_text, shapes)))


_KIND, _NAME, _TENSOR, _FULL, _PARAM, _KEY = map(operator.attrgetter, Entry._fields)
_DTYPE, _SHAPE, _LAYOUT = operator.attrgetter("dtype"), operator.attrgetter("shape"), operator.attrgetter("layout")
_T = torch.Tensor
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_QUANTIZED = frozenset((torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4))


@functools.lru_cache(maxsize=64)
def _dtype_text(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


@functools.lru_cache(maxsize=4096)
def _shape_text(shape: torch.Size) -> str:
    return format_shape(shape)


def _columns(pack: DevicePack) -> tuple[list[list[int]], list[list[float | None]], list[int]]:
    """The pack's columns as Python values: the four counts (int), the six other stats (float,
    NaN -> None: no value) and the dmix64 fingerprints, converted in C (numpy), not per element."""
    host = pack.host.numpy()
    values = host[:, :STATS_LEN].view(np.float64)
    counts = values[:, :4].astype(np.int64).T.tolist()
    other = values[:, 4:]
    rest = other.astype(object)
    rest[np.isnan(other)] = None
    return counts, rest.T.tolist(), host[:, STATS_LEN].tolist()


def rows(pack: DevicePack) -> list[LeanRow]:
    """The catalog rows of a device pack, once its copy has landed (the writer waited on the
    slot's event): the stats' float64 bits and the dmix64 fingerprint of each tensor."""
    counts, rest, fps = _columns(pack)
    return [LeanRow(*head, stats, fp, DEVICE_FP_KIND)  # type: ignore[arg-type]
            for head, stats, fp in zip(pack.heads, zip(*counts, *rest), fps)]


_H_DTYPE, _H_SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


def catalog_rows(pack: DevicePack, step: int | None, series: list[int], keep: list[bool] | None = None) -> list[tuple]:
    """The pack's rows as the catalog inserts them (``(series, step, dtype, shape, blob, *stats, fp)``,
    what :func:`rows` and the writer's ``LeanRows.rows`` make, without a LeanRow per tensor):
    ``series`` the series id of each head, ``keep`` (None: all) which rows to keep."""
    counts, rest, fps = _columns(pack)
    h = pack.heads
    out = list(zip(series, repeat(step), map(_H_DTYPE, h), map(_H_SHAPE, h), repeat(None), *counts, *rest, fps))
    return out if keep is None else list(compress(out, keep))
