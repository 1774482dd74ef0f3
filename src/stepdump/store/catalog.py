"""The SQLite catalog: the index of a run (steps, series, blobs, stats, scalars).

One writer (the recorder's writer thread) and any number of readers. WAL mode
lets readers see every committed step while the writer goes on; a step's rows
are written in one transaction after its blobs are on disk, so a step is either
entirely visible or not at all.

A Recorder that closes cleanly switches the catalog back to a rollback journal,
so that a finished run is a plain SQLite file that reads with read permission
only (WAL mode needs a writable ``-shm`` file beside it, even for a reader).

This module is the writer's side (creating a catalog, ``CatalogWriter``). The
reader's side is :mod:`stepdump.store.catalog_read` (opening, checking the schema)
and :mod:`stepdump.store.queries` (every query a reader runs); the schema itself is
:mod:`stepdump.store.schema`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

from stepdump.errors import CorruptDataError, NotARunError
from stepdump.store import bounded_json
from stepdump.store.inside import inside
from stepdump.store.catalog_read import ReadConnection, connect_reader, read_meta
from stepdump.store import stat_chunk
from stepdump.store.format import (
    CATALOG_FILE,
    FIRST_FORMAT_VERSION,
    FP_KINDS_FORMAT_VERSION,
    META_REEXECUTIONS,
    SEGMENT_DIR,
    STAT_CHUNKS_FORMAT_VERSION,
)
from stepdump.store.plainfile import check_plain
from stepdump.store.schema import (
    DEFAULT_FP_KIND,
    FP_KINDS_SCHEMA,
    FP_KINDS_TABLE,
    PARTIAL_SUFFIX,
    SCHEMA,
    STAT_CHUNKS_INDEX,
    STAT_CHUNKS_SCHEMA,
    STAT_CHUNKS_TABLE,
    STAT_COLUMNS,
    BlobRow,
    catalog_path,
    check_side_files,
)

log = logging.getLogger(__name__)

# Rows per multi-row INSERT (CatalogWriter._insert_rows): 16 values a tensor row, 8,000 per
# statement, well inside SQLite's limit on bound values (32,766 since 3.32; 999 before it is
# why older code used executemany: a build that old gets one row per statement, below).
_ROWS_PER_INSERT = 500 if sqlite3.sqlite_version_info >= (3, 32, 0) else 1


@functools.lru_cache(maxsize=64)
def _row_marks(width: int, rows: int) -> str:
    """``(?, …), (?, …)…``: ``rows`` groups of ``width`` marks (cached: the same few shapes every step)."""
    one = "(" + ", ".join("?" * width) + ")"
    return ", ".join([one] * rows)

# Re-exported: the reader side lives in catalog_read / queries, the schema in schema.
__all__ = [
    "PARTIAL_SUFFIX", "SCHEMA", "STAT_COLUMNS", "BlobRow", "CatalogWriter", "ReadConnection",
    "catalog_path", "check_writable_layout", "connect_reader", "create", "read_meta", "snapshot_catalog",
]


def check_writable_layout(run_dir: Path) -> None:
    """What a Recorder writes into must be what a Recorder made: the catalog and its side
    files regular files with one name, ``segments`` a directory (not a link out of the run)."""
    if not check_plain(catalog_path(run_dir), "the catalog"):
        raise NotARunError(f"{run_dir} has no {CATALOG_FILE}; it is not a stepdump run")
    check_side_files(catalog_path(run_dir), single_link=True)
    inside(run_dir, SEGMENT_DIR, "the folder of segment files")


def create(run_dir: Path, meta: dict[str, Any]) -> None:
    """Create a new catalog with ``meta`` (values JSON-encoded), atomically.

    The catalog is built under a temporary name and renamed into place once its
    schema and meta are committed, so a process killed while creating a run leaves
    either no catalog (the directory is still an empty run to start or resume) or
    a complete one, never a half-made file that no reader can open.
    """
    final = catalog_path(run_dir)
    tmp = final.with_name(final.name + PARTIAL_SUFFIX)
    for leftover in (tmp, *(tmp.with_name(tmp.name + s) for s in ("-journal", "-wal", "-shm"))):
        leftover.unlink(missing_ok=True)  # from a creator killed half-way
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        with con:
            con.executemany(
                "INSERT INTO meta(key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in {"format_version": FIRST_FORMAT_VERSION, **meta}.items()],
            )
        con.execute("PRAGMA journal_mode=WAL")  # persistent: stored in the file's header
    finally:
        con.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def resume(run_dir: Path, drop_from: int | None, history: list[Any], meta: dict[str, Any] | None = None) -> None:
    """Before a resumed Recorder writes: drop the steps from ``drop_from`` on (None: none) and
    set ``meta.history`` (and the other ``meta`` keys given), in one transaction.

    Only catalog rows go: the steps' ``steps``, ``tensors`` and ``scalars`` rows, the ``blobs``
    rows no remaining tensor reads (directly or as a delta base), ``series`` left with no
    tensor, and ``meta.final_step`` if that step is dropped. The segment bytes stay where they
    are, unreferenced, like the bytes of steps a crash kept from committing (FORMAT.md): the
    store stays append-only and every remaining blob verifies as before.
    """
    check_writable_layout(run_dir)
    con = sqlite3.connect(catalog_path(run_dir), isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        try:
            if drop_from is not None:
                _drop_steps(con, drop_from)
            for key, value in {**(meta or {}), "history": history}.items():
                con.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()


def _drop_steps(con: sqlite3.Connection, first: int) -> None:
    dropped = {r[0] for r in con.execute("SELECT DISTINCT blob FROM tensors WHERE step >= ? AND blob IS NOT NULL",
                                         (first,))}
    for table in ("tensors", "steps", "scalars"):
        con.execute(f"DELETE FROM {table} WHERE step >= ?", (first,))
    chunk_series = _drop_chunk_steps(con, first)
    if dropped:
        # A base is an earlier blob, so only remaining blobs at or after the first dropped one can
        # lead (through their bases) to a dropped blob; keep whatever they lead to.
        kept = {r[0] for r in con.execute(
            "WITH RECURSIVE keep(id) AS (SELECT blob FROM tensors WHERE blob >= ? UNION "
            "SELECT b.base FROM blobs b JOIN keep k ON b.id = k.id WHERE b.base IS NOT NULL) SELECT id FROM keep",
            (min(dropped),))}
        con.executemany("DELETE FROM blobs WHERE id = ?", [(b,) for b in sorted(dropped - kept)])
    con.execute("DELETE FROM series WHERE NOT EXISTS (SELECT 1 FROM tensors t WHERE t.series = series.id) "
                "AND id NOT IN (SELECT value FROM json_each(?))", (json.dumps(sorted(chunk_series)),))
    _drop_orphan_fp_kinds(con)
    row = con.execute("SELECT value FROM meta WHERE key = 'final_step'").fetchone()
    try:
        final = bounded_json.loads(row[0], "meta.final_step") if row is not None else None
    except (TypeError, ValueError, CorruptDataError):
        final = first  # not a step number: nothing to keep
    if row is not None and not (isinstance(final, int) and final < first):
        con.execute("DELETE FROM meta WHERE key = 'final_step'")
    _drop_reexecutions(con, first)


def _has_stat_chunks(con: sqlite3.Connection) -> bool:
    return con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                       (STAT_CHUNKS_TABLE,)).fetchone() is not None


def _drop_chunk_steps(con: sqlite3.Connection, first: int) -> set[int]:
    """Stat chunks lose their rows at steps ``first`` and later: a chunk wholly after goes, one
    that straddles ``first`` is written again with its earlier rows (a resume does this once).
    Returns the series that the remaining chunks name (they keep their series rows)."""
    if not _has_stat_chunks(con):
        return set()
    table = STAT_CHUNKS_TABLE
    con.execute(f"DELETE FROM {table} WHERE first_step >= ?", (first,))  # noqa: S608 - a fixed name
    for cid, rows, data in con.execute(f"SELECT id, rows, data FROM {table} WHERE last_step >= ?",  # noqa: S608
                                       (first,)).fetchall():
        what = f"stat chunk {cid} of the catalog"
        kept = stat_chunk.decode(data, rows, stat_chunk.COUNT_STATS + stat_chunk.FLOAT_STATS, what)
        kept = kept.take(kept.step < first)
        new = stat_chunk.encode_arrays(kept)
        con.execute(f"UPDATE {table} SET last_step = ?, rows = ?, checksum = ?, data = ? WHERE id = ?",  # noqa: S608
                    (int(kept.step.max()), len(kept), stat_chunk.checksum(new), new, cid))
    series: set[int] = set()
    for cid, rows, data in con.execute(f"SELECT id, rows, data FROM {table}").fetchall():  # noqa: S608
        series.update(stat_chunk.decode(data, rows, (), f"stat chunk {cid} of the catalog").series.tolist())
    return series


def _has_fp_kinds(con: sqlite3.Connection) -> bool:
    return con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                       (FP_KINDS_TABLE,)).fetchone() is not None


def _drop_orphan_fp_kinds(con: sqlite3.Connection) -> None:
    """The kinds of series that are gone go with them: a series id SQLite hands out again must
    not inherit a dropped series' kind. The table and format 2 stay (the format never goes down)."""
    if _has_fp_kinds(con):
        con.execute(f"DELETE FROM {FP_KINDS_TABLE} WHERE series NOT IN (SELECT id FROM series)")  # noqa: S608


def _drop_reexecutions(con: sqlite3.Connection, first: int) -> None:
    """Re-executions written back at dropped steps go with them (their tensors went above): a
    step recorded again is another record, which the old verdict is not about."""
    row = con.execute("SELECT value FROM meta WHERE key = ?", (META_REEXECUTIONS,)).fetchone()
    if row is None:
        return
    try:
        marks = bounded_json.loads(row[0], "meta.reexecutions")
    except (TypeError, ValueError, CorruptDataError):
        marks = None
    kept: dict[str, Any] = {}
    for key, mark in (marks.items() if isinstance(marks, dict) else ()):
        at = _step_key(key)
        if at is not None and at < first:  # a key that is not a step goes too: no step keeps it
            kept[key] = mark
    if kept:
        con.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(kept), META_REEXECUTIONS))
    else:
        con.execute("DELETE FROM meta WHERE key = ?", (META_REEXECUTIONS,))


def _step_key(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


class CatalogWriter:
    """The writer thread's connection. Not thread-safe: one thread owns it."""

    def __init__(self, run_dir: Path, synchronous: str = "NORMAL") -> None:
        check_writable_layout(run_dir)
        self.con = sqlite3.connect(catalog_path(run_dir), check_same_thread=False, isolation_level=None)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute(f"PRAGMA synchronous={synchronous}")
        self.series_generation = 0
        self._load_ids()
        self._next_blob = (self.con.execute("SELECT max(id) FROM blobs").fetchone()[0] or 0) + 1
        self.con.execute("BEGIN")

    def _load_ids(self) -> None:
        """The committed series, segments and fingerprint kinds (again after a rollback, which
        drops those the rolled-back transaction added)."""
        # Changes whenever known series ids may have gone: whoever keeps ids of its own checks it.
        self.series_generation += 1
        self._series: dict[tuple[str, str], int] = {
            (k, n): i for i, k, n in self.con.execute("SELECT id, kind, name FROM series")
        }
        self._segments: dict[str, int] = {k: i for i, k in self.con.execute("SELECT id, key FROM segments")}
        self._has_fp_kinds = _has_fp_kinds(self.con)
        self._has_stat_chunks = _has_stat_chunks(self.con)
        self._fp_kinds: dict[int, str] = dict(
            self.con.execute(f"SELECT series, kind FROM {FP_KINDS_TABLE}")) if self._has_fp_kinds else {}  # noqa: S608

    def new_blob_id(self) -> int:
        """Blob ids are assigned here so a step's blob rows can be inserted in one batch."""
        bid = self._next_blob
        self._next_blob += 1
        return bid

    def new_blob_ids(self, count: int) -> int:
        """``count`` consecutive blob ids (:meth:`new_blob_id` ``count`` times); returns the first."""
        first = self._next_blob
        self._next_blob += count
        return first

    def add_blobs(self, rows: Iterable[Sequence[Any]]) -> None:
        """Rows of (id, segment id, offset, length, codec, raw_length, checksum, base), by the
        multi-row path (:meth:`_insert_rows`): a gradient log's step has a blob per grad."""
        self._insert_rows("INSERT INTO blobs(id, segment, offset, length, codec, raw_length, checksum, base) "
                          "VALUES ", 8, rows)

    def last_step(self) -> int | None:
        row = self.con.execute("SELECT max(step) FROM steps").fetchone()
        return row[0]

    def series_id(self, kind: str, name: str, param: str | None = None, key: str | None = None,
                  fp_kind: str | None = None) -> int:
        """The id of series (``kind``, ``name``), created if new; a new series takes fingerprint
        kind ``fp_kind`` (None: xxh3). An existing one keeps its kind (:meth:`fp_kind` says which)."""
        sid = self._series.get((kind, name))
        if sid is None:
            cur = self.con.execute(
                "INSERT INTO series(kind, name, param, key) VALUES (?, ?, ?, ?)", (kind, name, param, key)
            )
            sid = int(cur.lastrowid)  # type: ignore[arg-type]
            self._series[(kind, name)] = sid
            if fp_kind is not None:
                self.set_fp_kind(sid, fp_kind)
        return sid

    @property
    def any_fp_kind(self) -> bool:
        """Whether some series has another fingerprint kind than xxh3 (else every series is xxh3)."""
        return bool(self._fp_kinds)

    def fp_kind(self, series: int) -> str:
        """The fingerprint kind of ``series`` (xxh3 unless :meth:`set_fp_kind` gave it another)."""
        return self._fp_kinds.get(series, DEFAULT_FP_KIND)

    def set_fp_kind(self, series: int, kind: str) -> None:
        """Give ``series`` fingerprint kind ``kind``, in this transaction.

        A series keeps one kind at all its steps: setting another kind than the one it has is an
        error (the caller keeps the first). xxh3 is the kind of every series the table does not
        name, so it writes nothing. The first other kind creates the ``fp_kinds`` table and makes
        the store format 2, in the same transaction as its row (FORMAT.md, "Fingerprint kinds")."""
        have = self.fp_kind(series)
        if kind == have:
            return
        if have != DEFAULT_FP_KIND or series in self._fp_kinds:
            raise CorruptDataError(f"series {series} has fingerprint kind {have!r}; it cannot take {kind!r} "
                                   "(a series keeps one kind at all its steps)")
        if not self._has_fp_kinds:
            self.con.execute(FP_KINDS_SCHEMA.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))
            self._has_fp_kinds = True
        self.con.execute(f"INSERT INTO {FP_KINDS_TABLE}(series, kind) VALUES (?, ?)", (series, kind))  # noqa: S608
        if not self._has_stat_chunks:  # the format never goes down (a format-3 store has fp_kinds already)
            self.set_meta("format_version", FP_KINDS_FORMAT_VERSION)
        self._fp_kinds[series] = kind

    def add_stat_chunk(self, rows: Sequence[Sequence[Any]], blocks: Sequence[stat_chunk.ColumnBlock] = ()) -> None:
        """Stats-only tensor rows (no blob; the rows :meth:`add_tensors` takes) and ``blocks`` (rows
        in columns already) as one stat chunk, in this transaction (store/stat_chunk.py). The first
        chunk creates the ``stat_chunks`` table (and ``fp_kinds``, which every format-3 catalog has)
        and makes the store format 3."""
        data, first, last = stat_chunk.encode_rows(rows, blocks)
        n = len(rows) + sum(len(b.series) for b in blocks)
        if not self._has_stat_chunks:
            if not self._has_fp_kinds:
                self.con.execute(FP_KINDS_SCHEMA.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))
                self._has_fp_kinds = True
            self.con.execute(STAT_CHUNKS_SCHEMA.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))
            self.con.execute(STAT_CHUNKS_INDEX.replace("CREATE INDEX", "CREATE INDEX IF NOT EXISTS", 1))
            self.set_meta("format_version", STAT_CHUNKS_FORMAT_VERSION)
            self._has_stat_chunks = True
        self.con.execute(f"INSERT INTO {STAT_CHUNKS_TABLE}(first_step, last_step, rows, checksum, data) "  # noqa: S608
                         "VALUES (?, ?, ?, ?, ?)", (first, last, n, stat_chunk.checksum(data), data))

    def segment_id(self, key: str) -> int:
        sid = self._segments.get(key)
        if sid is None:
            cur = self.con.execute("INSERT INTO segments(key) VALUES (?)", (key,))
            sid = int(cur.lastrowid)  # type: ignore[arg-type]
            self._segments[key] = sid
        return sid

    def add_tensors(self, rows: Iterable[Sequence[Any]]) -> None:
        """Rows of (series, step, dtype, shape, blob, *STAT_COLUMNS, fingerprint)."""
        self._insert_rows("INSERT OR REPLACE INTO tensors(series, step, dtype, shape, blob, numel, nan, posinf,"
                          " neginf, min, max, mean, std, norm, zero_frac, fingerprint) VALUES ", 16, rows)

    def _insert_rows(self, head: str, width: int, rows: Iterable[Sequence[Any]]) -> None:
        """``rows`` (``width`` values each) inserted by a few multi-row INSERTs rather than one
        ``executemany`` step per row: the sqlite3 module lets go of the GIL around every step, and
        on a small model's step each of those hand-offs costs the training thread more than the
        row. Statements of ``_ROWS_PER_INSERT`` rows, the rest in one shorter one."""
        rows = list(rows)
        for i in range(0, len(rows), _ROWS_PER_INSERT):
            part = rows[i:i + _ROWS_PER_INSERT]
            marks = _row_marks(width, len(part))
            self.con.execute(head + marks, list(chain.from_iterable(part)))

    def add_step(self, step: int, level: int, skipped: bool, state: str | None) -> None:
        """One step's row, timed now."""
        self.add_steps([(step, level, int(skipped), time.time(), state)])

    def add_steps(self, rows: Iterable[tuple[int, int, int, float, str | None]]) -> None:
        """Rows of (step, level, skipped, time, state): steps held for a group commit keep the
        time they were written at, not the commit's."""
        self._insert_rows("INSERT OR REPLACE INTO steps(step, level, skipped, time, state) VALUES ", 5, rows)

    def add_scalars(self, rows: Iterable[tuple[int, str, float | None]]) -> None:
        self._insert_rows("INSERT OR REPLACE INTO scalars(step, name, value) VALUES ", 3, rows)

    def set_meta(self, key: str, value: Any) -> None:
        self.con.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def meta_text(self, key: str) -> str | None:
        """The stored (JSON) text of meta ``key`` as this transaction sees it; None if absent."""
        row = self.con.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def drop_tensors(self, step: int, kinds: Sequence[str]) -> None:
        """Remove the tensor rows of ``kinds`` at ``step`` and the blob rows nothing else names
        (a re-execution written back again replaces the earlier one: reexec/writeback.py). Their
        bytes stay in their segment, unreferenced, as after a resume."""
        marks = ",".join("?" * len(kinds))
        where = f"FROM tensors WHERE step = ? AND series IN (SELECT id FROM series WHERE kind IN ({marks}))"
        blobs = [b for (b,) in self.con.execute(f"SELECT blob {where} AND blob IS NOT NULL", (step, *kinds))]
        self.con.execute(f"DELETE {where}", (step, *kinds))
        for b in blobs:
            self.con.execute("DELETE FROM blobs WHERE id = ? AND NOT EXISTS (SELECT 1 FROM tensors WHERE blob = ?) "
                             "AND NOT EXISTS (SELECT 1 FROM blobs WHERE base = ?)", (b, b, b))

    def drop_empty_series(self, kinds: Sequence[str]) -> None:
        """Remove the series of ``kinds`` no tensor row names any more (and forget their ids)."""
        marks = ",".join("?" * len(kinds))
        self.con.execute(f"DELETE FROM series WHERE kind IN ({marks}) AND NOT EXISTS "
                         "(SELECT 1 FROM tensors t WHERE t.series = series.id)", tuple(kinds))
        kept = {i for (i,) in self.con.execute("SELECT id FROM series")}
        self.series_generation += 1
        self._series = {k: i for k, i in self._series.items() if i in kept}
        _drop_orphan_fp_kinds(self.con)
        self._fp_kinds = {s: k for s, k in self._fp_kinds.items() if s in kept}

    def abort(self) -> None:
        """Drop everything since the last commit and close (a write that failed half-way)."""
        try:
            self.con.execute("ROLLBACK")
        finally:
            self.con.close()

    def commit(self) -> None:
        """Make everything since the last commit visible, atomically."""
        self.con.execute("COMMIT")
        self.con.execute("BEGIN")

    def rollback(self) -> None:
        """Drop everything since the last commit (the rows of a step that failed half-way)."""
        self.con.execute("ROLLBACK")
        self._load_ids()
        self.con.execute("BEGIN")

    def close(self) -> None:
        """Commit, and leave the catalog in rollback-journal mode if no reader has it open.

        In WAL mode even a read-only reader must create ``-shm`` beside the catalog: a
        finished run could not be read from a read-only mount or by another user. A
        reader that has the catalog open (in WAL mode) keeps it there, and the switch
        is skipped rather than waited for; such a run keeps its -wal and -shm files.
        """
        try:
            self.con.execute("COMMIT")
            self.con.execute("PRAGMA busy_timeout=0")
            try:
                self.con.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.DatabaseError as e:  # "database is locked" (a live reader), a full disk: keep WAL
                log.debug("stepdump: catalog stays in WAL mode (%s)", e)
        finally:
            self.con.close()


def snapshot_catalog(run_dir: Path, dest: Path) -> None:
    """Copy the committed state of ``run_dir``'s catalog to ``dest`` (a self-contained file).

    SQLite's backup API reads one consistent snapshot while the writer goes on
    committing; the copy is switched to a rollback journal so that it is one
    file, with no -wal beside it.
    """
    src = sqlite3.connect(f"file:{run_dir / CATALOG_FILE}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(dest)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
    finally:
        src.close()
