"""A run's stats as one Parquet file in its directory, ``stats.parquet``: written by
``Recorder.close()``, queried in place (DuckDB, Polars, Spark), copied by ``export-stats``.

The file is a derived copy; the catalog (and the stats it indexes) stays the truth. It holds
every stat row of the store (:func:`stepdump.core.stats_table.schema`: the columns of
``run.stats()``, the fingerprint's kind, and ``rank`` for one rank of a multi-rank run), in the
order of ``run.stats()``, one row group per batch of steps. It is written beside its final
name, fsynced and renamed into place, and only then described in the catalog's meta
(``meta.stats_parquet``, FORMAT.md): rows, bytes, xxh3-64 of the file, the last step, the run id
and rank, the number of resumes. A reader trusts the file only when all of those still hold
(:func:`check`): a file changed, truncated or copied from another run or rank, or one the run
has grown past (a resumed recording removes it when it opens, a write-back replaces it), is
never served as the run's stats.

Writing it never fails a recording: :func:`compact` turns any failure into one warning and the
run stays readable. pyarrow is optional; without it nothing is written (one info line).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from stepdump.core.stats_table import arrays_table, schema
from stepdump.errors import StepdumpError, WriterError
from stepdump.store.queries import CatalogReader

log = logging.getLogger(__name__)

STATS_FILE = "stats.parquet"  # in the run (or rank) directory
META_KEY = "stats_parquet"  # the catalog meta that says what the file covers
VERSION = 1  # of the meta record and the file's columns
ROWS_PER_GROUP = 131_072  # rows read from the catalog (and written as one row group) at a time
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class StatsFileMeta:
    """What ``meta.stats_parquet`` says about the file (FORMAT.md, "stats.parquet").

    Attributes:
        version: Of this record and the file's columns.
        rows: Stat rows in the file.
        bytes: Size of the file.
        xxh3: xxh3-64 of the file's bytes, 16 hex digits.
        last_step: The catalog's last step when the file was written (None: no step).
        run_id: ``meta.run_id`` of the store it was written from.
        rank: The rank of a multi-rank run's store (the file's ``rank`` column), else None.
        resumes: Entries of ``meta.history`` then (each resume adds one).
        source: ``CatalogReader.stat_digest()`` of the rows it was made from (rows edited since: another).
        seconds: Time the compaction took.
    """

    version: int
    rows: int
    bytes: int
    xxh3: str
    last_step: int | None
    run_id: str | None
    rank: int | None
    resumes: int
    source: str
    seconds: float

    @classmethod
    def parse(cls, value: Any) -> StatsFileMeta | None:
        """The record in ``meta.stats_parquet`` (None: absent, invalidated or damaged)."""
        if not isinstance(value, dict) or set(value) != {f for f in cls.__dataclass_fields__}:
            return None
        ints = ("version", "rows", "bytes", "resumes")
        if any(isinstance(value[k], bool) or not isinstance(value[k], int) for k in ints):
            return None
        for k, t in (("last_step", int), ("rank", int), ("run_id", str)):
            if value[k] is not None and (isinstance(value[k], bool) or not isinstance(value[k], t)):
                return None
        if not isinstance(value["xxh3"], str) or not isinstance(value["source"], str) \
                or not isinstance(value["seconds"], (int, float)):
            return None
        return cls(**value)


class StatsFileCheck(NamedTuple):
    """What :func:`check` found: the file's bytes when they are the store's stats, else the reason."""

    data: bytes | None
    reason: str
    meta: StatsFileMeta | None


def _run_facts(meta: dict[str, Any]) -> tuple[str | None, int | None, int]:
    """(run id, rank, resumes) of a store's catalog meta."""
    run_id = meta.get("run_id")
    dist = meta.get("distributed")
    rank = dist.get("rank") if isinstance(dist, dict) else None
    history = meta.get("history")
    return (run_id if isinstance(run_id, str) else None,
            rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            len(history) if isinstance(history, list) else 0)


def _batches(steps: list[int], per: int) -> list[range]:
    """Step ranges covering every step (0 to the end) in order, ``per`` recorded steps each."""
    starts = steps[::per] or [0]
    starts[0] = 0
    ends = [*starts[1:], 2**62]
    return [range(a, b) for a, b in zip(starts, ends, strict=True)]


def write(run_dir: str | os.PathLike[str]) -> StatsFileMeta:
    """Write ``run_dir/stats.parquet`` from its catalog and describe it in the catalog's meta.

    Raises whatever fails (pyarrow missing: ConfigError; a damaged catalog: CorruptDataError; the
    disk: OSError); a file half written is removed, the previous file and meta are left as they were.
    """
    import pyarrow.parquet as pq

    from stepdump.store.catalog import CatalogWriter

    start = time.perf_counter()
    run_dir = Path(run_dir)
    final = run_dir / STATS_FILE
    tmp = run_dir / f".{STATS_FILE}.{os.getpid()}.partial"
    reader = CatalogReader(run_dir)
    try:
        meta = reader.meta()
        run_id, rank, resumes = _run_facts(meta)
        if reader.non_text_series() is not None:
            raise StepdumpError(f"the catalog of {run_dir} names a tensor with a name that is not text")
        fp_kinds = reader.fp_kinds()
        series = reader.matching_series(None, None)
        per = max(1, ROWS_PER_GROUP // max(1, len(series)))
        steps = reader.steps()
        last = reader.last_step()
        source = reader.stat_digest()
        rows = 0
        try:
            with pq.ParquetWriter(tmp, schema(rank is not None), compression="zstd") as writer:
                for span in _batches(steps, per):
                    table = arrays_table(reader.stat_arrays(None, None, span), series, fp_kinds, rank=rank,
                                         where=run_dir)
                    if table.num_rows:
                        writer.write_table(table)
                        rows += table.num_rows
            h = xxhash.xxh3_64()
            with open(tmp, "rb+") as f:
                while chunk := f.read(_READ_CHUNK):
                    h.update(chunk)
                size = f.tell()
                os.fsync(f.fileno())  # the meta below names these bytes: on disk before it commits
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        reader.close()
    record = StatsFileMeta(version=VERSION, rows=rows, bytes=size, xxh3=h.hexdigest(), last_step=last,
                           run_id=run_id, rank=rank, resumes=resumes, source=source,
                           seconds=round(time.perf_counter() - start, 6))
    cat = CatalogWriter(run_dir)
    try:
        cat.set_meta(META_KEY, asdict(record))
    except BaseException:
        cat.abort()
        raise
    cat.close()  # commits
    return record


def compact(run_dir: str | os.PathLike[str], *, strict: bool = False) -> StatsFileMeta | None:
    """:func:`write`, as ``Recorder.close()`` does it: without pyarrow nothing (an info line); a
    failure is one warning and None (``strict``: raised as a WriterError), the run readable as it is."""
    try:
        import pyarrow.parquet  # noqa: F401 - optional: say so once, write nothing
    except ImportError:
        log.info("stepdump: %s not written (pyarrow is not installed: pip install 'stepdump[arrow]'); the "
                 "run's stats are in its catalog, `stepdump export-stats` builds the file", Path(run_dir) / STATS_FILE)
        return None
    try:
        record = write(run_dir)
    except Exception as e:  # noqa: BLE001 - a derived copy: never fail the recording over it
        if strict:
            raise WriterError(f"stepdump could not write {Path(run_dir) / STATS_FILE}: {e}") from e
        log.warning("stepdump: could not write %s (%s: %s); the run is complete and readable, its stats are "
                    "in its catalog (`stepdump export-stats` writes them as Parquet)",
                    Path(run_dir) / STATS_FILE, type(e).__name__, e)
        return None
    log.info("stepdump: wrote %s (%d rows, %d bytes, %.1f ms)", Path(run_dir) / STATS_FILE, record.rows,
             record.bytes, record.seconds * 1e3)
    return record


def remove(run_dir: str | os.PathLike[str]) -> bool:
    """Remove the file before the run changes (a resumed recording, a write-back; their catalog
    transaction clears the meta); whether there was one."""
    try:
        (Path(run_dir) / STATS_FILE).unlink()
    except FileNotFoundError:
        return False
    return True


def check(run_dir: str | os.PathLike[str], catalog: CatalogReader) -> StatsFileCheck:
    """The file's bytes if they are exactly what :func:`write` wrote for the store as it is now
    (meta present and whole, same run, rank and resumes, same last step, size and xxh3), read
    once; else the reason. Never raises for a bad file."""
    path = Path(run_dir) / STATS_FILE
    meta = catalog.meta()
    raw = meta.get(META_KEY)
    record = StatsFileMeta.parse(raw)
    if record is None:
        why = "the run has none" if raw is None else f"meta.{META_KEY} is damaged"
        return StatsFileCheck(None, f"no valid {STATS_FILE} ({why})", None)
    run_id, rank, resumes = _run_facts(meta)
    stale = [w for w, bad in (
        (f"format {record.version}, not {VERSION}", record.version != VERSION),
        (f"written for run {record.run_id}, this is {run_id}", record.run_id != run_id),
        (f"written for rank {record.rank}, this store is rank {rank}", record.rank != rank),
        ("written before the run was resumed", record.resumes != resumes),
        (f"covers steps to {record.last_step}, the run has steps to {catalog.last_step()}",
         record.last_step != catalog.last_step()),
    ) if bad]
    if not stale and record.source != catalog.stat_digest():
        stale.append("the catalog's stat rows changed since it was written")
    if stale:
        return StatsFileCheck(None, f"{path} is stale: {'; '.join(stale)}", record)
    try:
        with open(path, "rb") as f:
            data = f.read(record.bytes + 1)
    except OSError as e:
        return StatsFileCheck(None, f"{path} cannot be read ({e.strerror or e})", record)
    if len(data) != record.bytes:
        return StatsFileCheck(None, f"{path} is {'truncated' if len(data) < record.bytes else 'longer'}: "
                                    f"{len(data)} bytes where {record.bytes} were written", record)
    if xxhash.xxh3_64_hexdigest(data) != record.xxh3:
        return StatsFileCheck(None, f"{path} changed since it was written (its xxh3 differs)", record)
    return StatsFileCheck(data, "", record)
