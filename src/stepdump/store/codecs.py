"""Blob codecs: how tensor bytes are turned into stored bytes and back.

Every blob in the catalog names its codec, so a store can mix them and a reader
needs no configuration. Codecs are lossless. ``raw`` stores the bytes as they
are; the others use maintained libraries (zstandard, numcodecs' Blosc) whose
compressors release the GIL, so encoding on the writer thread does not stall
training.

Plain and delta codecs share one interface (:class:`~stepdump.store.plain_codecs.Codec`): a
delta codec says so with ``needs_base`` and takes its base blob's raw bytes as an argument;
the writer (:class:`SeriesEncoder`) and the reader treat every codec alike. The codecs
themselves live below this table: :mod:`stepdump.store.plain_codecs` (raw, zstd, Blosc) and
:mod:`stepdump.store.delta` (delta-lz4, delta-zstd, keyframes from the plain Blosc codec).
"""

from __future__ import annotations

import threading

import numpy as np

from stepdump.errors import ConfigError
from stepdump.store.delta import DeltaCodec
from stepdump.store.plain_codecs import BloscCodec, Codec, RawCodec, ZstdCodec


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
        "delta-lz4": lambda: DeltaCodec("lz4"),
        "delta-zstd": lambda: DeltaCodec("zstd"),
    }


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


class _Last:
    """What the writer keeps of a series' last blob: its raw bytes, id and chain position."""

    __slots__ = ("raw", "blob", "itemsize", "links")

    def __init__(self, raw: bytearray, blob: int, itemsize: int, links: int) -> None:
        self.raw = raw
        self.blob = blob
        self.itemsize = itemsize
        self.links = links


class SeriesEncoder:
    """The writer's side of a codec: which base each new blob is relative to, then encoding it.

    A blob of a series (a tensor recorded step after step) is encoded against the
    series' previous blob when the codec needs a base, and self-contained (with
    ``codec.keyframe``) at the start of a chain, every ``chain`` blobs, when the
    size or element width changed, and for blobs that belong to no series. For a
    plain codec every blob is its own keyframe and nothing is kept.

    For a codec that needs a base, a copy of each series' last raw bytes is kept
    (one record's worth of memory), because the staging buffer it came from is
    reused for the next step. Chains start afresh in every writer session (a
    resumed run begins with keyframes), so a base is always a blob this session
    wrote and committed earlier, or in the same transaction.
    """

    def __init__(self, codec: Codec, chain: int) -> None:
        self.codec = codec
        self.chain = chain
        self._last: dict[int, _Last] = {}

    def encode(self, series: int | None, blob_id: int, raw: memoryview,
               itemsize: int) -> tuple[bytes | memoryview, int | None, str]:
        """Encode ``raw``, the blob ``blob_id`` (of ``series``, None: of no chain); return
        (stored bytes, base blob id or None, codec name for the catalog)."""
        if not self.codec.needs_base or series is None:
            plain = self.codec.keyframe
            return plain.encode(raw, itemsize), None, plain.name
        last = self._last.get(series)
        n = len(raw)
        if last is not None and len(last.raw) == n and last.itemsize == itemsize and last.links + 1 < self.chain \
                and n:
            out, base, name, links = self.codec.encode(raw, itemsize, last.raw), last.blob, self.codec.name, \
                last.links + 1
        else:
            plain = self.codec.keyframe
            out, base, name, links = plain.encode(raw, itemsize), None, plain.name, 0
        buf = last.raw if last is not None and len(last.raw) == n else bytearray(n)
        if n:
            np.copyto(np.frombuffer(buf, dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
        self._last[series] = _Last(buf, blob_id, itemsize, links)
        return out, base, name

    def forget(self) -> None:
        """After a failed step: its blobs were never committed, so nothing may build on them."""
        self._last.clear()
