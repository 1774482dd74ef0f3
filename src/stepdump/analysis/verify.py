"""Re-read every blob of a run and check it: checksum, decoding, fingerprint, size; in a
gradient log, also re-apply every segment's updates against the recorded fingerprints.

A row's fingerprint is checked under its series' kind (FORMAT.md, "Fingerprint kinds"): xxh3
of the decoded bytes, or dmix64 of them, computed on the CPU by the same torch ops a device
uses (dmix64 is defined on the bytes alone, so where it was computed does not matter)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from stepdump.core.hashing import XXH3, fingerprint_bytes_as
from stepdump.core.sparse import from_raw_bytes
from stepdump.errors import CorruptDataError, StepdumpError
from stepdump.read.blobs import check_layout
from stepdump.store import bounded_json
from stepdump.store.format import sparse_values_dtype

#: Steps whose recorded states are read from the catalog at a time (each a few KiB of JSON).
_STATE_BATCH = 1000


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
    segments_checked: int = 0  # gradient-log segments whose updates reproduced the record
    chunks_checked: int = 0  # stat chunks read against their checksums and decoded
    unchecked: list[str] = field(default_factory=list)  # what could not be re-run here, and why

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(run: Any, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check the catalog's integrity and every blob of every store of ``run`` (a RunReader).

    Never raises on damage: every problem found (a blob failing its checksum or
    fingerprint, bytes missing from a segment, a tensor row pointing at no blob,
    a catalog SQLite cannot read) is a :class:`Problem` in the report. For a
    multi-rank run each problem's ``where`` starts with its rank (``rank 1: blob 7 ...``).
    """
    report = VerifyReport()
    for rank, store in run.stores():
        one = _verify_store(store, progress)
        report.blobs_checked += one.blobs_checked
        report.bytes_checked += one.bytes_checked
        report.segments_checked += one.segments_checked
        report.chunks_checked += one.chunks_checked
        report.unchecked.extend(one.unchecked if rank is None else [f"rank {rank}: {u}" for u in one.unchecked])
        report.problems.extend(p if rank is None else replace(p, where=f"rank {rank}: {p.where}")
                               for p in one.problems)
    return report


def _verify_store(run: Any, progress: Callable[[int, int], None] | None) -> VerifyReport:
    """:func:`verify` of one store (a Run: ``run.catalog`` answers the queries)."""
    cat = run.catalog
    report = VerifyReport()
    try:
        result = cat.integrity_check()
    except CorruptDataError as e:
        report.problems.append(Problem("catalog", f"SQLite cannot check it: {e}"))
        return report
    if result != ["ok"]:
        report.problems.append(Problem("catalog", "; ".join(map(str, result[:5]))))
    try:
        tensor_rows = cat.blob_users()
        ids = cat.blob_ids()
        fp_kinds = cat.fp_kinds_by_name()  # {} in a format-1 store: every row is xxh3
    except CorruptDataError as e:
        report.problems.append(Problem("catalog", f"its tensors and blobs cannot be listed: {e}"))
        return report
    users: dict[object, list[tuple[object, ...]]] = {}
    for blob, kind, name, step, dtype, shape, fp in tensor_rows:
        users.setdefault(blob, []).append((kind, name, step, dtype, shape, fp))
    for blob in users.keys() - set(ids):
        refs = users[blob]
        report.problems.append(Problem(f"blob {blob!r}", "tensors point at a blob the catalog does not list",
                                       tuple(f"{k} {n} @ step {s}" for k, n, s, *_ in refs)))
    for i, blob_id in enumerate(ids):
        refs = users.get(blob_id, [])
        label = tuple(f"{k} {n} @ step {s}" for k, n, s, *_ in refs)
        try:
            raw = run.read_blob(blob_id)
            report.bytes_checked += len(raw)
            for kind, name, step, dtype, shape, fp in refs:
                _check_tensor(raw, dtype, shape, fp, fp_kinds.get((kind, name), XXH3))  # type: ignore[call-overload]
        except CorruptDataError as e:
            try:
                at = cat.blob_location(blob_id)
            except CorruptDataError:
                at = None
            if at is None:
                where = f"blob {blob_id}"
            else:
                segment, offset = at
                where = f"blob {blob_id} ({segment} @ {offset})"
            report.problems.append(Problem(where, str(e), label))
        report.blobs_checked += 1
        if progress is not None:
            progress(i + 1, len(ids))
    _verify_chunks(cat, report)
    _verify_states(run, report)
    _verify_gradient_log(run, report)
    return report


def _verify_chunks(cat: Any, report: VerifyReport) -> None:
    """Every stat chunk (the stats-only rows, FORMAT.md "Stat chunks") against its checksum, decoded."""
    try:
        checked, problems = cat.check_stat_chunks()
    except CorruptDataError as e:
        report.problems.append(Problem("catalog", f"its stat chunks cannot be listed: {e}"))
        return
    report.chunks_checked += checked
    report.problems.extend(Problem(where, detail) for where, detail in problems)


def _verify_states(run: Any, report: VerifyReport) -> None:
    """Every step's recorded state (groups, scheduler, scaler, RNG, batch skeleton: typed JSON in
    the catalog) must parse, within the bounds every reader applies, to an object: a malformed
    one makes ``state_dict``, ``restore`` and ``diff`` refuse that step."""
    cat = run.catalog
    try:
        steps = run.all_steps
        for first in range(0, len(steps), _STATE_BATCH):
            chunk = steps[first:first + _STATE_BATCH]
            for step, _skipped, text in cat.step_block(chunk[0], chunk[-1]):
                if text is None:
                    continue
                try:
                    if not isinstance(text, (str, bytes)):
                        raise CorruptDataError(f"it is a {type(text).__name__}, not JSON text")
                    tree = bounded_json.loads(text, "it")
                    if not isinstance(tree, dict):
                        raise CorruptDataError(f"it is a JSON {type(tree).__name__}, not an object")
                except CorruptDataError as e:
                    report.problems.append(Problem(f"step {step}", f"its recorded state cannot be read: {e}"))
    except CorruptDataError as e:
        report.problems.append(Problem("catalog", f"its step states cannot be listed: {e}"))


def _verify_gradient_log(run: Any, report: VerifyReport) -> None:
    """A gradient log's params and optimizer state between keyframes exist only as the recorded
    updates re-applied: intact blobs are not enough, each segment must reproduce the record
    (a grad blob replaced together with its checksum and fingerprint passes the blob checks)."""
    engine = getattr(run, "gradient_log", None)
    if engine is None:
        return
    try:
        seg = engine.verify_segments()
    except StepdumpError as e:  # the catalog cannot even say what the segments are
        report.problems.append(Problem("gradient log", f"its segments cannot be re-applied: {e}"))
        return
    report.segments_checked += seg.checked
    report.unchecked.extend(seg.unchecked)
    report.problems.extend(Problem(f"gradient log, step {step}", why) for step, why in seg.problems)


def _check_tensor(raw: bytes | bytearray | memoryview, dtype: object, shape: object, fp: object,
                  fp_kind: str = XXH3) -> None:
    values = sparse_values_dtype(dtype) if isinstance(dtype, str) else None
    if values is not None:  # a sparse tensor: its header, sizes and indices must hold together
        tdtype, dims, _ = check_layout(values, shape)
        from_raw_bytes(raw, tdtype, dims)
    else:
        _, _, want = check_layout(dtype, shape)
        if len(raw) != want:
            raise CorruptDataError(f"holds {len(raw)} bytes, the tensor needs {want}")
    if fingerprint_bytes_as(fp_kind, raw) != fp:
        kind = "" if fp_kind == XXH3 else f" ({fp_kind})"
        raise CorruptDataError(f"decoded bytes do not match the recorded fingerprint{kind}")
