"""Stats as columns: the stats-only rows of one commit as one compressed, checksummed chunk.

A lean step has a stats row per tensor and no bytes. As catalog rows those cost the writer a
B-tree insert per tensor per step (two: the key and the by-step index) and every reader a
Python tuple per value. Here the rows of one commit window (every stats-only row the writer
commits at once, FORMAT.md "Stat chunks") are one chunk: each column a little-endian numpy array
compressed on its own with zstd, so a reader that wants the norms decompresses the series, step
and norm columns and no other. The catalog holds the chunk in ``stat_chunks`` with its step
range, its row count and the xxh3-64 of its bytes; it commits in the same transaction as the
steps it describes, so a crash loses what it always lost (the window not committed yet).

Layout of a chunk (``data``)::

    b"SDS1" | u32 header length | header (JSON) | column bytes ...

The header: ``{"rows": n, "columns": {name: [offset, length], ...}, "dtypes": [...],
"shapes": [...]}``; offsets count from the end of the header. Column dtypes are fixed by
name (:data:`COLUMNS`), never read from the chunk. ``dtype`` and ``shape`` are indices into
the header's two lists. NULL (what SQLite holds for "nothing to describe") is NaN in the float
columns and -1 in the count columns (counts are never negative).

Torch-free: numpy, zstandard and xxhash only. Every decode is bounded: the header's size, each
column's decompressed size (exactly ``rows`` values, never more) and the codes' ranges are
checked, and damage raises :class:`~stepdump.errors.CorruptDataError` naming the chunk.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import xxhash
import zstandard

from stepdump.errors import CorruptDataError
from stepdump.store import bounded_json
from stepdump.store.schema import STAT_COLUMNS

MAGIC = b"SDS1"
_HEAD = struct.Struct("<4sI")
#: The largest header a reader decodes (the dtype and shape lists of one commit window).
MAX_HEADER = 1 << 24
#: The most rows one chunk may claim (a reader allocates rows x 8 bytes per column it reads).
MAX_ROWS = 1 << 26
_LEVEL = 1  # zstd level: stats compress well at 1, and the writer thread pays for it

# Column name -> numpy dtype. The count stats hold -1 for NULL, the float stats NaN.
COUNT_STATS = ("numel", "nan", "posinf", "neginf")
FLOAT_STATS = tuple(c for c in STAT_COLUMNS if c not in COUNT_STATS)
COLUMNS: dict[str, str] = {"series": "<i8", "step": "<i8", "dtype": "<i4", "shape": "<i4",
                           **{c: "<i8" for c in COUNT_STATS}, **{c: "<f8" for c in FLOAT_STATS},
                           "fingerprint": "<i8"}
# A catalog tensor row's fields, in order (store/schema.py's ``tensors``): where each goes.
_ROW_FIELDS = ("series", "step", "dtype", "shape", "blob", *STAT_COLUMNS, "fingerprint")


@dataclass
class StatArrays:
    """Stat rows as columns: one numpy array per column, all of one length.

    ``series``, ``step``, ``fingerprint``: int64. Count stats: int64, -1 for NULL. Float stats:
    float64, NaN for NULL. ``dtype`` and ``shape``: object arrays of text. ``blob``: int64, -1
    where the row has no bytes (every chunk row). Only the columns asked for are present in
    ``stats``."""

    series: np.ndarray
    step: np.ndarray
    fingerprint: np.ndarray
    blob: np.ndarray
    dtype: np.ndarray
    shape: np.ndarray
    stats: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.series)

    @property
    def nbytes(self) -> int:
        """Memory the columns hold (object columns: their pointers)."""
        return sum(a.nbytes for a in (self.series, self.step, self.fingerprint, self.blob, self.dtype, self.shape,
                                      *self.stats.values()))

    def take(self, index: np.ndarray) -> StatArrays:
        """The rows at ``index`` (an index array or a boolean mask), in its order."""
        return StatArrays(self.series[index], self.step[index], self.fingerprint[index], self.blob[index],
                          self.dtype[index], self.shape[index], {k: v[index] for k, v in self.stats.items()})

    @staticmethod
    def concat(parts: Sequence[StatArrays], columns: Sequence[str]) -> StatArrays:
        """``parts`` one after another (an empty StatArrays with ``columns`` when there are none)."""
        if not parts:
            return empty(columns)
        if len(parts) == 1:
            return parts[0]
        def cat(f: str) -> np.ndarray:
            return np.concatenate([getattr(p, f) for p in parts])

        return StatArrays(cat("series"), cat("step"), cat("fingerprint"), cat("blob"), cat("dtype"), cat("shape"),
                          {c: np.concatenate([p.stats[c] for p in parts]) for c in columns})


def empty(columns: Sequence[str]) -> StatArrays:
    """No rows, with ``columns``."""
    i8 = np.zeros(0, np.int64)
    return StatArrays(i8, i8, i8, i8, np.zeros(0, object), np.zeros(0, object),
                      {c: np.zeros(0, np.dtype(COLUMNS[c])) for c in columns})


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of a chunk's bytes, as the signed int64 the catalog stores."""
    u = xxhash.xxh3_64_intdigest(data)
    return u - (1 << 64) if u >= 1 << 63 else u


def _codes(values: Iterable[Any]) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes of ``values`` (text) and the dictionary, in first-seen order."""
    index: dict[Any, int] = {}
    codes = [index.setdefault(v, len(index)) for v in values]
    return np.asarray(codes, dtype=np.int32), [str(v) for v in index]


def _codes_of(lists: Sequence[Sequence[Any]]) -> tuple[np.ndarray, list[str]]:
    """:func:`_codes` of ``lists`` end to end, each list object coded once: a batch's blocks share
    one dtype list and one shape list at every step (no Python per row for them)."""
    index: dict[Any, int] = {}
    coded: dict[int, np.ndarray] = {}  # id of a list -> its codes (the lists live through this call)
    out = []
    for values in lists:
        got = coded.get(id(values))
        if got is None:
            got = coded[id(values)] = np.asarray([index.setdefault(v, len(index)) for v in values], dtype=np.int32)
        out.append(got)
    return (np.concatenate(out) if out else np.zeros(0, np.int32)), [str(v) for v in index]


def _counts(values: Sequence[Any]) -> np.ndarray:
    """Count stats (ints or None) as int64 with -1 for None: through float64, which holds every
    count a tensor can have (< 2**53 elements) exactly and turns None into NaN in C."""
    f = np.asarray(values, dtype=np.float64)
    out = np.where(np.isnan(f), -1.0, f).astype(np.int64)
    return out


class ColumnBlock(NamedTuple):
    """Rows of one step already in columns (the writer's described copies: capture/packed.py's
    StatColumns with their series ids): no tuple per row on the way to a chunk."""

    series: np.ndarray  # (k,) int64
    step: int
    dtypes: Sequence[str]  # k texts
    shapes: Sequence[str]
    counts: np.ndarray  # (4, k) int64: COUNT_STATS, -1 for NULL
    floats: np.ndarray  # (6, k) float64: FLOAT_STATS, NaN for NULL
    fps: np.ndarray  # (k,) int64


def encode_rows(rows: Sequence[Sequence[Any]], blocks: Sequence[ColumnBlock] = ()) -> tuple[bytes, int, int]:
    """The chunk of catalog tensor rows ``rows`` (the writer's ``(series, step, dtype, shape, blob,
    *stats, fingerprint)`` tuples, with no blob) and of ``blocks``, and its first and last step."""
    if not rows and not blocks:
        raise ValueError("a stat chunk needs rows")
    parts: list[dict[str, Any]] = []
    if rows:
        by = dict(zip(_ROW_FIELDS, zip(*rows, strict=True), strict=True))
        parts.append({"series": np.asarray(by["series"], dtype=np.int64),
                      "step": np.asarray(by["step"], dtype=np.int64), "dtype": by["dtype"], "shape": by["shape"],
                      **{c: _counts(by[c]) for c in COUNT_STATS},
                      **{c: np.asarray(by[c], dtype=np.float64) for c in FLOAT_STATS},  # None -> NaN
                      "fingerprint": np.asarray(by["fingerprint"], dtype=np.int64)})
    for b in blocks:
        parts.append({"series": b.series, "step": np.full(len(b.series), b.step, dtype=np.int64), "dtype": b.dtypes,
                      "shape": b.shapes, **dict(zip(COUNT_STATS, b.counts, strict=True)),
                      **dict(zip(FLOAT_STATS, b.floats, strict=True)), "fingerprint": b.fps})
    dtype_codes, dtypes = _codes_of([p["dtype"] for p in parts])
    shape_codes, shapes = _codes_of([p["shape"] for p in parts])
    arrays: dict[str, np.ndarray] = {c: np.concatenate([p[c] for p in parts]) for c in COLUMNS
                                     if c not in ("dtype", "shape")}
    arrays["dtype"], arrays["shape"] = dtype_codes, shape_codes
    steps = arrays["step"]
    return encode(arrays, dtypes, shapes), int(steps.min()), int(steps.max())


def encode_arrays(rows: StatArrays) -> bytes:
    """The chunk of ``rows`` (with every stat column): what :func:`decode` gave, written again."""
    dtype_codes, dtypes = _codes(rows.dtype.tolist())
    shape_codes, shapes = _codes(rows.shape.tolist())
    return encode({"series": rows.series, "step": rows.step, "dtype": dtype_codes, "shape": shape_codes,
                   **rows.stats, "fingerprint": rows.fingerprint}, dtypes, shapes)


def encode(arrays: dict[str, np.ndarray], dtypes: list[str], shapes: list[str]) -> bytes:
    """A chunk of ``arrays`` (every column of :data:`COLUMNS`, one length), with the dtype and
    shape dictionaries their codes index."""
    n = len(arrays["series"])
    comp = zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True)  # a frame checks its own bytes
    parts: list[bytes] = []
    where: dict[str, list[int]] = {}
    offset = 0
    for name, dt in COLUMNS.items():
        a = np.ascontiguousarray(arrays[name], dtype=np.dtype(dt))
        if len(a) != n:
            raise ValueError(f"column {name} has {len(a)} rows, not {n}")
        data = comp.compress(a.tobytes())
        where[name] = [offset, len(data)]
        parts.append(data)
        offset += len(data)
    header = json.dumps({"rows": n, "columns": where, "dtypes": dtypes, "shapes": shapes},
                        separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, len(header)), header, *parts])


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk's header says, checked (:func:`read_header`)."""

    rows: int
    columns: dict[str, tuple[int, int]]  # name -> (offset, length) from ``body``
    dtypes: list[str]
    shapes: list[str]
    body: int  # where the column bytes start


def read_header(data: bytes | memoryview, rows: int, what: str) -> ChunkHeader:
    """The header of chunk ``data``, checked against the ``rows`` the catalog gives it."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise CorruptDataError(f"{what} is {len(view)} bytes, shorter than a chunk's header")
    magic, size = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CorruptDataError(f"{what} does not start with a stat chunk's magic ({bytes(magic)!r})")
    if size > MAX_HEADER or _HEAD.size + size > len(view):
        raise CorruptDataError(f"{what} claims a {size}-byte header in {len(view)} bytes")
    head = bounded_json.loads(bytes(view[_HEAD.size:_HEAD.size + size]), what)
    body = _HEAD.size + size
    try:
        n = head["rows"]
        columns = {str(k): (int(v[0]), int(v[1])) for k, v in head["columns"].items()}
        dtypes = [str(s) for s in head["dtypes"]]
        shapes = [str(s) for s in head["shapes"]]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptDataError(f"{what} has a malformed header ({e})") from None
    if not isinstance(n, int) or isinstance(n, bool) or n != rows or not 0 < n <= MAX_ROWS:
        raise CorruptDataError(f"{what} says {n!r} rows where the catalog says {rows}")
    if set(columns) != set(COLUMNS):
        raise CorruptDataError(f"{what} has columns {sorted(columns)}, not {sorted(COLUMNS)}")
    for name, (off, length) in columns.items():
        if off < 0 or length < 0 or body + off + length > len(view):
            raise CorruptDataError(f"{what}: column {name} lies outside the chunk ({off}+{length})")
    return ChunkHeader(n, columns, dtypes, shapes, body)


def read_column(data: bytes | memoryview, head: ChunkHeader, name: str, what: str) -> np.ndarray:
    """Column ``name`` of a chunk, decompressed into exactly ``head.rows`` values."""
    dt = np.dtype(COLUMNS[name])
    off, length = head.columns[name]
    raw_size = head.rows * dt.itemsize
    src = memoryview(data)[head.body + off:head.body + off + length]
    try:
        raw = zstandard.ZstdDecompressor().decompress(src, max_output_size=raw_size)
    except zstandard.ZstdError as e:
        raise CorruptDataError(f"{what}: column {name} does not decompress ({e})") from None
    if len(raw) != raw_size:
        raise CorruptDataError(f"{what}: column {name} holds {len(raw)} bytes, not {raw_size}")
    out = np.frombuffer(raw, dtype=dt)
    if name in ("dtype", "shape"):
        bound = len(head.dtypes if name == "dtype" else head.shapes)
        if out.size and (int(out.min()) < 0 or int(out.max()) >= bound):
            raise CorruptDataError(f"{what}: column {name} indexes past its {bound}-entry list")
    return out


def decode(data: bytes | memoryview, rows: int, columns: Sequence[str], what: str) -> StatArrays:
    """The rows of chunk ``data`` (``rows`` by the catalog) with stat ``columns``."""
    head = read_header(data, rows, what)
    series = read_column(data, head, "series", what)
    step = read_column(data, head, "step", what)
    fp = read_column(data, head, "fingerprint", what)
    dtypes = np.asarray(head.dtypes, dtype=object)
    shapes = np.asarray(head.shapes, dtype=object)
    dt = dtypes[read_column(data, head, "dtype", what)] if len(dtypes) else np.zeros(0, object)
    sh = shapes[read_column(data, head, "shape", what)] if len(shapes) else np.zeros(0, object)
    if len(dt) != rows or len(sh) != rows:
        raise CorruptDataError(f"{what}: its dtype or shape list is empty")
    stats = {c: read_column(data, head, c, what) for c in columns}
    return StatArrays(series, step, fp, np.full(rows, -1, np.int64), dt, sh, stats)


def tensor_rows(arrays: StatArrays) -> list[tuple[Any, ...]]:
    """``arrays`` (with every stat column) as ``tensors`` rows: ``(series, step, dtype, shape, blob,
    *stats, fingerprint)`` with NULL as None (a chunk's rows put back in the row layout)."""
    blobs = [None if b < 0 else b for b in arrays.blob.tolist()]
    return list(zip(arrays.series.tolist(), arrays.step.tolist(), arrays.dtype.tolist(), arrays.shape.tolist(),
                    blobs, *row_values(arrays, STAT_COLUMNS), arrays.fingerprint.tolist(), strict=True))


def row_values(arrays: StatArrays, columns: Sequence[str]) -> list[list[Any]]:
    """The stat ``columns`` of ``arrays`` as Python values, NULL as None (as SQLite gives them)."""
    out = []
    for c in columns:
        v = arrays.stats[c]
        if c in COUNT_STATS:
            out.append([None if x < 0 else x for x in v.tolist()])
        else:
            out.append([None if x != x else x for x in v.tolist()])
    return out
