"""The catalog's schema and the files around it: what a writer creates and a reader accepts.

Torch-free and query-free: the writer (:mod:`stepdump.store.catalog`), the reader's
connection (:mod:`stepdump.store.catalog_read`) and its queries
(:mod:`stepdump.store.queries`) all build on this.
"""

from __future__ import annotations

import functools
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from stepdump.store.format import CATALOG_FILE, FP_KIND_XXH3
from stepdump.store.plainfile import check_plain

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

# The fingerprint kind of each series whose fingerprints are not xxh3 (FORMAT.md, "Fingerprint
# kinds"). Only a store with such a series has the table, and it is format 2: older stores and
# their schema stay as they were, and a reader that predates the table refuses the store by its
# version instead of reading a dmix64 value as an xxh3 one. A series absent from it is xxh3.
FP_KINDS_TABLE = "fp_kinds"
FP_KINDS_SCHEMA = (f"CREATE TABLE {FP_KINDS_TABLE}(series INTEGER PRIMARY KEY REFERENCES series(id), "
                   "kind TEXT NOT NULL)")
# Stats-only rows stored as columns (store/stat_chunk.py, FORMAT.md "Stat chunks"): one chunk per
# commit, its step range indexed. Only a format-3 store has the table (an older reader refuses the
# store by its version instead of missing its lean rows).
STAT_CHUNKS_TABLE = "stat_chunks"
STAT_CHUNKS_SCHEMA = (
    f"CREATE TABLE {STAT_CHUNKS_TABLE}(id INTEGER PRIMARY KEY, first_step INTEGER NOT NULL, "
    "last_step INTEGER NOT NULL, rows INTEGER NOT NULL, checksum INTEGER NOT NULL, data BLOB NOT NULL)")
STAT_CHUNKS_INDEX = f"CREATE INDEX stat_chunks_by_step ON {STAT_CHUNKS_TABLE}(last_step, first_step)"
# The kind of a series absent from fp_kinds (and of every series of a store without the table).
DEFAULT_FP_KIND = FP_KIND_XXH3

STAT_COLUMNS = ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "norm", "zero_frac")


@dataclass(frozen=True)
class BlobRow:
    """Where a blob's bytes are and how to decode them (one ``blobs`` row, its segment resolved)."""

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


TABLES = ("meta", "series", "segments", "blobs", "steps", "tensors", "scalars", FP_KINDS_TABLE, STAT_CHUNKS_TABLE)


@functools.lru_cache(maxsize=1)
def expected_schema() -> tuple[frozenset[tuple[str, str, str, str | None]], dict[str, set[str]]]:
    """sqlite_master of a catalog the writer creates: (type, name, table, SQL text); and each table's columns.

    ``fp_kinds`` and ``stat_chunks`` are in it: a format-2 catalog has the first, a format-3 one
    both, an older one neither (the reader checks that against the version,
    ``catalog_read._check_schema``)."""
    con = sqlite3.connect(":memory:")
    try:
        con.executescript(SCHEMA)
        con.execute(FP_KINDS_SCHEMA)
        con.execute(STAT_CHUNKS_SCHEMA)
        con.execute(STAT_CHUNKS_INDEX)
        columns = {t: {c for (c,) in con.execute("SELECT name FROM pragma_table_xinfo(?)", (t,))} for t in TABLES}
        return frozenset(con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")), columns
    finally:
        con.close()

