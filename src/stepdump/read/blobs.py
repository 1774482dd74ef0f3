"""Loading one blob: read its bytes, check its checksum, decode, build a tensor.

Every check here runs before memory is allocated for a tensor, so a hostile or
damaged catalog cannot make the reader allocate absurd sizes or read outside
the run directory.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import torch

from stepdump.capture.stats import fingerprint_bytes
from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.catalog import BlobRow
from stepdump.store.codecs import get_codec
from stepdump.store.format import DTYPES, parse_shape
from stepdump.store.storage import LocalStorage

# Refuse blobs whose catalog entry claims more than this; a real tensor this
# large would not fit a segment anyway.
MAX_BLOB_BYTES = 1 << 40


class BlobReader:
    def __init__(self, run_dir: Path, con: sqlite3.Connection) -> None:
        self.storage = LocalStorage(run_dir)
        self.con = con

    def blob_row(self, blob_id: int) -> BlobRow:
        row = self.con.execute(
            "SELECT b.id, s.key, b.offset, b.length, b.codec, b.raw_length, b.checksum, b.base "
            "FROM blobs b JOIN segments s ON s.id = b.segment WHERE b.id = ?",
            (blob_id,),
        ).fetchone()
        if row is None:
            raise CorruptDataError(f"the catalog points at blob {blob_id}, which it does not list")
        return BlobRow(*row)

    def raw(self, blob_id: int) -> bytes | bytearray | memoryview:
        """The decoded (raw tensor) bytes of a blob, checksum verified."""
        b = self.blob_row(blob_id)
        if not (0 <= b.length <= MAX_BLOB_BYTES and 0 <= b.raw_length <= MAX_BLOB_BYTES and b.offset >= 0):
            raise CorruptDataError(f"blob {blob_id} has impossible sizes in the catalog (length {b.length})")
        data = self.storage.read(b.segment_key, b.offset, b.length)
        if fingerprint_bytes(data) != b.checksum:
            raise CorruptDataError(
                f"blob {blob_id} in {b.segment_key} (offset {b.offset}) fails its checksum: the segment file is "
                "damaged. `stepdump verify` lists every damaged blob."
            )
        try:
            codec = get_codec(b.codec)
        except ConfigError:
            raise CorruptDataError(f"blob {blob_id} uses codec {b.codec!r}, which this stepdump does not know") from None
        out = codec.decode(data, b.raw_length)
        if len(out) != b.raw_length:
            raise CorruptDataError(f"blob {blob_id} decodes to {len(out)} bytes, expected {b.raw_length}")
        return out

    def tensor(self, blob_id: int, dtype: str, shape: str) -> torch.Tensor:
        tdtype = DTYPES.get(dtype)
        if tdtype is None:
            raise CorruptDataError(f"unknown dtype {dtype!r} in the catalog")
        try:
            dims = parse_shape(shape)
        except ValueError:
            raise CorruptDataError(f"bad shape {shape!r} in the catalog") from None
        if any(d < 0 for d in dims):
            raise CorruptDataError(f"negative dimension in shape {shape!r}")
        itemsize = torch.empty((), dtype=tdtype).element_size()
        want = math.prod(dims) * itemsize
        b = self.blob_row(blob_id)
        if b.raw_length != want:
            raise CorruptDataError(
                f"blob {blob_id} holds {b.raw_length} bytes but a {dtype} tensor of shape {dims} needs {want}"
            )
        raw = self.raw(blob_id)
        if want == 0:
            return torch.empty(dims, dtype=tdtype)
        buf = bytearray(raw) if not isinstance(raw, bytearray) else raw
        return torch.frombuffer(buf, dtype=torch.uint8).view(tdtype).reshape(dims)

    def close(self) -> None:
        self.storage.close()
