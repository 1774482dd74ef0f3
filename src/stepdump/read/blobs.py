"""Loading one blob: read its bytes, check its checksum, decode, build a tensor.

The catalog is untrusted input (a store may come from anywhere, or be damaged).
Every check here runs before memory is allocated for a tensor, in this order:
the row's types, the dtype and the shape (and that the shape's size is
plausible), that the blob's sizes agree with the shape, that the bytes lie
inside a regular segment file of the run, their checksum, then decoding into
exactly the expected number of bytes, and finally the tensor's fingerprint.
So a hostile or damaged catalog cannot make the reader allocate absurd sizes,
read outside the run directory, or hand back wrong values without an error.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
import re
from pathlib import Path

import torch

from stepdump.capture.stats import fingerprint_bytes
from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.catalog import BlobRow, ReadConnection
from stepdump.store.codecs import get_codec
from stepdump.store.delta import MAX_DELTA_CHAIN, DeltaCodec
from stepdump.store.format import DTYPES
from stepdump.store.storage import LocalStorage

# Refuse blobs whose catalog entry claims more than this; a real tensor this
# large would not fit a segment anyway.
MAX_BLOB_BYTES = 1 << 40
# No codec here expands its input by more than this (zstd at best ~32768:1 with RLE
# blocks, Blosc 1 well under that); a blob claiming more is damaged or hostile, and
# is refused before anything of its claimed size is allocated.
MAX_EXPANSION = 1 << 16
# Decoded delta-chain blobs kept for the next read of the same series.
CACHE_BYTES = 256 << 20
_SHAPE = re.compile(r"(?:[0-9]{1,19}(?:,[0-9]{1,19})*)?")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_layout(dtype: object, shape: object) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a tensor row's dtype and shape; return (dtype, dims, bytes it needs)."""
    tdtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if tdtype is None:
        raise CorruptDataError(f"unknown dtype {dtype!r} in the catalog")
    if not isinstance(shape, str) or not _SHAPE.fullmatch(shape):
        raise CorruptDataError(f"bad shape {shape!r} in the catalog (want dimensions joined by ',')")
    dims = tuple(int(p) for p in shape.split(",")) if shape else ()
    itemsize = torch.empty((), dtype=tdtype).element_size()
    # Zero-sized dims make numel 0, but the other dims still size the strides.
    if math.prod(max(d, 1) for d in dims) * itemsize > MAX_BLOB_BYTES:
        raise CorruptDataError(f"shape {shape!r} of a {dtype} tensor is implausibly large; refusing to allocate it")
    return tdtype, dims, math.prod(dims) * itemsize


class BlobReader:
    def __init__(self, run_dir: Path, con: ReadConnection) -> None:
        self.storage = LocalStorage(run_dir)
        self.con = con
        self._cache: OrderedDict[int, bytes | memoryview] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()

    def blob_row(self, blob_id: int) -> BlobRow:
        if not _is_int(blob_id):
            raise CorruptDataError(f"the catalog points at blob {blob_id!r}, which is not a blob id")
        row = self.con.execute(
            "SELECT b.id, s.key, b.offset, b.length, b.codec, b.raw_length, b.checksum, b.base "
            "FROM blobs b JOIN segments s ON s.id = b.segment WHERE b.id = ?",
            (blob_id,),
        ).fetchone()
        if row is None:
            raise CorruptDataError(f"the catalog points at blob {blob_id}, which it does not list (or its segment)")
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
        hit = self._cached(b.id)
        if hit is not None:
            return hit
        chain = [b]
        base: bytes | bytearray | memoryview | None = None
        while chain[-1].base is not None:
            last = chain[-1]
            # Bases are written before the blobs built on them, so ids strictly
            # decrease along a chain: a damaged catalog cannot make it loop.
            if not _is_int(last.base) or not 0 < last.base < last.id:
                raise CorruptDataError(f"blob {last.id} names base {last.base!r}, which is not an earlier blob")
            base = self._cached(last.base)
            if base is not None:
                break
            if len(chain) > MAX_DELTA_CHAIN:
                raise CorruptDataError(f"blob {b.id} sits on a chain of more than {MAX_DELTA_CHAIN} delta blobs")
            chain.append(self.blob_row(last.base))
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

    def _decode(self, b: BlobRow, base: bytes | memoryview | None) -> bytes | bytearray | memoryview:
        blob_id = b.id
        try:
            codec = get_codec(b.codec)
        except ConfigError:
            raise CorruptDataError(f"blob {blob_id} uses codec {b.codec!r}, which this stepdump does not know") from None
        is_delta = isinstance(codec, DeltaCodec)
        if is_delta != (b.base is not None):
            raise CorruptDataError(
                f"blob {blob_id} uses codec {b.codec!r} " + ("but names no base blob" if is_delta else
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
        if fingerprint_bytes(data) != b.checksum:
            raise CorruptDataError(
                f"blob {blob_id} in {b.segment_key} (offset {b.offset}) fails its checksum: the segment file is "
                "damaged. `stepdump verify` lists every damaged blob."
            )
        try:
            if is_delta:
                out = codec.decode_delta(data, b.raw_length, base if base is not None else b"")  # type: ignore[attr-defined]
            else:
                out = codec.decode(data, b.raw_length)
        except MemoryError:
            raise CorruptDataError(
                f"blob {blob_id} claims to decode to {b.raw_length} bytes, more than this machine can allocate"
            ) from None
        if len(out) != b.raw_length:
            raise CorruptDataError(f"blob {blob_id} decodes to {len(out)} bytes, expected {b.raw_length}")
        return out

    def tensor(self, blob_id: int, dtype: str, shape: str, fingerprint: int | None = None) -> torch.Tensor:
        """The tensor a ``tensors`` row describes; with ``fingerprint`` (the row's), the decoded
        bytes are checked against it too, so a decoder or catalog mix-up cannot go unnoticed."""
        tdtype, dims, want = check_layout(dtype, shape)
        b = self.blob_row(blob_id)
        if b.raw_length != want:
            raise CorruptDataError(
                f"blob {blob_id} holds {b.raw_length} bytes but a {dtype} tensor of shape {dims} needs {want}"
            )
        raw = self.raw(blob_id, b)
        # For the raw codec the checksum just verified *is* the fingerprint.
        if fingerprint is not None and not (b.codec == "raw" and b.checksum == fingerprint):
            if fingerprint_bytes(raw) != fingerprint:
                raise CorruptDataError(
                    f"blob {blob_id} decodes to bytes that do not match the tensor's recorded fingerprint"
                )
        if want == 0:
            return torch.empty(dims, dtype=tdtype)
        try:
            buf = bytearray(raw) if not isinstance(raw, bytearray) else raw
        except MemoryError:
            raise CorruptDataError(f"blob {blob_id} ({want} bytes) is more than this machine can allocate") from None
        return torch.frombuffer(buf, dtype=torch.uint8).view(tdtype).reshape(dims)

    def close(self) -> None:
        self.storage.close()
