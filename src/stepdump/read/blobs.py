"""Loading one blob: read its bytes, check its checksum, decode, build a tensor.

The catalog is untrusted input (a store may come from anywhere, or be damaged).
Every check here runs before memory is allocated for a tensor, in this order:
the row's types, the dtype and the shape (and that the shape's size is
plausible), that the blob's sizes agree with the shape, that the bytes lie
inside a regular segment file of the run, their checksum, then decoding into
exactly the expected number of bytes, and finally the tensor's fingerprint.
So a hostile or damaged catalog cannot make the reader allocate absurd sizes,
read outside the run directory, or hand back wrong values without an error.

Each read call (``Run.tensor``, ``tensors``, ``step_state``, ``state_dict``...)
also runs in a :class:`ReadScope` that bounds what the catalog can make it cost
beyond the per-blob checks: a blob that several rows point at is decoded once per
call (its tensors share memory), and the bytes decoded, delta-chain bases
included, are bounded by what the call returns (docs/reliability.md, "Resource
bounds per read").
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepdump.core.dtypes import DTYPES
from stepdump.core.hashing import XXH3, fingerprint_bytes, fingerprint_bytes_as
from stepdump.core.sparse import from_raw_bytes
from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.codecs import get_codec
from stepdump.store.delta import MAX_DELTA_CHAIN
from stepdump.store.format import SPARSE_COO_HEADER_BYTES, parse_shape, sparse_values_dtype
from stepdump.store.queries import CatalogReader
from stepdump.store.schema import BlobRow
from stepdump.store.storage import LocalStorage, ReadStorage

# Refuse blobs whose catalog entry claims more than this; a real tensor this
# large would not fit a segment anyway.
MAX_BLOB_BYTES = 1 << 40
# No codec here expands its input by more than this (zstd at best ~32768:1 with RLE
# blocks, Blosc 1 well under that); a blob claiming more is damaged or hostile, and
# is refused before anything of its claimed size is allocated.
MAX_EXPANSION = 1 << 16
# Decoded delta-chain blobs kept for the next read of the same series.
CACHE_BYTES = 256 << 20
# A read call decodes at most this many bytes per byte it returns, plus the
# allowance below. A cold read of a delta blob decodes its whole chain; writers
# keep chains at 8 blobs by default, so an honest read stays far below 16x. Without
# this, a 4,096-link chain of 64 MiB blobs (a few hundred KB of catalog rows) cost
# 256 GiB of decoding, 858 s, for one tensor.
DECODE_FACTOR = 16
# ... plus this many bytes whatever the call returns (small tensors on long chains).
DECODE_ALLOWANCE = 1 << 30
# Environment variable that sets the allowance, in bytes, for stores you trust.
BUDGET_ENV = "STEPDUMP_DECODE_BUDGET"
_SHAPE = re.compile(r"(?:[0-9]{1,19}(?:,[0-9]{1,19})*)?")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_layout(dtype: object, shape: object) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a tensor row's dtype and shape; return (dtype, dims, bytes it needs)."""
    if isinstance(dtype, str) and isinstance(shape, str) and len(shape) <= 200:
        # The same few layouts come back row after row (a gradient log: every grad of every update).
        return _layout(dtype, shape)
    return _check_layout(dtype, shape)


def _check_layout(dtype: object, shape: object) -> tuple[torch.dtype, tuple[int, ...], int]:
    tdtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if tdtype is None:
        raise CorruptDataError(f"unknown dtype {dtype!r} in the catalog")
    if not isinstance(shape, str) or not _SHAPE.fullmatch(shape):
        raise CorruptDataError(f"bad shape {shape!r} in the catalog (want dimensions joined by ',')")
    dims = parse_shape(shape)
    itemsize = torch.empty((), dtype=tdtype).element_size()
    # Zero-sized dims make numel 0, but the other dims still size the strides.
    if math.prod(max(d, 1) for d in dims) * itemsize > MAX_BLOB_BYTES:
        raise CorruptDataError(f"shape {shape!r} of a {dtype} tensor is implausibly large; refusing to allocate it")
    return tdtype, dims, math.prod(dims) * itemsize


_layout = functools.lru_cache(maxsize=1024)(_check_layout)  # a bad row raises, and is not cached


def _human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} bytes"


def decode_allowance() -> int:
    """The fixed part of a read call's decode budget: ``$STEPDUMP_DECODE_BUDGET`` bytes, else 1 GiB."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return DECODE_ALLOWANCE
    try:
        value = int(float(text))  # "4e9" as well as "4000000000"
    except (ValueError, OverflowError):
        raise ConfigError(f"{BUDGET_ENV}={text!r} is not a number of bytes") from None
    if value < 0:
        raise ConfigError(f"{BUDGET_ENV}={text!r} is negative; give a number of bytes")
    return value


class ReadScope:
    """What one read call has cost so far, and the blobs it has decoded.

    ``returned`` counts each distinct stored blob the call hands out once;
    ``decoded`` counts every byte a codec produced for it, delta-chain bases
    included. ``shared`` maps a blob's stored identity to its decoded buffer, so a
    blob that many tensor rows point at (which no writer produces, but a catalog
    can claim) costs its size once per call instead of once per row.
    """

    __slots__ = ("allowance", "decoded", "returned", "shared", "verified")

    def __init__(self, allowance: int) -> None:
        self.allowance = allowance
        self.decoded = 0
        self.returned = 0
        self.shared: dict[tuple[object, ...], bytearray | bytes] = {}
        self.verified: set[tuple[tuple[object, ...], int, str]] = set()

    def check(self, blob_id: int, links: int, decode: int, returns: int) -> None:
        """Refuse, before any of it is done, decoding ``decode`` more bytes (``links`` blobs)
        to return ``returns`` more bytes, if that goes over the call's budget."""
        limit = DECODE_FACTOR * (self.returned + returns) + self.allowance
        if self.decoded + decode > limit:
            raise CorruptDataError(
                f"reading blob {blob_id} means decoding a chain of {links}+ delta blobs: the read would decode "
                f"{_human(self.decoded + decode)} to return {_human(self.returned + returns)}, over its decode "
                f"budget of {_human(limit)} ({DECODE_FACTOR} x what it returns + {_human(self.allowance)}). The "
                f"store is damaged or hostile, or was recorded with a very long delta_chain; if you trust it, "
                f"raise the allowance: {BUDGET_ENV}=<bytes> (now {self.allowance})."
            )


class BlobReader:
    """Blobs of one store: catalog rows from ``con``, segment bytes from ``storage``
    (default: the files under ``run_dir``). :meth:`close` closes the storage."""

    def __init__(self, run_dir: Path, con: CatalogReader, storage: ReadStorage | None = None) -> None:
        self.storage: ReadStorage = storage if storage is not None else LocalStorage(run_dir)
        self.con = con
        self._cache: OrderedDict[int, bytes | memoryview] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()
        self._local = threading.local()  # the ReadScope of the call each thread is in

    @contextmanager
    def call(self) -> Iterator[ReadScope]:
        """The scope of one read call; calls made inside it (``step_state`` inside
        ``optimizer_state_dict``) share it. Its decoded blobs are dropped at the end."""
        scope = getattr(self._local, "scope", None)
        if scope is not None:
            yield scope
            return
        scope = self._local.scope = ReadScope(decode_allowance())
        try:
            yield scope
        finally:
            self._local.scope = None

    def blob_row(self, blob_id: int) -> BlobRow:
        if not _is_int(blob_id):
            raise CorruptDataError(f"the catalog points at blob {blob_id!r}, which is not a blob id")
        row = self.con.blob_row(blob_id)
        if row is None:
            raise CorruptDataError(f"the catalog points at blob {blob_id}, which it does not list (or its segment)")
        return self._checked_row(blob_id, row)

    def blob_rows_of(self, kind: str, first: int, last: int) -> dict[int, BlobRow]:
        """:meth:`blob_row` of every blob a ``kind`` tensor at steps ``first..last`` points at, in
        one query (a gradient log's rebuild: the grads of a window of updates); a malformed row is
        left out, for :meth:`blob_row` to refuse when it is read."""
        out: dict[int, BlobRow] = {}
        for row in self.con.blob_rows_of(kind, first, last):
            blob_id, *_ = row  # BlobRow's fields, the id first
            try:
                if _is_int(blob_id):
                    out[blob_id] = self._checked_row(blob_id, row)
            except CorruptDataError:
                continue
        return out

    @staticmethod
    def _checked_row(blob_id: int, row: tuple[Any, ...]) -> BlobRow:
        b = BlobRow(*row)
        if not isinstance(b.segment_key, str) or not isinstance(b.codec, str) or not all(
            _is_int(v) for v in (b.offset, b.length, b.raw_length, b.checksum)
        ):
            raise CorruptDataError(f"blob {blob_id} has a malformed catalog row: {row!r}")
        if not (0 <= b.length <= MAX_BLOB_BYTES and 0 <= b.raw_length <= MAX_BLOB_BYTES and b.offset >= 0):
            raise CorruptDataError(
                f"blob {blob_id} has impossible sizes in the catalog (offset {b.offset}, length {b.length}, "
                f"raw length {b.raw_length})"
            )
        return b

    def raw(self, blob_id: int, b: BlobRow | None = None) -> bytes | bytearray | memoryview:
        """The decoded (raw tensor) bytes of a blob, checksum verified; a delta blob's
        chain of bases is decoded first (recently decoded bases are cached)."""
        b = b or self.blob_row(blob_id)
        with self.call() as scope:
            return self._raw(b, scope)

    def _raw(self, b: BlobRow, scope: ReadScope) -> bytes | bytearray | memoryview:
        hit = self._cached(b.id)
        if hit is not None:
            scope.returned += b.raw_length
            return hit
        chain = [b]
        work = b.raw_length  # what decoding the chain found so far costs, checked as it grows
        base: bytes | bytearray | memoryview | None = None
        while chain[-1].base is not None:
            last, base_id = chain[-1], chain[-1].base
            # Bases are written before the blobs built on them, so ids strictly
            # decrease along a chain: a damaged catalog cannot make it loop.
            if not isinstance(base_id, int) or isinstance(base_id, bool) or not 0 < base_id < last.id:
                raise CorruptDataError(f"blob {last.id} names base {base_id!r}, which is not an earlier blob")
            base = self._cached(base_id)
            if base is not None:
                break
            if len(chain) > MAX_DELTA_CHAIN:
                raise CorruptDataError(f"blob {b.id} sits on a chain of more than {MAX_DELTA_CHAIN} delta blobs")
            chain.append(self.blob_row(base_id))
            work += chain[-1].raw_length
            scope.check(b.id, len(chain), work, b.raw_length)  # before decoding any of it
        scope.decoded += work
        scope.returned += b.raw_length
        for i, row in enumerate(reversed(chain)):
            try:
                base = self._decode(row, base)
            except CorruptDataError as e:
                if row is b:
                    raise
                raise CorruptDataError(f"blob {b.id} is stored as a delta on blob {row.id}, which is damaged: {e}") from e
            if row.base is not None or i < len(chain) - 1:  # part of a delta chain: likely needed again
                base = self._remember(row.id, base)
        return base  # type: ignore[return-value]

    def _cached(self, blob_id: int) -> bytes | memoryview | None:
        with self._cache_lock:
            hit = self._cache.get(blob_id)
            if hit is not None:
                self._cache.move_to_end(blob_id)
            return hit

    def _remember(self, blob_id: int, raw: bytes | bytearray | memoryview) -> bytes | memoryview:
        # Immutable, so tensors handed out never share the cache's memory (tensor() copies).
        data = raw if isinstance(raw, bytes) or (isinstance(raw, memoryview) and raw.readonly) else bytes(raw)
        if len(data) <= CACHE_BYTES:
            with self._cache_lock:  # a Run may be read from several threads
                old = self._cache.pop(blob_id, None)
                if old is not None:
                    self._cache_bytes -= len(old)
                self._cache[blob_id] = data
                self._cache_bytes += len(data)
                while self._cache_bytes > CACHE_BYTES and self._cache:
                    self._cache_bytes -= len(self._cache.popitem(last=False)[1])
        return data

    def _decode(self, b: BlobRow, base: bytes | bytearray | memoryview | None) -> bytes | bytearray | memoryview:
        blob_id = b.id
        try:
            codec = get_codec(b.codec)
        except ConfigError:
            raise CorruptDataError(f"blob {blob_id} uses codec {b.codec!r}, which this stepdump does not know") from None
        if codec.needs_base != (b.base is not None):
            raise CorruptDataError(
                f"blob {blob_id} uses codec {b.codec!r} " + ("but names no base blob" if codec.needs_base else
                                                             f"yet names base blob {b.base}: the catalog is damaged")
            )
        if codec.name == "raw" and b.length != b.raw_length:
            raise CorruptDataError(f"blob {blob_id} is stored raw but its lengths differ ({b.length} != {b.raw_length})")
        if b.raw_length > b.length * MAX_EXPANSION + 4096:
            raise CorruptDataError(
                f"blob {blob_id} claims {b.raw_length} bytes decoded from {b.length} stored, more than {b.codec} "
                "can expand; the catalog is damaged"
            )
        data = self.storage.read(b.segment_key, b.offset, b.length)
        intact = fingerprint_bytes(data) == b.checksum
        if not intact:
            # A URL's range cache may hold bytes of another run (or a damaged cache file):
            # ask the object itself once more before calling the segment damaged.
            again = self.storage.refetch(b.segment_key, b.offset, b.length)
            if again is not None:
                data = again
                intact = fingerprint_bytes(data) == b.checksum
        if not intact:
            raise CorruptDataError(
                f"blob {blob_id} in {b.segment_key} (offset {b.offset}) fails its checksum: the segment file is "
                "damaged. `stepdump verify` lists every damaged blob."
            )
        try:
            # ``base`` is the base blob's raw bytes for a codec that needs one (the chain
            # is decoded from its keyframe up), None otherwise.
            out = codec.decode(data, b.raw_length, base if codec.needs_base else None)
        except MemoryError:
            raise CorruptDataError(
                f"blob {blob_id} claims to decode to {b.raw_length} bytes, more than this machine can allocate"
            ) from None
        if len(out) != b.raw_length:
            raise CorruptDataError(f"blob {blob_id} decodes to {len(out)} bytes, expected {b.raw_length}")
        return out

    def tensor(self, blob_id: int, dtype: str, shape: str, fingerprint: int | None = None,
               fp_kind: str = XXH3) -> torch.Tensor:
        """The tensor a ``tensors`` row describes; with ``fingerprint`` (the row's, of kind
        ``fp_kind``: its series'), the decoded bytes are checked against it too, so a decoder or
        catalog mix-up cannot go unnoticed."""
        if isinstance(dtype, str) and sparse_values_dtype(dtype) is not None:
            return self.sparse_tensor(blob_id, dtype, shape, fingerprint, fp_kind)
        tdtype, dims, want = check_layout(dtype, shape)
        b = self.blob_row(blob_id)
        if b.raw_length != want:
            raise CorruptDataError(
                f"blob {blob_id} holds {b.raw_length} bytes but a {dtype} tensor of shape {dims} needs {want}"
            )
        # Rows naming the same stored bytes decode to the same bytes: decode them once per call
        # and let their tensors share the buffer, so aliasing cannot multiply a call's memory.
        key = (b.segment_key, b.offset, b.length, b.codec, b.raw_length, b.checksum, b.base)
        with self.call() as scope:
            buf = scope.shared.get(key)
            if buf is None:
                raw = self._raw(b, scope)
                self._check_fingerprint(b, raw, fingerprint, fp_kind)
                try:
                    buf = bytearray(raw) if not isinstance(raw, bytearray) else raw
                except MemoryError:
                    raise CorruptDataError(
                        f"blob {blob_id} ({want} bytes) is more than this machine can allocate"
                    ) from None
                scope.shared[key] = buf
            elif fingerprint is not None and (key, fingerprint, fp_kind) not in scope.verified:
                self._check_fingerprint(b, buf, fingerprint, fp_kind)
            if fingerprint is not None:
                scope.verified.add((key, fingerprint, fp_kind))
        if want == 0:
            return torch.empty(dims, dtype=tdtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(tdtype).reshape(dims)

    def sparse_tensor(self, blob_id: int, dtype: str, shape: str, fingerprint: int | None = None,
                      fp_kind: str = XXH3) -> torch.Tensor:
        """The sparse COO tensor a ``tensors`` row of dtype ``sparse_coo:<dtype>`` describes
        (FORMAT.md, "Sparse tensors"), in memory of its own: checked as :meth:`tensor` checks a
        dense one (the dense size as well), then its header against its bytes and its indices
        against its size (:func:`~stepdump.core.sparse.from_raw_bytes`)."""
        values = sparse_values_dtype(dtype)
        tdtype, dims, _ = check_layout(values, shape)
        b = self.blob_row(blob_id)
        if b.raw_length < SPARSE_COO_HEADER_BYTES:
            raise CorruptDataError(f"blob {blob_id} holds {b.raw_length} bytes, too few for a sparse tensor")
        with self.call() as scope:
            raw = self._raw(b, scope)
            self._check_fingerprint(b, raw, fingerprint, fp_kind)
        try:
            return from_raw_bytes(raw, tdtype, dims)
        except CorruptDataError as e:
            raise CorruptDataError(f"blob {blob_id}: {e}") from None

    def read_into(self, out: torch.Tensor, blob_id: int, dtype: str, shape: str,
                  fingerprint: int | None = None, fp_kind: str = XXH3) -> torch.Tensor:
        """Read the tensor a ``tensors`` row describes into ``out`` (a contiguous CPU tensor of the
        row's dtype and shape), checked as :meth:`tensor` checks it; returns ``out``.

        For memory reused read after read (a gradient log's grads: one buffer per param for a
        whole chain of updates). :meth:`tensor` hands out a fresh buffer per blob and keeps it in
        the call's scope until the call ends, so a call that reads a thousand grads would hold
        them all; here nothing outlives the read, and the copy lands in memory already paged in
        (a fresh 4 MiB buffer costs more in page faults than the copy itself).
        """
        tdtype, dims, want = check_layout(dtype, shape)
        if out.dtype != tdtype or tuple(out.shape) != dims or out.device.type != "cpu" or not out.is_contiguous():
            raise CorruptDataError(f"blob {blob_id} holds a {dtype} tensor of shape {dims}, which does not fit the "
                                   f"{out.dtype} {tuple(out.shape)} tensor it is read into")
        b = self.blob_row(blob_id)
        if b.raw_length != want:
            raise CorruptDataError(
                f"blob {blob_id} holds {b.raw_length} bytes but a {dtype} tensor of shape {dims} needs {want}"
            )
        if want == 0:
            return out
        # A uint8 view of ``out`` takes any dtype (bfloat16 too).
        dst = out.detach().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(dst)  # type: ignore[arg-type]  # numpy arrays are buffers
        direct = getattr(self.storage, "read_into", None)
        with self.call() as scope:
            if direct is not None and b.codec == "raw" and b.base is None and b.length == b.raw_length:
                # Stored as is: straight from the file into ``out``, then the checksum of what landed there.
                direct(b.segment_key, b.offset, view)
                if fingerprint_bytes(view) == b.checksum:
                    scope.returned += want
                    self._check_fingerprint(b, view, fingerprint, fp_kind)
                    return out
                # Damaged, or read while a URL's cache was wrong: the usual path says which.
            raw = self._raw(b, scope)
            self._check_fingerprint(b, raw, fingerprint, fp_kind)
        dst[:] = np.frombuffer(raw, dtype=np.uint8)
        return out

    def read_ahead(self, out: torch.Tensor, b: BlobRow, fingerprint: int | None, fp_kind: str = XXH3) -> bool:
        """Fill ``out`` with blob ``b`` (its row already read) and verify it: the checksum, then the
        tensor's ``fingerprint``. Safe on another thread than the reading one, while it goes on:
        only the segment file and ``out`` are touched (no catalog, cache or read-call scope), and
        the file read and the hashing let go of the GIL. For a blob stored on its own (no delta
        base) in a store with :meth:`~stepdump.store.storage.LocalStorage.read_into` (pread);
        ``out`` must be contiguous, on the CPU and exactly the blob's size.

        True when ``out`` holds the verified bytes. False, never an error, for anything else:
        damaged bytes, a missing file, a blob on a delta base. The reading thread then reads the
        blob with :meth:`read_into`, which raises the error that says what is wrong, so a
        failure on this thread reaches the caller exactly as it would without it.
        """
        direct = getattr(self.storage, "read_into", None)
        if (direct is None or b.base is not None or out.device.type != "cpu" or not out.is_contiguous()
                or out.numel() * out.element_size() != b.raw_length):
            return False
        try:
            view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            if b.codec == "raw" and b.length == b.raw_length:
                direct(b.segment_key, b.offset, view)
                if fingerprint_bytes(view) != b.checksum:
                    return False
                raw: bytes | bytearray | memoryview = view
            else:
                raw = self._decode(b, None)  # a base-less codec: no catalog (zstd, ... let go of the GIL too)
                view[:] = raw
            self._check_fingerprint(b, raw, fingerprint, fp_kind)
        except Exception:  # noqa: BLE001 - read_into on the reading thread reports it
            return False
        return True

    @staticmethod
    def _check_fingerprint(b: BlobRow, raw: bytes | bytearray | memoryview, fingerprint: int | None,
                           fp_kind: str = XXH3) -> None:
        if fingerprint is None:
            return
        if fp_kind == XXH3:
            # For the raw codec the checksum just verified *is* the xxh3 fingerprint.
            shortcut = b.codec == "raw" and b.checksum == fingerprint
            if not shortcut and fingerprint_bytes(memoryview(raw)) != fingerprint:
                raise CorruptDataError(
                    f"blob {b.id} decodes to bytes that do not match the tensor's recorded fingerprint"
                )
        elif fingerprint_bytes_as(fp_kind, raw) != fingerprint:  # the checksum is xxh3: no shortcut
            raise CorruptDataError(
                f"blob {b.id} decodes to bytes that do not match the tensor's recorded fingerprint ({fp_kind})"
            )

    def close(self) -> None:
        self.storage.close()
