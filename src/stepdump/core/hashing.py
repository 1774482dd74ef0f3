"""Fingerprints: xxh3-64 of a tensor's exact little-endian bytes (and the rules for comparing two
kinds of fingerprint: :func:`same_fingerprint`, :func:`fingerprint_as`).

Equal fingerprints mean bitwise-equal bytes (to 2**-64); dtype and shape are
compared separately. A sparse COO tensor's bytes include its structure (indices in their
order, the coalesced flag): FORMAT.md, "Sparse tensors". Used by the writer, every reader and ``verify``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from stepdump.core.sparse import sparse_raw_bytes
from stepdump.errors import FormatVersionError


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, C-contiguous, little-endian, without a copy when possible. A sparse
    COO tensor's are its header, indices and values (:mod:`stepdump.core.sparse`), a copy."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return sparse_raw_bytes(t)
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def signed64(u: int) -> int:
    """SQLite integers are signed 64-bit; store unsigned hashes in that range."""
    return u - (1 << 64) if u >= (1 << 63) else u


def fingerprint_bytes(data: memoryview | bytes) -> int:
    return signed64(xxhash.xxh3_64_intdigest(data))


def fingerprint(t: torch.Tensor) -> int:
    """Fingerprint of a tensor's exact bytes (dtype and shape are compared separately)."""
    return fingerprint_bytes(raw_bytes(t))


# Tensor types whose bytes are the tensor's own (not a DTensor's, not another subclass's).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_META = attrgetter("dtype", "shape")


def _set_key(ts: list[torch.Tensor]) -> tuple[list[int], list[Any], list[Any]]:
    """What proves kept views still cover ``ts``: data pointers, dtypes and shapes, strides (a view
    holds the memory it was made from, so no other tensor gets that address while it is kept)."""
    return list(map(torch.Tensor.data_ptr, ts)), list(map(_META, ts)), list(map(torch.Tensor.stride, ts))


class _View(NamedTuple):
    """A tensor's bytes as a view, and what proves it still covers them."""

    data_ptr: int
    dtype: torch.dtype
    shape: torch.Size
    view: memoryview


class _SetViews(NamedTuple):
    """A set of tensors' views (LiveHasher.fingerprint_all)."""

    names: list[str] | None  # None: a list of tensors (fingerprint_seq)
    key: tuple[list[int], list[Any], list[Any]]  # proves the views still cover them (_set_key)
    views: list[memoryview]


class LiveHasher:
    """Fingerprints of the same live tensors, again and again, at xxh3's own cost.

    :func:`fingerprint` spends most of its time on a small tensor making a byte view of it
    (detach, reshape, view, numpy: ~10 us, for ~0.1 us of hashing). Here the view of a
    contiguous CPU tensor is made once per key and reused while the tensor has the same data
    pointer, dtype and shape (checked at every call, ~1 us): then the view covers exactly the
    bytes the tensor holds now, whatever wrote them (in-place ops, ``.data``, a numpy view),
    so its hash is the exact fingerprint; the view holds the memory it was made from, so no
    other tensor gets that address while it is cached. A tensor given other memory
    (``param.data = ...``, ``set_``, a storage resized elsewhere) has another data pointer and
    gets a new view. The result is always :func:`fingerprint` of the tensor as it is now;
    only the cost differs.
    """

    def __init__(self) -> None:
        # One view per key, so a replaced tensor's memory is let go.
        self._views: dict[Hashable, _View] = {}
        # The same for whole sets of tensors (fingerprint_all, fingerprint_seq): the last two, as a
        # caller may alternate between two sets (a lean step's params, and every tenth step its
        # params and optimizer state).
        self._sets: list[_SetViews] = []

    def fingerprint_all(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, int] | None:
        """name -> ``fingerprint`` of each of ``tensors`` (plain, contiguous, non-empty CPU tensors),
        by views kept for the whole set and checked by one key made in a few C-level calls, not
        several Python calls a tensor; None when one of them is of another kind (then call this
        hasher per tensor)."""
        names = list(tensors)
        fps = self._fingerprints(list(tensors.values()), names)
        return None if fps is None else dict(zip(names, fps, strict=True))

    def fingerprint_seq(self, tensors: list[torch.Tensor]) -> list[int] | None:
        """:meth:`fingerprint_all` of a list of tensors, in its order (the same cache of the last two sets)."""
        return self._fingerprints(tensors, None)

    def _fingerprints(self, ts: list[torch.Tensor], names: list[str] | None) -> list[int] | None:
        key = _set_key(ts)
        kept = next((s for s in self._sets if s.names == names and s.key == key), None)
        if kept is None:
            if not all(type(t) in PLAIN_TENSORS and t.layout == torch.strided and t.is_cpu and not t.is_quantized
                       and t.is_contiguous() and t.numel() > 0 for t in ts):
                return None
            kept = _SetViews(names, key, [raw_bytes(t) for t in ts])
            self._sets = [kept, *self._sets[:1]]  # (the older one goes: its views let their memory go)
        fps = np.fromiter(map(xxhash.xxh3_64_intdigest, kept.views), dtype=np.uint64, count=len(ts))
        return fps.view(np.int64).tolist()  # type: ignore[no-any-return]

    def __call__(self, t: torch.Tensor, key: Hashable) -> int:
        """``fingerprint(t)``, with the byte view reused from the last call with ``key`` (the tensor's
        name) where it covers ``t`` now (``t`` may be a fresh object: a detach(), a DTensor's local part)."""
        if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized or not t.is_contiguous() \
                or t.numel() == 0:
            return fingerprint(t)
        hit = self._views.get(key)
        if hit is not None and hit.data_ptr == t.data_ptr() and hit.dtype == t.dtype and hit.shape == t.shape:
            return signed64(xxhash.xxh3_64_intdigest(hit.view))
        view = raw_bytes(t)
        self._views[key] = _View(t.data_ptr(), t.dtype, t.shape, view)
        return fingerprint_bytes(view)


#: The fingerprint kinds a store may hold (FORMAT.md; docs/cuda.md "The device fingerprint"):
#: xxh3-64 of the bytes (the host's, every store of format 1) and dmix64 (the device's). The
#: names are ``core.device_lean``'s HOST_FP_KIND / DEVICE_FP_KIND, said here too so that a
#: comparison does not import the device code.
XXH3 = "xxh3"
DMIX64 = "dmix64"


def same_fingerprint(kind_a: str, fp_a: int, kind_b: str, fp_b: int) -> bool | None:
    """Whether two recorded fingerprints say "the same bytes": True only for one kind and one
    value, False for one kind and two values, None (not comparable) for two kinds, whatever the
    values: an xxh3 and a dmix64 number are unrelated, equal or not, so neither "identical" nor
    "different" would be true. The caller then compares the bytes, or says what it could not."""
    if kind_a != kind_b:
        return None
    return fp_a == fp_b


def fingerprint_bytes_as(kind: str, data: bytes | bytearray | memoryview) -> int:
    """The fingerprint under ``kind`` of a tensor whose raw bytes (:func:`raw_bytes`) are ``data``:
    how a reader checks a stored blob against its row (dmix64 is defined on the bytes alone)."""
    if kind == XXH3:
        return fingerprint_bytes(memoryview(data))
    buf = memoryview(data)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    if buf.readonly:  # torch.frombuffer wants memory it may write (it never does here)
        buf = memoryview(bytearray(buf))
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return fingerprint_as(kind, t)


def fingerprint_as(kind: str, t: torch.Tensor) -> int:
    """``t``'s fingerprint under ``kind`` (a recorded row's), to check a live or rebuilt tensor
    against that row: xxh3 via :func:`fingerprint`, dmix64 via
    ``core.device_lean.device_fingerprint`` (on ``t``'s device, then read back).

    Raises:
        FormatVersionError: ``kind`` is not one this stepdump knows (a newer store's): update stepdump.
    """
    if kind == XXH3:
        return fingerprint(t)
    if kind == DMIX64:
        from stepdump.core.device_lean import device_fingerprint  # torch ops; only for dmix64 rows

        return int(device_fingerprint(t))
    raise FormatVersionError(f"fingerprint kind {kind!r} is not one this stepdump knows ({XXH3}, {DMIX64}): the "
                             "store was written by a newer stepdump; read it with that version (pip install -U stepdump)")
