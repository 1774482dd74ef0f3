"""The SQLite catalog: the index of a run (steps, series, blobs, stats, scalars).

One writer (the recorder's writer thread) and any number of readers. WAL mode
lets readers see every committed step while the writer goes on; a step's rows
are written in one transaction after its blobs are on disk, so a step is either
entirely visible or not at all.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdump.errors import CorruptDataError, FormatVersionError, NotARunError
from stepdump.store.format import CATALOG_FILE, FORMAT_VERSION

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


def create(run_dir: Path, meta: dict[str, Any]) -> None:
    """Create a new catalog with ``meta`` (values JSON-encoded)."""
    con = sqlite3.connect(catalog_path(run_dir))
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(SCHEMA)
        with con:
            con.executemany(
                "INSERT INTO meta(key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in {"format_version": FORMAT_VERSION, **meta}.items()],
            )
    finally:
        con.close()


def connect_reader(run_dir: str | Path) -> sqlite3.Connection:
    """Open a run's catalog for reading, checking that it is one we understand."""
    path = catalog_path(run_dir)
    if not Path(run_dir).exists():
        raise NotARunError(f"{run_dir} does not exist; give the directory a Recorder wrote to")
    if not path.is_file():
        raise NotARunError(
            f"{run_dir} is not a stepdump run (no {CATALOG_FILE} in it); "
            "give the directory a Recorder wrote to"
        )
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        con.execute("PRAGMA query_only=ON")
        rows = dict(con.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as e:
        raise CorruptDataError(f"{path} is not a readable stepdump catalog: {e}") from e
    _check_version(rows, path)
    return con


def _check_version(meta_rows: dict[str, str], path: Path) -> int:
    try:
        version = int(json.loads(meta_rows["format_version"]))
    except (KeyError, ValueError, TypeError):
        raise CorruptDataError(f"{path} has no valid format_version; it is not a stepdump catalog") from None
    if version != FORMAT_VERSION:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        raise FormatVersionError(
            f"{path.parent} uses store format {version}, written by {newer} stepdump; this stepdump "
            f"reads format {FORMAT_VERSION}. Install a stepdump release that reads format {version}."
        )
    return version


def read_meta(con: sqlite3.Connection) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}


class CatalogWriter:
    """The writer thread's connection. Not thread-safe: one thread owns it."""

    def __init__(self, run_dir: Path, synchronous: str = "NORMAL") -> None:
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
        try:
            self.con.execute("COMMIT")
        finally:
            self.con.close()
