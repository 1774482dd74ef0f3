"""Hostile catalogs, and reading without write permission (issue 16).

* A catalog whose schema computes (generated columns, triggers, indexes on
  expressions, collations, CHECKs, defaults with expressions, extra objects) is
  refused on open, before SQLite evaluates any of it; Hypothesis builds such
  catalogs and every open + read must stay within a time and memory bound.
* A finished run opens without write permission on its directory (a read-only
  bind mount as root, and another user through ``setpriv``), also while a reader
  watches a Recorder live.

Links, hard links and FIFOs planted in a shared run directory (``LOCK``, the
catalog's side files, ``segments/``): tests/test_reliability_shared_dir.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import copy_run, record_run, tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability.procs import tensor_hash

import stepdump
from stepdump.errors import StepdumpError

pytestmark = pytest.mark.timeout(300)
GOLDEN = Path(__file__).parent / "golden" / "v1_run"
HEAVY = "length(hex(zeroblob(30000000)))"  # 30 MB zeros, 60 MB of hex: each time SQLite evaluates it


# -- a small store, and what reading it must give ---------------------------------------------------


def _truth(path: Path) -> dict:
    with stepdump.open(path) as run:
        out = {"all_steps": run.all_steps, "steps": run.steps, "scalars": run.scalars().to_dict()}
        for kind in ("params", "grads", "optimizer"):
            out[kind] = run.names(kind)
        out["tensors"] = [(kind, n, t) for t in run.steps for (kind, n) in run.fingerprints(t)]
        for kind, n, t in out["tensors"]:
            out[(kind, n, t)] = tensor_hash(run.tensor(n, t, kind=kind))
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(path, truth) of a finished run, as its Recorder left it (the truth is read from a copy:
    reading must not be what makes the original readable)."""
    path = record_run(tmp_path_factory.mktemp("clean") / "run", steps=4)
    return path, _truth(copy_run(path, tmp_path_factory.mktemp("truth") / "run"))


def _sql(path: Path, *statements: str, writable_schema: bool = False) -> None:
    con = sqlite3.connect(path / "catalog.sqlite", isolation_level=None)
    try:
        if writable_schema:  # edit the schema text itself, as a hostile writer can
            version = con.execute("PRAGMA schema_version").fetchone()[0]
            con.execute("PRAGMA writable_schema=ON")
        for s in statements:
            con.execute(s)
        if writable_schema:
            con.execute(f"PRAGMA schema_version={version + 1}")
    finally:
        con.close()


def _retable(path: Path, table: str, edit: Callable[[str], str]) -> None:
    """Rewrite ``table``'s CREATE text (the rows stay as they are)."""
    con = sqlite3.connect(path / "catalog.sqlite")
    try:
        (sql,) = con.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    finally:
        con.close()
    new = edit(sql).replace("'", "''")
    _sql(path, f"UPDATE sqlite_master SET sql = '{new}' WHERE name = '{table}'", writable_schema=True)


def _peak_rss_reset() -> Callable[[], int]:
    """Bytes of resident memory the process peaked at above now, measured from here on
    (SQLite allocates outside Python's allocator, so tracemalloc would not see it)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")
    base = status("VmRSS:")
    return lambda: status("VmHWM:") - base


# -- 1. a schema that computes is refused on open -----------------------------------------------------

LEVEL_GENERATED = ("steps", lambda s: s.replace("level INTEGER NOT NULL",
                                                 f"level INTEGER AS (2 + 0 * {HEAVY}) VIRTUAL"))
HOSTILE_SCHEMAS = {
    "a generated column in place of steps.level (the issue)": [LEVEL_GENERATED],
    "a generated column added to steps": [
        "ALTER TABLE steps ADD COLUMN g AS (hex(zeroblob(200000000 + step))) VIRTUAL"],
    "a stored generated column": [("scalars", lambda s: s.replace("value REAL", f"value REAL AS ({HEAVY}) STORED"))],
    "a trigger": ["CREATE TRIGGER t AFTER INSERT ON scalars BEGIN SELECT hex(zeroblob(1000000000)); END"],
    "an index on an expression": ["CREATE INDEX e ON steps(abs(step))"],
    "a partial index": ["CREATE INDEX p ON steps(step) WHERE level > 0"],
    "a collation": [("series", lambda s: s.replace("name TEXT NOT NULL", "name TEXT NOT NULL COLLATE NOCASE"))],
    "a CHECK constraint": [("steps", lambda s: s.replace("state TEXT)", f"state TEXT, CHECK ({HEAVY} > 0))"))],
    "a default with an expression": [
        ("steps", lambda s: s.replace("time REAL NOT NULL", f"time REAL NOT NULL DEFAULT ({HEAVY})"))],
    "an extra column": ["ALTER TABLE series ADD COLUMN extra TEXT"],
    "an extra table": ["CREATE TABLE extra(x AS (1) VIRTUAL, y)"],
    "an extra view": ["CREATE VIEW extra AS SELECT * FROM steps"],
    "a missing table": ["DROP TABLE scalars"],
}


def _hostile(path: Path, edits: list) -> None:
    for e in edits:
        if isinstance(e, str):
            _sql(path, e)
        else:
            _retable(path, *e)


@pytest.mark.parametrize("what", sorted(HOSTILE_SCHEMAS))
def test_a_catalog_whose_schema_computes_is_refused_on_open(clean, tmp_path, what):
    path = copy_run(clean[0], tmp_path / "run")
    _hostile(path, HOSTILE_SCHEMAS[what])
    peak = _peak_rss_reset()
    with pytest.raises(stepdump.CorruptDataError, match="not a stepdump catalog") as e:
        stepdump.open(path)
    assert peak() < 32 << 20  # every hostile expression here allocates 30 MB or more: none ran
    assert "stepdump" in str(e.value) and "refus" in str(e.value)


def test_the_refusal_says_what_computes(clean, tmp_path):
    path = copy_run(clean[0], tmp_path / "run")
    _hostile(path, HOSTILE_SCHEMAS["a generated column added to steps"])
    with pytest.raises(stepdump.CorruptDataError, match="generated column 'g'"):
        stepdump.open(path)
    path = copy_run(clean[0], tmp_path / "run")
    _hostile(path, HOSTILE_SCHEMAS["a trigger"])
    with pytest.raises(stepdump.CorruptDataError, match="trigger 't'"):
        stepdump.open(path)


def test_legit_stores_still_open(clean, tmp_path):
    for src in (clean[0], GOLDEN):
        with stepdump.open(copy_run(src, tmp_path / "run")) as run:
            assert run.steps and stepdump.verify(run).ok


# -- 1b. schema-aware fuzzing: open + read everything, within bounds -----------------------------------

_COLUMNS = {"steps": ["level", "skipped", "time", "state"], "series": ["kind", "name", "param", "key"],
            "scalars": ["name", "value"], "tensors": ["dtype", "shape", "blob", "fingerprint"],
            "blobs": ["segment", "offset", "length", "codec", "checksum"], "meta": ["value"],
            "segments": ["key"]}
_TABLE = st.sampled_from(sorted(_COLUMNS))
_EXPR = st.one_of(st.just(HEAVY), st.sampled_from(  # half of them heavy
    ["0", "abs(-1)", "random()", "length(hex(randomblob(100000)))", "no_such_function(1)"]))
SCHEMA_EDIT = st.one_of(
    st.tuples(st.just("generated"), _TABLE, st.integers(0, 3), _EXPR, st.sampled_from(["VIRTUAL", "STORED"])),
    st.tuples(st.just("virtual_append"), _TABLE, _EXPR),
    st.tuples(st.just("trigger"), _TABLE, st.sampled_from(["INSERT", "UPDATE", "DELETE"]), _EXPR),
    st.tuples(st.just("expr_index"), _TABLE, st.integers(0, 3), st.booleans()),
    st.tuples(st.just("collate"), _TABLE, st.integers(0, 3), st.sampled_from(["NOCASE", "RTRIM", "evil"])),
    st.tuples(st.just("check"), _TABLE, _EXPR),
    st.tuples(st.just("default"), _TABLE, st.integers(0, 3), _EXPR),
    st.tuples(st.just("extra_column"), _TABLE, st.sampled_from(["TEXT", "INTEGER DEFAULT 7", "BLOB"])),
    st.tuples(st.just("extra_object"), st.sampled_from(["table", "view", "index"])),
    st.tuples(st.just("rename_column"), _TABLE, st.integers(0, 3)),
)


def _apply_schema_edit(path: Path, m) -> None:
    kind, table = m[0], m[1] if len(m) > 1 else None
    cols = _COLUMNS.get(table, [])

    def col(i: int) -> str:
        return cols[i % len(cols)]

    def column_def(sql: str, c: str, extra: str) -> str:
        # "name TYPE" up to the next comma, closing parenthesis or comment: append to it
        start = sql.index(f"\n  {c} ") if f"\n  {c} " in sql else sql.index(f" {c} ")
        end = min(i for i in (sql.find(",", start), sql.find(")", start), sql.find("--", start)) if i > 0)
        return sql[:end] + extra + sql[end:]

    try:
        if kind == "virtual_append":
            _sql(path, f"ALTER TABLE {table} ADD COLUMN g AS ({m[2]}) VIRTUAL")
        elif kind == "generated":  # a stored column becomes computed: the rows' fields shift too
            c = col(m[2])
            _retable(path, table, lambda s: column_def(s, c, f" AS ({m[3]}) {m[4]}").replace(" NOT NULL AS", " AS"))
        elif kind == "trigger":
            _sql(path, f"CREATE TRIGGER tr AFTER {m[2]} ON {table} BEGIN SELECT {m[3]}; END")
        elif kind == "expr_index":
            where = f" WHERE {col(m[2])} IS NOT NULL" if m[3] else ""
            _sql(path, f"CREATE INDEX ix ON {table}(abs({col(m[2])})){where}")
        elif kind == "collate":
            c = col(m[2])
            _retable(path, table, lambda s: column_def(s, c, f" COLLATE {m[3]}"))
        elif kind == "check":
            _retable(path, table, lambda s: s[: s.rindex(")")] + f", CHECK ({m[2]} IS NOT NULL))")
        elif kind == "default":
            c = col(m[2])
            _retable(path, table, lambda s: column_def(s, c, f" DEFAULT ({m[3]})"))
        elif kind == "extra_column":
            _sql(path, f"ALTER TABLE {table} ADD COLUMN extra {m[2]}")
        elif kind == "extra_object":
            _sql(path, {"table": f"CREATE TABLE extra(x, y AS ({HEAVY}))",
                        "view": "CREATE VIEW extra AS SELECT * FROM steps",
                        "index": "CREATE INDEX extra ON scalars(value)"}[m[1]])
        elif kind == "rename_column":
            _sql(path, f"ALTER TABLE {table} RENAME COLUMN {col(m[2])} TO renamed")
    except (sqlite3.DatabaseError, ValueError):  # ValueError: an earlier edit renamed the column
        pass  # SQLite would not build it (a constraint, an earlier edit): fine, the store stays as it is


def _nan_equal(a: object, b: object) -> bool:
    """``a == b`` where a NaN equals a NaN (the scalars frame's holes are NaN floats, a new object
    each read, and ``nan == nan`` is False)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def _read_all(path: Path, truth: dict) -> str:
    """Every read either returns what the clean store holds or raises a stepdump error."""
    try:
        run = stepdump.open(path)
    except StepdumpError:
        return "refused on open"
    outcome = "read as the clean store"
    with run:
        def check(key, fn):
            nonlocal outcome
            try:
                got = fn()
            except StepdumpError:
                outcome = "stepdump error on a read"
                return
            assert _nan_equal(got, truth[key]), f"{key} read back wrong"

        check("all_steps", lambda: run.all_steps)
        check("steps", lambda: run.steps)
        check("scalars", lambda: run.scalars().to_dict())
        for kind in ("params", "grads", "optimizer"):
            check(kind, lambda: run.names(kind))
        for kind, n, t in truth["tensors"]:
            check((kind, n, t), lambda: tensor_hash(run.tensor(n, t, kind=kind)))
        with contextlib.suppress(StepdumpError):
            run.stats()
        stepdump.verify(run)
    return outcome


@settings(max_examples=int(os.environ.get("STEPDUMP_FUZZ_EXAMPLES", "60")), deadline=None,
          derandomize=not os.environ.get("STEPDUMP_FUZZ_RANDOM"), database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.lists(SCHEMA_EDIT, min_size=1, max_size=3))
@example(edits=[("generated", "steps", 0, HEAVY, "VIRTUAL")])  # the store: steps.level computed
@example(edits=[("generated", "blobs", 1, HEAVY, "VIRTUAL"), ("collate", "series", 1, "NOCASE")])
def test_fuzzed_schemas_read_as_the_clean_store_or_raise_within_bounds(clean, tmp_path_factory, edits):
    src, truth = clean
    path = copy_run(src, tmp_path_factory.getbasetemp() / "schema-fuzz")
    for m in edits:
        _apply_schema_edit(path, m)
    peak = _peak_rss_reset()
    _read_all(path, truth)
    grew = peak()  # HEAVY, the only costly expression, allocates 90 MB each time SQLite evaluates it
    assert grew < 48 << 20, f"open + reads peaked {grew >> 20} MiB above the start: SQLite computed something"


# -- 2. read-only: a finished run needs read permission only --------------------------------------------


@contextlib.contextmanager
def _read_only_mount(src: Path, where: Path):
    """``src`` seen read-only at ``where`` (a bind mount: root cannot write through it either)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a read-only bind mount needs root and mount(8)")
    where.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True).returncode:
        pytest.skip("this sandbox cannot bind-mount")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(where)], check=True, capture_output=True)
        with pytest.raises(OSError):
            (where / "probe").touch()
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _reads_like(path: Path, truth: dict) -> None:
    with stepdump.open(path) as run:
        assert run.all_steps == truth["all_steps"] and not run.live
        for kind, n, t in truth["tensors"]:
            assert tensor_hash(run.tensor(n, t, kind=kind)) == truth[(kind, n, t)]
        assert stepdump.verify(run).ok


def test_a_clean_close_leaves_a_catalog_that_needs_no_side_files(clean):
    """Rollback-journal mode (header bytes 18-19 are 1, WAL would be 2): a reader creates nothing."""
    assert sorted(p.name for p in clean[0].iterdir()) == ["LOCK", "catalog.sqlite", "segments", "stats.parquet"]
    assert (clean[0] / "catalog.sqlite").read_bytes()[18:20] == b"\x01\x01"


def test_a_finished_run_opens_on_a_read_only_mount(clean, tmp_path, cli):
    src, truth = clean
    with _read_only_mount(copy_run(src, tmp_path / "run"), tmp_path / "ro") as ro:
        _reads_like(ro, truth)
        assert "closed" in cli("info", ro).stdout


def test_an_older_run_left_in_wal_mode_opens_on_a_read_only_mount(tmp_path):
    """The golden store predates the clean-close switch: WAL mode, no -wal or -shm beside it."""
    with _read_only_mount(copy_run(GOLDEN, tmp_path / "run"), tmp_path / "ro") as ro:
        with stepdump.open(ro) as run:
            assert run.steps and stepdump.verify(run).ok


def test_a_run_closed_under_a_live_reader_opens_on_a_read_only_mount(tmp_path):
    """The Recorder cannot leave WAL mode while a reader has the catalog open: the run
    keeps -wal and -shm, and SQLite reads them read-only."""
    path = tmp_path / "run"
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(path, model, opt) as rec:
        live = stepdump.open(path)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            rec.log(loss=1.0)
        assert live.live
    assert live.all_steps == [0, 1, 2, 3] and not live.live  # 3: the final record close() wrote
    truth = {"all_steps": [0, 1, 2, 3], "tensors": []}
    with _read_only_mount(path, tmp_path / "ro") as ro:
        _reads_like(ro, truth)
        with stepdump.open(ro) as run:
            assert run.meta["final_step"] == 3 and run.tensors(3, "grads") == {}
    live.close()


def test_a_wal_that_cannot_be_read_read_only_is_a_clear_error(clean, tmp_path):
    """Committed steps still in -wal with no -shm: SQLite needs to create -shm to read them."""
    path = copy_run(clean[0], tmp_path / "run")
    _sql(path, "PRAGMA journal_mode=WAL")
    con = sqlite3.connect(path / "catalog.sqlite", isolation_level=None)
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO scalars VALUES (99, 'x', 1.0)")
    shutil.copy(path / "catalog.sqlite-wal", tmp_path / "wal")
    con.close()
    shutil.copy(tmp_path / "wal", path / "catalog.sqlite-wal")  # as if only catalog + -wal were copied
    (path / "catalog.sqlite-shm").unlink(missing_ok=True)
    with _read_only_mount(path, tmp_path / "ro") as ro:
        with pytest.raises(stepdump.CorruptDataError, match="copy the run"):
            stepdump.open(ro)


def test_a_reader_sees_a_resumed_recording_of_a_closed_run(clean, tmp_path):
    """A reader opened on a closed (rollback-journal) catalog follows a Recorder that
    resumes the run (back in WAL mode), and still reads after it closes."""
    path = copy_run(clean[0], tmp_path / "run")
    run = stepdump.open(path)
    try:
        n = len(run.all_steps)
        torch.manual_seed(0)
        model = tiny_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        with stepdump.Recorder(path, model, opt, scheduler=sched, resume=True):
            for _ in range(2):
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
            deadline = time.monotonic() + 30
            while run.all_steps[-1] < n and time.monotonic() < deadline:  # the writer thread commits
                time.sleep(0.01)
            assert run.all_steps[-1] >= n and run.live
        assert len(run.all_steps) == n + 2 and not run.live
        assert stepdump.verify(run).ok
    finally:
        run.close()


def test_another_user_without_write_permission_reads_a_finished_run(clean):
    """Not as root: a user who may read the run but not write its directory."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv(1) to become another user")
    src, truth = clean
    top = Path(tempfile.mkdtemp(prefix="stepdump-ro-"))
    try:
        run = copy_run(src, top / "run")
        for p in [top, run, *run.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # readable by all, writable by root only
        code = ("import stepdump; r = stepdump.open(%r); print(r.all_steps, r.live, stepdump.verify(r).ok)" % str(run))
        # CAP_DAC_READ_SEARCH: `nobody` may read (and traverse to) anything, this checkout and its
        # .venv too wherever they live (a 0700 temp dir in a fresh clone), but write nothing.
        out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", sys.executable,
                              "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[0] == f"{truth['all_steps']} False True"
        assert sorted(p.name for p in run.iterdir()) == ["LOCK", "catalog.sqlite", "segments", "stats.parquet"]
    finally:
        shutil.rmtree(top)


def test_a_run_whose_path_has_uri_characters_opens(clean, tmp_path):
    """The catalog is opened by URI: '?', '#' and '%' in the path must not end or change its name."""
    path = copy_run(clean[0], tmp_path / "we?ird #dir%20x" / "run")
    with stepdump.open(path) as run:
        assert run.all_steps == clean[1]["all_steps"]


def test_resuming_a_run_on_a_read_only_mount_is_a_clear_error(clean, tmp_path):
    """A Recorder needs write access: a read-only run is a stepdump error that says so, not an OSError."""
    from helpers import tiny_model

    src, truth = clean
    with _read_only_mount(copy_run(src, tmp_path / "run"), tmp_path / "ro") as ro:
        model = tiny_model()
        with pytest.raises(stepdump.ConfigError, match="cannot record into .*write access"):
            stepdump.Recorder(ro, model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True)
        _reads_like(ro, truth)  # and the run is as it was
