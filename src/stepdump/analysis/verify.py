"""Re-read every blob of a run and check it: checksum, decoding, fingerprint, size."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stepdump.capture.stats import fingerprint_bytes
from stepdump.errors import CorruptDataError
from stepdump.store.format import DTYPES, parse_shape


@dataclass(frozen=True)
class Problem:
    """One damaged thing: a blob (with the tensors that use it) or the catalog."""

    where: str
    detail: str
    tensors: tuple[str, ...] = ()


@dataclass
class VerifyReport:
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(run: object, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check the catalog's integrity and every blob of ``run`` (a stepdump.Run)."""
    con: sqlite3.Connection = run._con  # type: ignore[attr-defined]
    blobs = run._blobs  # type: ignore[attr-defined]
    report = VerifyReport()
    try:
        result = [r[0] for r in con.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:
        report.problems.append(Problem("catalog", f"SQLite cannot check it: {e}"))
        return report
    if result != ["ok"]:
        report.problems.append(Problem("catalog", "; ".join(result[:5])))
    users: dict[int, list[tuple[str, str, int, str, str, int]]] = {}
    for blob, kind, name, step, dtype, shape, fp in con.execute(
        "SELECT t.blob, s.kind, s.name, t.step, t.dtype, t.shape, t.fingerprint FROM tensors t "
        "JOIN series s ON s.id = t.series WHERE t.blob IS NOT NULL"
    ):
        users.setdefault(blob, []).append((kind, name, step, dtype, shape, fp))
    ids = [r[0] for r in con.execute("SELECT id FROM blobs ORDER BY segment, offset")]
    for i, blob_id in enumerate(ids):
        refs = users.get(blob_id, [])
        label = tuple(f"{k} {n} @ step {s}" for k, n, s, *_ in refs)
        try:
            raw = blobs.raw(blob_id)
            report.bytes_checked += len(raw)
            for kind, name, step, dtype, shape, fp in refs:
                _check_tensor(raw, dtype, shape, fp)
        except CorruptDataError as e:
            row = con.execute(
                "SELECT s.key, b.offset FROM blobs b LEFT JOIN segments s ON s.id = b.segment WHERE b.id = ?",
                (blob_id,),
            ).fetchone()
            where = f"blob {blob_id} ({row[0]} @ {row[1]})" if row else f"blob {blob_id}"
            report.problems.append(Problem(where, str(e), label))
        report.blobs_checked += 1
        if progress is not None:
            progress(i + 1, len(ids))
    return report


def _check_tensor(raw: bytes | bytearray | memoryview, dtype: str, shape: str, fp: int) -> None:
    tdtype = DTYPES.get(dtype)
    if tdtype is None:
        raise CorruptDataError(f"unknown dtype {dtype!r}")
    want = math.prod(parse_shape(shape)) * torch.empty((), dtype=tdtype).element_size()
    if len(raw) != want:
        raise CorruptDataError(f"holds {len(raw)} bytes, the tensor needs {want}")
    if fingerprint_bytes(raw) != fp:
        raise CorruptDataError("decoded bytes do not match the recorded fingerprint")
