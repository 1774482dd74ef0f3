"""A reader's connection to a run's catalog: opened read-only, schema and version checked.

Catalogs are untrusted input: a reader refuses any schema object the writer does
not create (``_check_schema``), since SQLite evaluates generated columns, and the
like, on every read. Every failure of a query is a stepdump error (:class:`ReadConnection`).
Only :mod:`stepdump.store.queries` runs queries through it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stepdump.errors import CorruptDataError, FormatVersionError, InterruptedWriteError, NotARunError
from stepdump.store import bounded_json
from stepdump.store.format import (
    CATALOG_FILE,
    FORMAT_VERSION,
    FP_KINDS_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    STAT_CHUNKS_FORMAT_VERSION,
)
from stepdump.store.lock import is_locked
from stepdump.store.schema import (
    FP_KINDS_TABLE,
    STAT_CHUNKS_TABLE,
    TABLES,
    catalog_path,
    check_side_files,
    expected_schema,
)

log = logging.getLogger(__name__)

# SQLite's "the database needs a rollback (a hot journal) and this connection is read-only".
SQLITE_READONLY_ROLLBACK = 776


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
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != SQLITE_READONLY_ROLLBACK:
                raise self._damaged(e) from e
            # A writer was killed mid-transaction since this connection opened (a reader
            # following a run whose resumed Recorder died while dropping steps).
            roll_back_interrupted_write(self.path, e)
            try:
                return Rows(self._con.execute(sql, params).fetchall())
            except (sqlite3.DatabaseError, UnicodeDecodeError) as again:
                raise self._damaged(again) from again
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:  # the latter: TEXT that is not UTF-8
            raise self._damaged(e) from e

    def _damaged(self, e: BaseException) -> CorruptDataError:
        return _unreadable(self.path, e)

    def close(self) -> None:
        self._con.close()

    def __del__(self) -> None:
        # A sqlite3 connection sits in a reference cycle (its statement cache), so it would stay
        # open until the cyclic GC runs; a reader no one holds any more (a rank store that a
        # DistributedRun dropped, see read/ranked.py max_open) closes its file now.
        try:
            self._con.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown, a connection already gone
            pass


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
        # The version first, from the meta table alone (its schema checked, so reading it evaluates
        # nothing else): a newer store, whose schema this stepdump cannot know, gets the "newer
        # format" error rather than "not a stepdump catalog".
        _check_schema(reader, path, only="meta")
        rows = dict(reader.execute("SELECT key, value FROM meta"))
        version = _check_version(rows, path)
        _check_schema(reader, path, version=version)
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
    uri = _uri(path)
    try:
        try:
            return _probe(sqlite3.connect(uri + "?mode=ro", uri=True, check_same_thread=False))
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != SQLITE_READONLY_ROLLBACK:
                raise
            roll_back_interrupted_write(path, e)  # a writer killed mid-transaction: SQLite's own recovery
            return _probe(sqlite3.connect(uri + "?mode=ro", uri=True, check_same_thread=False))
    except sqlite3.OperationalError as e:
        if getattr(e, "sqlite_errorcode", 0) & 0xFF not in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY):
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
    if not in_wal:  # a -journal that only a writer could roll back: what happened, never "damaged"
        raise _interrupted(path, cause) from cause
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


def _uri(path: Path) -> str:
    return "file:" + urllib.parse.quote(os.fsencode(path.absolute()))  # a '?' or '#' would end the name


def roll_back_interrupted_write(path: Path, cause: BaseException) -> None:
    """Roll back the write a killed process left half-done in catalog ``path`` (a hot rollback
    journal), or raise :class:`~stepdump.errors.InterruptedWriteError` saying how to.

    Only a connection that may write can roll a hot journal back (a read-only one gets
    SQLITE_READONLY_ROLLBACK, for every query). This is SQLite's own recovery, the one any
    read-write connection runs on open: the journal holds the pages the dead writer had begun
    to change, they are put back, and the catalog is as of its last committed transaction. It
    is safe while a Recorder writes: SQLite only treats a journal as hot when no process holds
    the catalog's write lock. The journal must be a plain file of the run (no link, FIFO, ...).
    """
    run_dir = path.parent
    journal = path.with_name(path.name + "-journal")
    if not (os.access(run_dir, os.W_OK) and os.access(path, os.W_OK)):
        raise _interrupted(path, cause) from cause
    check_side_files(path, single_link=True)
    try:
        con = sqlite3.connect(_uri(path) + "?mode=rw", uri=True, isolation_level=None, timeout=10)
        try:
            con.execute("PRAGMA trusted_schema=OFF")
            con.execute("SELECT count(*) FROM sqlite_master").fetchall()  # the read lock: the rollback
        finally:
            con.close()
    except sqlite3.DatabaseError as e:  # e.g. a read-only file system despite access(2)
        raise _interrupted(path, e) from e
    log.warning("stepdump: %s: rolled back a write to its catalog that a killed process left unfinished "
                "(%s); the run is as of its last committed transaction, nothing committed is lost",
                run_dir, journal.name)


def _interrupted(path: Path, cause: BaseException) -> InterruptedWriteError:
    run_dir = path.parent
    return InterruptedWriteError(
        f"{run_dir} was interrupted in the middle of a write to its catalog: {path.name}-journal holds the "
        "pages a killed process (a Recorder, e.g. one resuming the run and dropping steps) had begun to "
        f"change, and SQLite must put them back before the run can be read. That needs write access to "
        f"{run_dir}, which this process does not have ({cause}). Nothing committed is lost: open the run "
        f"once as a user who can write {run_dir} (stepdump.open or any stepdump command does it, e.g. "
        "`stepdump verify RUN`), or copy the whole run directory, the -journal file included, somewhere "
        "writable and open the copy"
    )


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


def _check_schema(con: ReadConnection, path: Path, *, only: str | None = None, version: int = 1) -> None:
    """The schema must be exactly the writer's, object by object and to the letter.

    ``only``: check the objects of that table alone (the meta table, read before the version is
    known). ``version``: a format-2 catalog has the ``fp_kinds`` table, a format-1 one must not.

    SQLite evaluates schema expressions while reading: a generated column (``level``
    computed as ``hex(zeroblob(200000000))``) on every row a query touches, a view
    (an endless recursive one) on every query. ``trusted_schema=OFF`` does not stop
    pure functions. Comparing the SQL text of every object refuses each of these,
    and triggers, indexes on expressions, CHECKs, defaults and collations with
    them, before any of it is evaluated: reading sqlite_master evaluates nothing.
    """
    expected = expected_schema()[0]
    if version < FP_KINDS_FORMAT_VERSION:
        expected = frozenset(r for r in expected if r[2] != FP_KINDS_TABLE)
    if version < STAT_CHUNKS_FORMAT_VERSION:
        expected = frozenset(r for r in expected if r[2] != STAT_CHUNKS_TABLE)
    found = {tuple(r) for r in con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")}
    if only is not None:
        expected = frozenset(r for r in expected if r[2] == only)
        found = {r for r in found if r[1] == only or r[2] == only}
    odd = sorted(found - expected, key=repr)
    missing = sorted({r[1] for r in expected if r[0] == "table"} - {r[1] for r in found if r[0] == "table"})
    if odd and odd[0][1] == FP_KINDS_TABLE and odd[0][0] == "table" and version < FP_KINDS_FORMAT_VERSION:
        raise CorruptDataError(
            f"{path} is not a stepdump catalog: it has a {FP_KINDS_TABLE!r} table but says store format {version}, "
            f"and that table exists only from format {FP_KINDS_FORMAT_VERSION} on (its fingerprints could be read "
            "under the wrong kind). stepdump is refusing to open it: treat the run as hostile, or record it again"
        )
    if odd and odd[0][1] == STAT_CHUNKS_TABLE and odd[0][0] == "table" and version < STAT_CHUNKS_FORMAT_VERSION:
        raise CorruptDataError(
            f"{path} is not a stepdump catalog: it has a {STAT_CHUNKS_TABLE!r} table but says store format {version}, "
            f"and that table exists only from format {STAT_CHUNKS_FORMAT_VERSION} on (a reader of format {version} "
            "would miss the stats it holds). stepdump is refusing to open it: treat the run as hostile, or record it again"
        )
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
        extra = [c for c, _ in cols if c not in expected_schema()[1][name]]
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
        version = int(bounded_json.loads(meta_rows["format_version"], "format_version"))
    except (KeyError, ValueError, TypeError, OverflowError, CorruptDataError):
        raise CorruptDataError(f"{path} has no valid format_version; it is not a stepdump catalog") from None
    if version not in READABLE_FORMAT_VERSIONS:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        readable = " and ".join(str(v) for v in READABLE_FORMAT_VERSIONS)
        raise FormatVersionError(
            f"{path.parent} uses store format {version}, written by {newer} stepdump; this stepdump "
            f"reads formats {readable} (up to {FORMAT_VERSION}). Install a stepdump release that reads format {version}."
        )
    return version


def read_meta(con: ReadConnection) -> dict[str, Any]:
    """The meta table, JSON-decoded; a value that is not JSON is damage, not a crash."""
    out: dict[str, Any] = {}
    for k, v in con.execute("SELECT key, value FROM meta"):
        if not isinstance(v, (str, bytes)):
            raise CorruptDataError(f"meta value {k!r} in the catalog is not valid JSON (a {type(v).__name__})")
        out[str(k)] = bounded_json.loads(v, f"meta value {k!r} in the catalog")
    return out


