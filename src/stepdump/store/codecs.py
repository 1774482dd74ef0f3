"""Blob codecs: how tensor bytes are turned into stored bytes and back.

Every blob in the catalog names its codec, so a store can mix them and a reader
needs no configuration. Codecs are lossless. ``raw`` stores the bytes as they
are; the others use maintained libraries (zstandard, numcodecs' Blosc) whose
compressors release the GIL, so encoding on the writer thread does not stall
training.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stepdump.errors import ConfigError, CorruptDataError


class Codec(Protocol):
    """Encodes raw little-endian tensor bytes; ``name`` is written to the catalog."""

    name: str

    def encode(self, raw: memoryview, itemsize: int) -> bytes | memoryview: ...

    def decode(self, data: bytes, raw_length: int) -> bytes | bytearray | memoryview: ...


@dataclass(frozen=True)
class RawCodec:
    name: str = "raw"

    def encode(self, raw: memoryview, itemsize: int) -> memoryview:
        return raw

    def decode(self, data: bytes, raw_length: int) -> bytes:
        return data


class ZstdCodec:
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

    def encode(self, raw: memoryview, itemsize: int) -> bytes:
        return self._ctx()[0].compress(raw)  # type: ignore[attr-defined]

    def decode(self, data: bytes, raw_length: int) -> bytes:
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


class BloscCodec:
    """Blosc with byte shuffle then zstd or lz4: shuffling groups exponent bytes,
    which is what makes float tensors compress at all."""

    def __init__(self, cname: str = "zstd", clevel: int = 1, shuffle: str = "byte") -> None:
        from numcodecs import Blosc

        shuf = {"byte": Blosc.SHUFFLE, "bit": Blosc.BITSHUFFLE, "none": Blosc.NOSHUFFLE}[shuffle]
        self.name = f"blosc-{cname}" + ("" if shuffle == "byte" else f"-{shuffle}")
        self._blosc = Blosc
        self._args = dict(cname=cname, clevel=clevel, shuffle=shuf)
        self._cache: dict[int, object] = {}

    def encode(self, raw: memoryview, itemsize: int) -> bytes:
        codec = self._cache.get(itemsize)
        if codec is None:
            codec = self._blosc(blocksize=0, typesize=itemsize, **self._args)  # type: ignore[call-arg]
            self._cache[itemsize] = codec
        return codec.encode(np.frombuffer(raw, dtype=np.uint8))  # type: ignore[attr-defined]

    def decode(self, data: bytes, raw_length: int) -> bytes:
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


def _registry() -> dict[str, object]:
    return {
        "raw": RawCodec,
        "zstd": lambda: ZstdCodec(1),
        "zstd3": lambda: ZstdCodec(3),
        "blosc-zstd": lambda: BloscCodec("zstd", 1, "byte"),
        "blosc-lz4": lambda: BloscCodec("lz4", 1, "byte"),
        "blosc-zstd-bit": lambda: BloscCodec("zstd", 1, "bit"),
        "blosc-lz4-bit": lambda: BloscCodec("lz4", 1, "bit"),
        # Delta codecs (stepdump.store.delta) need a base blob; their keyframes use
        # the plain bit-shuffled Blosc codec of the same compressor.
        "delta-lz4": lambda: _delta("lz4"),
        "delta-zstd": lambda: _delta("zstd"),
    }


def _delta(cname: str) -> object:
    from stepdump.store.delta import DeltaCodec  # imports this module

    return DeltaCodec(cname)


CODEC_NAMES = tuple(_registry())
_instances: dict[str, Codec] = {}
_lock = threading.Lock()


def get_codec(name: str) -> Codec:
    """Return the codec called ``name`` (as written in the catalog)."""
    with _lock:
        codec = _instances.get(name)
        if codec is None:
            factory = _registry().get(name)
            if factory is None:
                raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
            codec = factory()  # type: ignore[operator]
            _instances[name] = codec  # type: ignore[assignment]
        return codec
