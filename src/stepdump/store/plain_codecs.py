"""The codec interface and the self-contained codecs (raw, zstd, Blosc).

A self-contained ("plain") codec stores a blob on its own; the delta codecs
(:mod:`stepdump.store.delta`) build on these for their keyframes, and
:mod:`stepdump.store.codecs` names them all in one table. Codecs are lossless;
the compressors (zstandard, numcodecs' Blosc) release the GIL, so encoding on
the writer thread does not stall training.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stepdump.errors import CorruptDataError

Bytes = bytes | bytearray | memoryview


class Codec(Protocol):
    """Encodes raw little-endian tensor bytes into stored bytes, and back.

    Attributes:
        name: Written to the catalog on every blob encoded with ``base``
            given (or, for a plain codec, on every blob): it is how a reader
            finds the codec again.
        needs_base: False for a plain codec, whose blobs are self-contained
            (``base`` is always None). True for a codec that stores a blob
            relative to a *base*, an earlier blob of the same series that the
            catalog names in the blob's ``base`` column: ``encode`` and
            ``decode`` then need the base's raw bytes.
        keyframe: The self-contained codec used for a blob that has no base
            (the start of a chain, a kind not stored as deltas); its blobs are
            stored under ``keyframe.name``. A plain codec is its own keyframe.
    """

    # Read-only properties, so that frozen dataclasses and plain attributes both qualify.
    @property
    def name(self) -> str: ...

    @property
    def needs_base(self) -> bool: ...

    @property
    def keyframe(self) -> Codec: ...

    def encode(self, raw: memoryview, itemsize: int, base: Bytes | None = None) -> bytes | memoryview:
        """The stored bytes of ``raw`` (elements of ``itemsize`` bytes), relative to ``base``
        (the base blob's raw bytes, as long as ``raw``) if the codec needs one."""
        ...

    def decode(self, data: bytes, raw_length: int, base: Bytes | None = None) -> Bytes:
        """The ``raw_length`` raw bytes stored as ``data`` (relative to ``base`` if the codec
        needs one); CorruptDataError if ``data`` cannot be what this codec wrote."""
        ...


class _Plain:
    """What every self-contained codec shares: no base, and it is its own keyframe codec."""

    needs_base = False

    @property
    def keyframe(self) -> Codec:
        return self  # type: ignore[return-value]


@dataclass(frozen=True)
class RawCodec(_Plain):
    name: str = "raw"

    def encode(self, raw: memoryview, itemsize: int, base: Bytes | None = None) -> memoryview:
        return raw

    def decode(self, data: bytes, raw_length: int, base: Bytes | None = None) -> bytes:
        return data


class ZstdCodec(_Plain):
    """zstandard at a low level: fast enough for every step, ~1.1-1.3x on floats."""

    def __init__(self, level: int = 1) -> None:
        import zstandard

        self.name = "zstd" if level == 1 else f"zstd{level}"
        self._level = level
        self._zstd = zstandard
        # zstandard contexts are not thread-safe; one per thread.
        self._local = threading.local()

    def _ctx(self) -> tuple[object, object]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = (self._zstd.ZstdCompressor(level=self._level), self._zstd.ZstdDecompressor())
            self._local.ctx = ctx
        return ctx

    def encode(self, raw: memoryview, itemsize: int, base: Bytes | None = None) -> bytes:
        return self._ctx()[0].compress(raw)  # type: ignore[attr-defined]

    def decode(self, data: bytes, raw_length: int, base: Bytes | None = None) -> bytes:
        try:
            # zstandard allocates what the frame header says, whatever max_output_size
            # is: check the header's claim before anything is allocated.
            size = self._zstd.frame_content_size(data)
            if size not in (-1, raw_length):
                raise CorruptDataError(f"zstd frame says it holds {size} bytes, the catalog says {raw_length}")
            if size == -1:  # no size in the header: decompress would allocate raw_length up front
                return _bounded_read(self._ctx()[1].stream_reader(data), raw_length)  # type: ignore[attr-defined]
            return self._ctx()[1].decompress(data, max_output_size=raw_length)  # type: ignore[attr-defined]
        except self._zstd.ZstdError as e:
            raise CorruptDataError(f"zstd could not decode a blob: {e}") from e


class BloscCodec(_Plain):
    """Blosc with byte shuffle then zstd or lz4: shuffling groups exponent bytes,
    which is what makes float tensors compress at all."""

    def __init__(self, cname: str = "zstd", clevel: int = 1, shuffle: str = "byte") -> None:
        from numcodecs import Blosc

        shuf = {"byte": Blosc.SHUFFLE, "bit": Blosc.BITSHUFFLE, "none": Blosc.NOSHUFFLE}[shuffle]
        self.name = f"blosc-{cname}" + ("" if shuffle == "byte" else f"-{shuffle}")
        self._blosc = Blosc
        self._args = dict(cname=cname, clevel=clevel, shuffle=shuf)
        self._cache: dict[int, object] = {}

    def encode(self, raw: memoryview, itemsize: int, base: Bytes | None = None) -> bytes:
        codec = self._cache.get(itemsize)
        if codec is None:
            codec = self._blosc(blocksize=0, typesize=itemsize, **self._args)  # type: ignore[call-arg]
            self._cache[itemsize] = codec
        return codec.encode(np.frombuffer(raw, dtype=np.uint8))  # type: ignore[attr-defined]

    def decode(self, data: bytes, raw_length: int, base: Bytes | None = None) -> bytes:
        if raw_length == 0:  # blosc encodes b"" but refuses to decode its own output
            return b""
        check_blosc_header(data, raw_length)
        try:
            out = self._blosc().decode(data)
        except Exception as e:  # numcodecs raises RuntimeError on bad input
            raise CorruptDataError(f"blosc could not decode a blob: {e}") from e
        return bytes(out)


def _bounded_read(reader: object, raw_length: int) -> bytes:
    """Read at most raw_length + 1 bytes, in chunks, so memory follows what really decodes."""
    chunks, total = [], 0
    while total <= raw_length:
        chunk = reader.read(min(1 << 24, raw_length + 1 - total))  # type: ignore[attr-defined]
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def check_blosc_header(data: bytes, raw_length: int) -> None:
    """Check a Blosc 1 chunk's 16-byte header against what the catalog expects.

    c-blosc trusts the sizes in the header (it is given no buffer length), so a
    damaged or hostile chunk could make it read past the buffer or allocate
    whatever ``nbytes`` claims; refusing mismatches first keeps both in bounds.
    """
    if len(data) < 16:
        raise CorruptDataError(f"a blosc blob of {len(data)} bytes is shorter than a blosc header")
    version, _versionlz, flags, typesize, nbytes, blocksize, cbytes = struct.unpack("<BBBBIII", data[:16])
    problems = []
    if version not in (1, 2):
        problems.append(f"format version {version}")
    if nbytes != raw_length:
        problems.append(f"{nbytes} decoded bytes where the catalog says {raw_length}")
    if cbytes != len(data):
        problems.append(f"{cbytes} stored bytes where the blob has {len(data)}")
    if typesize == 0 or blocksize == 0:
        problems.append(f"typesize {typesize}, blocksize {blocksize}")
    if flags & 0x2 and cbytes != nbytes + 16:  # BLOSC_MEMCPYED: header then the bytes as they are
        problems.append("a stored-as-is chunk whose sizes disagree")
    if problems:
        raise CorruptDataError("blosc blob header is inconsistent: " + "; ".join(problems))
