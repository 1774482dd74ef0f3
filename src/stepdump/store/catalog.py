"""The SQLite catalog: the index of a run (steps, series, blobs, stats, scalars).

One writer (the recorder's writer thread) and any number of readers. WAL mode
lets readers see every committed step while the writer goes on; a step's rows
are written in one transaction after its blobs are on disk, so a step is either
entirely visible or not at all.

A Recorder that closes cleanly switches the catalog back to a rollback journal,
so that a finished run is a plain SQLite file that reads with read permission
only (WAL mode needs a writable ``-shm`` file beside it, even for a reader).

Catalogs are untrusted input: a reader refuses any schema object the writer does
not create (``_check_schema``), since SQLite evaluates generated columns, and the
like, on every read.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdump.errors import CorruptDataError, FormatVersionError, NotARunError
from stepdump.store.format import CATALOG_FILE, FORMAT_VERSION, SEGMENT_DIR
from stepdump.store.lock import is_locked
from stepdump.store.plainfile import check_plain, describe, refusal

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series(
  id INTEGER PRIMARY KEY,
  kind TEXT NOT NULL,
  name TEXT NOT NULL,
  param TEXT,            -- for kind 'optimizer': the parameter the state belongs to
  key TEXT,              -- for kind 'optimizer': the state key (exp_avg, step, ...)
  UNIQUE(kind, name));
CREATE TABLE segments(id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE);
CREATE TABLE blobs(
  id INTEGER PRIMARY KEY,
  segment INTEGER NOT NULL REFERENCES segments(id),
  offset INTEGER NOT NULL,
  length INTEGER NOT NULL,
  codec TEXT NOT NULL,
  raw_length INTEGER NOT NULL,
  checksum INTEGER NOT NULL,   -- xxh3-64 of the stored bytes, as signed int64
  base INTEGER);               -- blob this one is a delta against (NULL: self-contained)
CREATE TABLE steps(
  step INTEGER PRIMARY KEY,
  level INTEGER NOT NULL,      -- 0 scalars only, 1 stats, 2 full tensors
  skipped INTEGER NOT NULL,
  time REAL NOT NULL,
  state TEXT);                 -- typed JSON: param groups, scheduler, scaler, rng, ...
CREATE TABLE tensors(
  series INTEGER NOT NULL REFERENCES series(id),
  step INTEGER NOT NULL,
  dtype TEXT NOT NULL,
  shape TEXT NOT NULL,
  blob INTEGER REFERENCES blobs(id),
  numel INTEGER NOT NULL,
  nan INTEGER, posinf INTEGER, neginf INTEGER,
  min REAL, max REAL, mean REAL, std REAL, norm REAL, zero_frac REAL,
  fingerprint INTEGER NOT NULL, -- xxh3-64 of the raw tensor bytes, as signed int64
  PRIMARY KEY(series, step)) WITHOUT ROWID;
CREATE INDEX tensors_by_step ON tensors(step, series);
CREATE TABLE scalars(
  step INTEGER NOT NULL,
  name TEXT NOT NULL,
  value REAL,
  PRIMARY KEY(name, step)) WITHOUT ROWID;
"""

STAT_COLUMNS = ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "norm", "zero_frac")


@dataclass(frozen=True)
class TensorRow:
    """One tensor at one step as the catalog knows it."""

    kind: str
    name: str
    step: int
    dtype: str
    shape: str
    blob: int | None
    fingerprint: int
    param: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class BlobRow:
    id: int
    segment_key: str
    offset: int
    length: int
    codec: str
    raw_length: int
    checksum: int
    base: int | None


def catalog_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CATALOG_FILE


PARTIAL_SUFFIX = ".partial"
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")  # the files SQLite keeps beside a database


def check_side_files(cat: Path, *, single_link: bool) -> None:
    """SQLite opens the catalog's -wal, -shm and -journal for writing: each must be absent
    or a regular file (a link could aim those writes elsewhere, a FIFO would block)."""
    for suffix in SIDE_SUFFIXES:
        check_plain(cat.with_name(cat.name + suffix), "SQLite's files beside the catalog", single_link=single_link)


def check_writable_layout(run_dir: Path) -> None:
    """What a Recorder writes into must be what a Recorder made: the catalog and its side
    files regular files with one name, ``segments`` a directory (not a link out of the run)."""
    if not check_plain(catalog_path(run_dir), "the catalog"):
        raise NotARunError(f"{run_dir} has no {CATALOG_FILE}; it is not a stepdump run")
    check_side_files(catalog_path(run_dir), single_link=True)
    seg = run_dir / SEGMENT_DIR
    if seg.is_symlink() or (seg.exists() and not seg.is_dir()):
        raise refusal(seg, describe(os.lstat(seg)), "the folder of segment files", "a directory")


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
                [(k, json.dumps(v)) for k, v in {"format_version": FORMAT_VERSION, **meta}.items()],
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


class Rows(list):  # type: ignore[type-arg]
    """The rows of one query, fetched at once (what ``ReadConnection.execute`` returns)."""

    def fetchone(self) -> Any:
        return self[0] if self else None

    def fetchall(self) -> list[Any]:
        return list(self)


class ReadConnection:
    """A reader's catalog connection whose failures are stepdump errors.

    SQLite reports a damaged file (or one that is not a database) at whichever
    query first touches the damaged page. ``execute`` fetches every row inside
    its own ``try``, so such an error always surfaces here, as
    :class:`~stepdump.errors.CorruptDataError`, and never as ``sqlite3.DatabaseError``
    from deep inside an analysis function. Misuse of SQL (``ProgrammingError``)
    is a bug, not damage, and is left alone.
    """

    def __init__(self, con: sqlite3.Connection, path: Path) -> None:
        self._con = con
        self.path = path

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        try:
            return Rows(self._con.execute(sql, params).fetchall())
        except sqlite3.ProgrammingError:
            raise
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:  # the latter: TEXT that is not UTF-8
            raise CorruptDataError(
                f"{self.path} is not a readable stepdump catalog: {e} (the file is damaged, or not a "
                "stepdump catalog; `stepdump verify` checks a run)"
            ) from e

    def close(self) -> None:
        self._con.close()


def connect_reader(run_dir: str | Path) -> ReadConnection:
    """Open a run's catalog for reading, checking that it is one we understand."""
    path = catalog_path(run_dir)
    if not Path(run_dir).exists():
        raise NotARunError(f"{run_dir} does not exist; give the directory a Recorder wrote to")
    if not path.is_file():
        raise NotARunError(
            f"{run_dir} is not a stepdump run (no {CATALOG_FILE} in it); "
            "give the directory a Recorder wrote to"
        )
    if path.resolve().parent != Path(run_dir).resolve():
        raise CorruptDataError(f"refusing {path}: it is a link to a file outside the run directory")
    check_side_files(path, single_link=False)
    con = _connect_read_only(path, Path(run_dir))
    reader = ReadConnection(con, path)
    try:
        reader.execute("PRAGMA query_only=ON")
        reader.execute("PRAGMA trusted_schema=OFF")  # nothing in a store's schema runs with side effects
        _check_schema(reader, path)
        rows = dict(reader.execute("SELECT key, value FROM meta"))
        _check_version(rows, path)
    except BaseException:
        con.close()
        raise
    return reader


def _connect_read_only(path: Path, run_dir: Path) -> sqlite3.Connection:
    """Open the catalog read-only, needing read permission only.

    In WAL mode SQLite creates ``-shm`` beside the catalog even for a reader, which
    fails on a read-only mount or in another user's directory. Such a catalog with
    nothing in ``-wal`` and no Recorder writing it (a run from before clean closes
    left WAL mode) is opened ``immutable``: no locks, no side files, a snapshot that
    does not follow later writes. Immutable would ignore data in ``-wal``: an error.
    """
    uri = "file:" + urllib.parse.quote(os.fsencode(path.absolute()))  # a '?' or '#' would end the name
    try:
        return _probe(sqlite3.connect(uri + "?mode=ro", uri=True, check_same_thread=False))
    except sqlite3.OperationalError as e:
        if e.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY):
            raise _unreadable(path, e) from e
        cause = e
    except (sqlite3.DatabaseError, UnicodeDecodeError) as e:  # the latter: a message quoting bad bytes
        raise _unreadable(path, e) from e
    wal = path.with_name(path.name + "-wal")
    try:
        with open(path, "rb") as f:
            in_wal = f.read(20)[18:20] == b"\x02\x02"  # the header's read/write versions: 2 is WAL
    except OSError as e:
        raise CorruptDataError(f"cannot read {path}: {e}") from e
    if not in_wal and not path.with_name(path.name + "-journal").exists():
        raise _unreadable(path, cause) from cause
    if not in_wal:  # a hot journal: SQLite must roll it back into the catalog first
        raise CorruptDataError(
            f"{path} cannot be opened without write access to {run_dir} ({cause}): a write to it was cut off "
            "and SQLite must roll it back. Open the run once where its directory is writable, or copy the run "
            "directory somewhere writable and open the copy"
        ) from cause
    if wal.exists() and wal.stat().st_size > 0:
        raise CorruptDataError(
            f"{path}: committed steps are still in {wal.name}, which SQLite can read only by creating "
            f"{path.name}-shm, and {run_dir} is not writable ({cause}). The run was not closed cleanly or was "
            "copied without its -shm file: copy the run directory somewhere writable and open the copy"
        ) from cause
    if is_locked(run_dir):
        raise CorruptDataError(
            f"{run_dir} is being recorded, and its catalog cannot be opened without write access to the "
            f"directory ({cause}); open it as the user who records it, or once the Recorder has closed"
        ) from cause
    log.debug("stepdump: %s is not writable here; reading its catalog as an immutable snapshot", run_dir)
    try:
        return _probe(sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True, check_same_thread=False))
    except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from e


def _probe(con: sqlite3.Connection) -> sqlite3.Connection:
    """``con``, once SQLite has really opened the file (connect alone does not)."""
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except BaseException:
        con.close()
        raise
    return con


def _unreadable(path: Path, e: BaseException) -> CorruptDataError:
    return CorruptDataError(
        f"{path} is not a readable stepdump catalog: {e} (the file is damaged, or not a "
        "stepdump catalog; `stepdump verify` checks a run)"
    )


TABLES = ("meta", "series", "segments", "blobs", "steps", "tensors", "scalars")


@functools.lru_cache(maxsize=1)
def _expected_schema() -> tuple[frozenset[tuple[str, str, str, str | None]], dict[str, set[str]]]:
    """sqlite_master of a catalog the writer creates: (type, name, table, SQL text); and each table's columns."""
    con = sqlite3.connect(":memory:")
    try:
        con.executescript(SCHEMA)
        columns = {t: {c for (c,) in con.execute("SELECT name FROM pragma_table_xinfo(?)", (t,))} for t in TABLES}
        return frozenset(con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")), columns
    finally:
        con.close()


def _check_schema(con: ReadConnection, path: Path) -> None:
    """The schema must be exactly the writer's, object by object and to the letter.

    SQLite evaluates schema expressions while reading: a generated column (``level``
    computed as ``hex(zeroblob(200000000))``) on every row a query touches, a view
    (an endless recursive one) on every query. ``trusted_schema=OFF`` does not stop
    pure functions. Comparing the SQL text of every object refuses each of these,
    and triggers, indexes on expressions, CHECKs, defaults and collations with
    them, before any of it is evaluated: reading sqlite_master evaluates nothing.
    """
    expected = _expected_schema()[0]
    found = {tuple(r) for r in con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")}
    odd = sorted(found - expected, key=repr)
    missing = sorted({r[1] for r in expected if r[0] == "table"} - {r[1] for r in found if r[0] == "table"})
    if not odd and not missing:
        return
    what = _describe_object(con, odd[0]) if odd else f"it has no {missing[0]!r} table"
    raise CorruptDataError(
        f"{path} is not a stepdump catalog: {what}. stepdump is refusing to open it: a catalog stepdump wrote "
        "holds exactly stepdump's tables and indexes, and other schema objects could make SQLite compute (or "
        "allocate) without bound on every read. Treat the run as hostile, or record it again"
    )


def _describe_object(con: ReadConnection, row: tuple[Any, ...]) -> str:
    kind, name, table = row[0], row[1], row[2]
    if kind == "table" and name in TABLES:
        cols = con.execute("SELECT name, hidden FROM pragma_table_xinfo(?)", (name,))
        generated = [c for c, hidden in cols if hidden in (2, 3)]  # 2: virtual, 3: stored
        if generated:
            return f"table {name!r} has a generated column {generated[0]!r}"
        extra = [c for c, _ in cols if c not in _expected_schema()[1][name]]
        if extra:
            return f"table {name!r} has a column {extra[0]!r} that stepdump does not write"
        return f"table {name!r} is defined differently (a constraint, default or collation stepdump does not use)"
    if kind == "view" and name in TABLES:
        return f"{name!r} is a view, not a table"
    if kind in ("trigger", "index") and table in TABLES:
        return f"it has a {kind} {name!r} on {table!r} that stepdump does not create"
    return f"it has a {kind} {name!r} that stepdump does not create"


def _check_version(meta_rows: dict[str, str], path: Path) -> int:
    try:
        version = int(json.loads(meta_rows["format_version"]))
    except (KeyError, ValueError, TypeError, OverflowError, RecursionError):
        raise CorruptDataError(f"{path} has no valid format_version; it is not a stepdump catalog") from None
    if version != FORMAT_VERSION:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        raise FormatVersionError(
            f"{path.parent} uses store format {version}, written by {newer} stepdump; this stepdump "
            f"reads format {FORMAT_VERSION}. Install a stepdump release that reads format {version}."
        )
    return version


def read_meta(con: ReadConnection) -> dict[str, Any]:
    """The meta table, JSON-decoded; a value that is not JSON is damage, not a crash."""
    out: dict[str, Any] = {}
    for k, v in con.execute("SELECT key, value FROM meta"):
        try:
            out[str(k)] = json.loads(v)
        except (ValueError, TypeError, RecursionError) as e:
            raise CorruptDataError(f"meta value {k!r} in the catalog is not valid JSON ({e})") from e
    return out


class CatalogWriter:
    """The writer thread's connection. Not thread-safe: one thread owns it."""

    def __init__(self, run_dir: Path, synchronous: str = "NORMAL") -> None:
        check_writable_layout(run_dir)
        self.con = sqlite3.connect(catalog_path(run_dir), check_same_thread=False, isolation_level=None)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute(f"PRAGMA synchronous={synchronous}")
        self._series: dict[tuple[str, str], int] = {
            (k, n): i for i, k, n in self.con.execute("SELECT id, kind, name FROM series")
        }
        self._segments: dict[str, int] = {k: i for i, k in self.con.execute("SELECT id, key FROM segments")}
        self._next_blob = (self.con.execute("SELECT max(id) FROM blobs").fetchone()[0] or 0) + 1
        self.con.execute("BEGIN")

    def new_blob_id(self) -> int:
        """Blob ids are assigned here so a step's blob rows can be inserted in one batch."""
        bid = self._next_blob
        self._next_blob += 1
        return bid

    def add_blobs(self, rows: Iterable[Sequence[Any]]) -> None:
        """Rows of (id, segment id, offset, length, codec, raw_length, checksum, base)."""
        self.con.executemany(
            "INSERT INTO blobs(id, segment, offset, length, codec, raw_length, checksum, base) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )

    def last_step(self) -> int | None:
        row = self.con.execute("SELECT max(step) FROM steps").fetchone()
        return row[0]

    def series_id(self, kind: str, name: str, param: str | None = None, key: str | None = None) -> int:
        sid = self._series.get((kind, name))
        if sid is None:
            cur = self.con.execute(
                "INSERT INTO series(kind, name, param, key) VALUES (?, ?, ?, ?)", (kind, name, param, key)
            )
            sid = int(cur.lastrowid)  # type: ignore[arg-type]
            self._series[(kind, name)] = sid
        return sid

    def segment_id(self, key: str) -> int:
        sid = self._segments.get(key)
        if sid is None:
            cur = self.con.execute("INSERT INTO segments(key) VALUES (?)", (key,))
            sid = int(cur.lastrowid)  # type: ignore[arg-type]
            self._segments[key] = sid
        return sid

    def add_tensors(self, rows: Iterable[Sequence[Any]]) -> None:
        """Rows of (series, step, dtype, shape, blob, *STAT_COLUMNS, fingerprint)."""
        self.con.executemany(
            "INSERT OR REPLACE INTO tensors(series, step, dtype, shape, blob, numel, nan, posinf, neginf,"
            " min, max, mean, std, norm, zero_frac, fingerprint) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )

    def add_step(self, step: int, level: int, skipped: bool, state: str | None) -> None:
        self.con.execute(
            "INSERT OR REPLACE INTO steps(step, level, skipped, time, state) VALUES (?, ?, ?, ?, ?)",
            (step, level, int(skipped), time.time(), state),
        )

    def add_scalars(self, rows: Iterable[tuple[int, str, float | None]]) -> None:
        self.con.executemany("INSERT OR REPLACE INTO scalars(step, name, value) VALUES (?, ?, ?)", rows)

    def set_meta(self, key: str, value: Any) -> None:
        self.con.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def commit(self) -> None:
        """Make everything since the last commit visible, atomically."""
        self.con.execute("COMMIT")
        self.con.execute("BEGIN")

    def rollback(self) -> None:
        """Drop everything since the last commit (the rows of a step that failed half-way)."""
        self.con.execute("ROLLBACK")
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
