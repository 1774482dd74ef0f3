"""Flip bits, truncate files, mutate the catalog, fuzz the reader: errors, never wrong data, never a crash.

* Segment damage (bit flips, truncations) is found exactly: ``verify`` names
  every damaged blob and no other; reading a damaged tensor raises
  CorruptDataError and every other tensor reads back bit-exact.
* A damaged catalog.sqlite (flipped bits, truncated, not a database at all)
  gives stepdump errors, on open or later, never sqlite3 / Python errors.
* Hypothesis mutates copies of a small store (segment bytes, catalog rows via
  sqlite3 with absurd values, hostile segment keys, JSON state, blobs whose
  garbage carries a valid checksum, schema objects that compute) and runs every reader entry point: only
  StepdumpError subclasses may escape, each example within a time limit.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import record_run, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability.procs import tensor_hash

import stepdump
from stepdump.core.hashing import fingerprint_bytes
from stepdump.errors import StepdumpError

pytestmark = pytest.mark.timeout(300)

# -- the store everything here damages ----------------------------------------------------------


def _build(path: Path) -> None:
    """Thirteen steps in four writer sessions (four segments): raw, zstd and blosc-lz4 blobs, and
    a last session stored in full every other step with stats between (stat chunks)."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    t = 0
    for codec, n, kw in (("raw", 4, {}), ("zstd", 3, {}), ("blosc-lz4", 3, {}),
                         ("zstd", 3, {"every": 2, "stats_every": 1})):
        record_run(path, steps=n, start=t, model=model, opt=opt, scheduler=sched, codec=codec, **kw)
        t += n


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(path, truth): the store, and kind/name/step -> tensor hash of everything in it."""
    path = tmp_path_factory.mktemp("pristine") / "run"
    _build(path)
    truth = {}
    with stepdump.open(path) as run:
        assert stepdump.verify(run).ok
        for t in run.steps:
            for (kind, name) in run.fingerprints(t):
                truth[(kind, name, t)] = tensor_hash(run.tensor(name, t, kind=kind))
            for name in run.names("state"):  # RNG and scheduler internals
                with contextlib.suppress(stepdump.StepNotFoundError):
                    truth[("state", name, t)] = tensor_hash(run.tensor(name, t, kind="state"))
    sqlite3.connect(path / "catalog.sqlite").close()  # the last connection folds the WAL in
    for leftover in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (path / leftover).unlink(missing_ok=True)
    return path, truth


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _blobs(path: Path) -> list[tuple[int, str, int, int]]:
    con = sqlite3.connect(path / "catalog.sqlite")
    try:
        return con.execute(
            "SELECT b.id, s.key, b.offset, b.length FROM blobs b JOIN segments s ON s.id = b.segment"
        ).fetchall()
    finally:
        con.close()


def _users(path: Path) -> dict[int, list[tuple[str, str, int]]]:
    con = sqlite3.connect(path / "catalog.sqlite")
    try:
        out: dict[int, list[tuple[str, str, int]]] = {}
        for blob, kind, name, step in con.execute(
            "SELECT t.blob, s.kind, s.name, t.step FROM tensors t JOIN series s ON s.id = t.series "
            "WHERE t.blob IS NOT NULL"
        ):
            out.setdefault(blob, []).append((kind, name, step))
        return out
    finally:
        con.close()


def _problem_ids(report) -> set[int]:
    ids = set()
    for p in report.problems:
        assert p.where.startswith("blob "), p
        ids.add(int(p.where.split()[1]))
    return ids


def _read_everything_checked(path: Path, truth, damaged_blobs: set[int], users) -> None:
    """Every tensor: bit-exact if its blob is intact, CorruptDataError if it is damaged."""
    damaged = {u for b in damaged_blobs for u in users.get(b, [])}
    with stepdump.open(path) as run:
        for (kind, name, t), want in truth.items():
            if (kind, name, t) in damaged:
                with pytest.raises(stepdump.CorruptDataError):
                    run.tensor(name, t, kind=kind)
            else:
                assert tensor_hash(run.tensor(name, t, kind=kind)) == want, (kind, name, t)


# -- segment damage: found exactly ---------------------------------------------------------------


def test_random_bit_flips_in_segments_are_each_found_and_never_read_as_data(pristine, tmp_path):
    src, truth = pristine
    blobs = _blobs(src)
    users = _users(src)
    segs = sorted({key for _, key, _, _ in blobs})
    rng = random.Random(1)
    total_damaged = 0
    for rnd in range(12):
        path = _copy(src, tmp_path / "run")
        flipped: dict[str, set[int]] = {}
        for _ in range(rng.randint(1, 6)):
            key = rng.choice(segs)
            size = (path / key).stat().st_size
            pos = rng.randrange(size)
            with open(path / key, "r+b") as f:
                f.seek(pos)
                b = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([b ^ (1 << rng.randrange(8))]))
            flipped.setdefault(key, set()).symmetric_difference_update({pos})  # two flips of one bit cancel
        # (two different bits of one byte do not cancel; a re-flipped same bit is rare and handled above)
        expected = {bid for bid, key, off, ln in blobs if any(off <= p < off + ln for p in flipped.get(key, ()))}
        with stepdump.open(path) as run:
            report = stepdump.verify(run)
        assert _problem_ids(report) == expected, f"round {rnd}"
        assert all("checksum" in p.detail for p in report.problems)
        assert all(p.tensors for p in report.problems)  # each names the tensors that use the blob
        _read_everything_checked(path, truth, expected, users)
        total_damaged += len(expected)
    assert total_damaged >= 12


def test_truncated_and_deleted_segments_are_each_found(pristine, tmp_path):
    src, truth = pristine
    blobs = _blobs(src)
    users = _users(src)
    segs = sorted({key for _, key, _, _ in blobs})
    rng = random.Random(2)
    for rnd in range(8):
        path = _copy(src, tmp_path / "run")
        key = rng.choice(segs)
        size = (path / key).stat().st_size
        cut = rng.randrange(size) if rnd % 4 and rnd != 7 else 0
        os.truncate(path / key, cut)
        if rnd == 7:
            (path / key).unlink()
        expected = {bid for bid, k, off, ln in blobs if k == key and off + ln > cut}
        with stepdump.open(path) as run:
            report = stepdump.verify(run)
        assert _problem_ids(report) == expected, f"round {rnd}"
        word = "missing" if rnd == 7 else "truncated"
        assert all(word in p.detail for p in report.problems), report.problems[:2]
        _read_everything_checked(path, truth, expected, users)


# -- catalog damage ---------------------------------------------------------------------------------


def test_a_catalog_that_is_not_a_database_is_a_corrupt_data_error(pristine, tmp_path):
    src, _ = pristine
    for content in (b"", b"garbage" * 1000, b"SQLite format 3\x00" + os.urandom(4000)):
        path = _copy(src, tmp_path / "run")
        (path / "catalog.sqlite").write_bytes(content)
        with pytest.raises(stepdump.CorruptDataError, match="catalog"):
            stepdump.open(path)


def test_random_damage_to_the_catalog_file_gives_only_stepdump_errors(pristine, tmp_path):
    """Bit flips and truncations of catalog.sqlite: stepdump errors (on open, on a read, or
    as verify problems), never a raw sqlite3/Python error. SQLite keeps no checksum of
    its rows, so a flipped bit in a key can move a tensor row to another series or step
    where a read finds it; tensor bytes are still checked against their checksum and
    fingerprint, and verify's integrity_check reports the damaged catalog."""
    src, truth = pristine
    rng = random.Random(3)
    outcomes: dict[str, int] = {}
    for rnd in range(40):
        path = _copy(src, tmp_path / "run")
        cat = path / "catalog.sqlite"
        size = cat.stat().st_size
        if rnd % 3 == 0:
            os.truncate(cat, rng.randrange(size))
        else:
            with open(cat, "r+b") as f:
                for _ in range(rng.randint(1, 20)):
                    pos = rng.randrange(size)
                    f.seek(pos)
                    b = f.read(1)[0]
                    f.seek(pos)
                    f.write(bytes([b ^ (1 << rng.randrange(8))]))
        outcome = _exercise(path, truth, exact="verify-flags")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\ncatalog damage outcomes: {outcomes}")


# -- the reader under fuzzing ------------------------------------------------------------------------


class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise _Timeout(f"a reader call took more than {seconds} s on a damaged store (a hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _exercise(path: Path, truth, limit: float = 30.0, exact: str = "none") -> str:
    """Run every reader entry point on ``path``; only StepdumpError may escape any of them.

    ``exact`` says what a tensor that reads without error must be, compared with
    ``truth``: "strict", bit-exact (segment damage: checksums and fingerprints
    cover every byte); "verify-flags", bit-exact unless verify reports a problem
    (raw damage to catalog.sqlite, which SQLite's integrity_check sees); "none",
    anything (hostile catalog edits are authoring: only safety is promised).
    Returns a word saying how far a damaged store got, for the test's report.
    """
    outcome = "opened"
    wrong = []
    with _time_limit(limit):
        try:
            run = stepdump.open(path)
        except StepdumpError:
            return "refused on open"
        try:

            def attempt(fn, *args, **kwargs):
                nonlocal outcome
                try:
                    return fn(*args, **kwargs)
                except StepdumpError:
                    outcome = "stepdump error on a read"
                    return None

            steps = attempt(lambda: run.steps) or []
            attempt(lambda: run.all_steps)
            attempt(lambda: run.stats_steps)
            attempt(run.kinds)
            names = {}
            for kind in ("params", "grads", "optimizer", "buffers", "state"):
                names[kind] = attempt(run.names, kind) or []
            attempt(run.stats)
            attempt(run.stats, name="0.weight")
            attempt(run.stats, kind="grads", steps=range(0, 10, 2))
            attempt(run.scalars)
            attempt(run.profile)
            probe_steps = sorted({*steps[:1], *steps[-1:], 5, -1, 2**62})
            for t in probe_steps:
                for kind, ns in names.items():
                    for n in ns[:8]:
                        x = attempt(run.tensor, n, t, kind=kind)
                        if x is not None and exact != "none" and tensor_hash(x) != truth.get((kind, n, t)):
                            wrong.append((kind, n, t))
                            assert exact != "strict", f"{kind} {n} at step {t} read back wrong, without an error"
                attempt(run.tensors, t)
                attempt(run.fingerprints, t)
                attempt(run.state_dict, t)
                attempt(run.optimizer_state_dict, t)
                attempt(run.step_state, t)
                attempt(run.rng_state, t)
                attempt(run.scheduler_state_dict, t)
            report = stepdump.verify(run)
            if not report.ok:
                outcome = "verify found problems"
            assert not wrong or not report.ok, f"{wrong[:3]} read back wrong and verify saw nothing"
        finally:
            run.close()
    return outcome


_ODD_TEXT = [
    "../../etc/passwd", "/etc/passwd", "segments/../../../etc/passwd", "segments/000001.seg\x00x", "seg\\ments",
    "segments", "segments/", "", ".", "catalog.sqlite", "LOCK", "segments/ｓｅｇ\u202e.seg", "segments/" + "x" * 300,
    "float32", "int64", "complex128", "bool", "float64 ", "bogus", "raw", "zstd", "blosc-lz4", "blosc-zstd-bit",
    "1000000000,1000000", "1000000,1000000,1000000", "-1", "3,4", ",", "1e3", "٣", "3,,4", " 3", "3_0",
    "0,99999999999999999999", "0,1099511627776,1099511627776", "9" * 5000, "[" * 5000, '{"$tensor": "x"}',
    '{"$dict": [[{"a": 1}, 2]]}', '{"$tuple": 5}', '{"$float": "abc"}', '{"groups": 5}',
    '{"groups": [{"hyper": 1, "params": ["0.weight"]}]}', '{"groups": [{"hyper": {}, "params": [1, {}]}]}',
    '{"optimizer_extra": []}', '{"rng": 5}', "null", "[]", '"x"', "1e999", "NaN", "{}",
    '{"groups": [["0.weight"]], "state_dict": [["a", "params"]]}', '{"state_dict": 7}',
    '{"state_dict": [["0.weight", "params", "0.weight"], [1, 2, 3]]}', "params", "grads", "state", "optimizer",
]
_ODD_INTS = [0, -1, 1, 2, 3, 2**31, 2**32 + 1, 2**40, 2**40 + 1, 2**62, 10**15, -(2**63), 2**63 - 1]
ODD_VALUES = st.one_of(
    st.sampled_from(_ODD_TEXT),
    st.sampled_from(_ODD_INTS),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=24),
    st.none(),
)
COLUMNS = {
    "meta": ["value"],
    "series": ["id", "kind", "name", "param", "key"],
    "segments": ["id", "key"],
    "blobs": ["id", "segment", "offset", "length", "codec", "raw_length", "checksum", "base"],
    "steps": ["level", "skipped", "state", "step"],
    "tensors": ["series", "step", "dtype", "shape", "blob", "numel", "min", "fingerprint"],
    "scalars": ["step", "name", "value"],
    "stat_chunks": ["id", "first_step", "last_step", "rows", "checksum", "data"],
}
PKS = {"meta": "key", "series": "id", "segments": "id", "blobs": "id", "steps": "step",
       "tensors": "series, step", "scalars": "name, step", "stat_chunks": "id"}

row_edit = st.tuples(st.just("row"), st.sampled_from(sorted(COLUMNS)), st.integers(0, 10**6), st.data())
row_delete = st.tuples(st.just("delete"), st.sampled_from(sorted(COLUMNS)), st.integers(0, 10**6))
table_drop = st.tuples(st.just("drop"), st.sampled_from(sorted(COLUMNS)), st.booleans())
meta_edit = st.tuples(st.just("meta"), st.sampled_from(["format_version", "layout", "codec", "user"]),
                      st.sampled_from(_ODD_TEXT + ["1", "2", "1.0", "true"]))
seg_edit = st.tuples(
    st.just("segment"),
    st.sampled_from(["flip", "truncate", "garbage", "append", "delete", "dir", "symlink_out", "fifo"]),
    st.integers(0, 2), st.floats(0, 1), st.binary(min_size=1, max_size=64),
)
forged = st.tuples(st.just("forge"), st.integers(0, 10**6), st.floats(0, 1), st.binary(min_size=1, max_size=64))
# garbage in a stat chunk with a valid checksum: reaches the chunk decoder (store/stat_chunk.py)
forged_chunk = st.tuples(st.just("forge_chunk"), st.integers(0, 10**6), st.floats(0, 1),
                         st.binary(min_size=1, max_size=64))
cat_file = st.tuples(st.just("catfile"), st.sampled_from(["flip", "truncate"]), st.floats(0, 1), st.integers(0, 7))
# Schema objects that compute (tests/test_reliability_hostile_catalog.py fuzzes these on their own).
SCHEMA_EDITS = ["ALTER TABLE {t} ADD COLUMN g AS (length(hex(zeroblob(30000000)))) VIRTUAL",
                "CREATE TRIGGER tr AFTER INSERT ON {t} BEGIN SELECT 1; END", "CREATE INDEX ix ON {t}(abs({c}))",
                "ALTER TABLE {t} ADD COLUMN extra TEXT DEFAULT 'x'"]
schema_edit = st.tuples(st.just("schema"), st.sampled_from(sorted(COLUMNS)), st.sampled_from(SCHEMA_EDITS))
MUTATION = st.one_of(row_edit, row_delete, table_drop, meta_edit, seg_edit, forged, forged_chunk, cat_file,
                     schema_edit)


def _apply(path: Path, m) -> None:
    kind = m[0]
    if kind in ("row", "delete", "drop", "meta", "forge", "forge_chunk", "schema"):
        con = sqlite3.connect(path / "catalog.sqlite", isolation_level=None)
        try:
            if con.execute("SELECT count(*) FROM sqlite_master WHERE type = 'view'").fetchone()[0]:
                return  # an earlier mutation left an endless view: reading it here would never end
            if kind in ("row", "delete") and not con.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (m[1],)
            ).fetchone():
                return  # dropped by an earlier mutation
            if kind == "row":
                _, table, pick, data = m
                column = data.draw(st.sampled_from(COLUMNS[table]))
                value = data.draw(ODD_VALUES)
                n = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                if n:
                    pk = PKS[table]
                    con.execute(
                        f"UPDATE {table} SET {column} = ? WHERE ({pk}) = "
                        f"(SELECT {pk} FROM {table} LIMIT 1 OFFSET ?)",
                        (value, pick % n),
                    )
            elif kind == "delete":
                _, table, pick = m
                n = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                if n:
                    pk = PKS[table]
                    con.execute(f"DELETE FROM {table} WHERE ({pk}) = (SELECT {pk} FROM {table} LIMIT 1 OFFSET ?)",
                                (pick % n,))
            elif kind == "drop":
                con.execute(f"DROP TABLE {m[1]}")
                if m[2]:  # an endless view in its place: a query that read it would never end
                    cols = ", ".join(f"x AS {c}" for c in dict.fromkeys([*PKS[m[1]].split(", "), *COLUMNS[m[1]]]))
                    con.execute(f"CREATE VIEW {m[1]} AS WITH RECURSIVE c(x) AS "
                                f"(SELECT 0 UNION ALL SELECT x + 1 FROM c) SELECT {cols} FROM c")
            elif kind == "meta":
                con.execute("UPDATE meta SET value = ? WHERE key = ?", (m[2], m[1]))
            elif kind == "schema":
                con.execute(m[2].format(t=m[1], c=COLUMNS[m[1]][0]))
            elif kind == "forge_chunk":
                _, pick, where, junk = m
                rows = con.execute("SELECT id, data FROM stat_chunks ORDER BY id").fetchall()
                if rows:
                    cid, data = rows[pick % len(rows)]
                    data = bytearray(data) if isinstance(data, bytes) else bytearray(b"x")
                    at = int(where * (len(data) - 1))
                    data[at:at + len(junk)] = junk[: max(0, len(data) - at)]
                    con.execute("UPDATE stat_chunks SET data = ?, checksum = ? WHERE id = ?",
                                (bytes(data), fingerprint_bytes(bytes(data)), cid))
            elif kind == "forge":  # garbage that carries a valid checksum: reaches the decoders
                _, pick, where, junk = m
                rows = con.execute("SELECT b.id, s.key, b.offset, b.length FROM blobs b "
                                   "JOIN segments s ON s.id = b.segment ORDER BY b.id").fetchall()
                bid, key, off, ln = rows[pick % len(rows)]
                seg = path / key
                if seg.is_file() and ln > 0:
                    data = bytearray(seg.read_bytes())
                    at = off + int(where * (ln - 1))
                    end = min(at + len(junk), off + ln)
                    data[at:end] = junk[: end - at]
                    seg.write_bytes(bytes(data))
                    con.execute("UPDATE blobs SET checksum = ? WHERE id = ?",
                                (fingerprint_bytes(bytes(data[off:off + ln])), bid))
        except sqlite3.DatabaseError:
            pass  # the edit did not apply (a constraint, a table already dropped): fine
        finally:
            con.close()
        return
    if kind == "catfile":
        _, op, where, bit = m
        cat = path / "catalog.sqlite"
        size = cat.stat().st_size
        if size == 0:
            return
        pos = min(int(where * size), size - 1)
        if op == "truncate":
            os.truncate(cat, pos)
        else:
            with open(cat, "r+b") as f:
                f.seek(pos)
                b = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([b ^ (1 << bit)]))
        return
    _, op, idx, where, junk = m
    segs = sorted((path / "segments").glob("*.seg"))
    if not segs:
        return
    seg = segs[idx % len(segs)]
    if not seg.is_file():
        return
    size = seg.stat().st_size
    pos = min(int(where * size), max(size - 1, 0))
    if op == "flip" and size:
        with open(seg, "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ (junk[0] or 1)]))
    elif op == "truncate":
        os.truncate(seg, pos)
    elif op == "garbage" and size:
        with open(seg, "r+b") as f:
            f.seek(pos)
            f.write(junk[: size - pos])
    elif op == "append":
        with open(seg, "ab") as f:
            f.write(junk)
    elif op == "delete":
        seg.unlink()
    elif op == "dir":
        seg.unlink()
        seg.mkdir()
    elif op == "symlink_out":  # a segment that leads out of the run directory
        seg.unlink()
        seg.symlink_to(path.parent / "outside.seg")
    elif op == "fifo":  # opening a FIFO for reading would block forever
        seg.unlink()
        os.mkfifo(seg)


# STEPDUMP_FUZZ_EXAMPLES=2000 STEPDUMP_FUZZ_RANDOM=1 for a longer hunt with fresh examples.
OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes():
    yield
    if OUTCOMES:
        print(f"\nfuzzed stores: {dict(OUTCOMES)}")


_FUZZ = settings(max_examples=int(os.environ.get("STEPDUMP_FUZZ_EXAMPLES", "120")), deadline=20_000,
                 derandomize=not os.environ.get("STEPDUMP_FUZZ_RANDOM"), database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large])


@_FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
def test_fuzzed_stores_raise_only_stepdump_errors(pristine, tmp_path_factory, mutations):
    src, truth = pristine
    work = tmp_path_factory.getbasetemp() / "fuzz"
    work.mkdir(exist_ok=True)
    (work / "outside.seg").write_bytes(b"secret bytes outside the run directory" * 100)
    path = _copy(src, work / "run")
    for m in mutations:
        _apply(path, m)
    if all(m[0] == "segment" for m in mutations):
        exact = "strict"
    elif all(m[0] in ("segment", "catfile") for m in mutations):
        exact = "verify-flags"
    else:
        exact = "none"
    OUTCOMES[_exercise(path, truth, limit=15.0, exact=exact)] += 1


@_FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(sorted(COLUMNS)), st.integers(0, 10**6), st.data()),
                      min_size=1, max_size=3))
def test_fuzzed_catalog_rows_raise_only_stepdump_errors(pristine, tmp_path_factory, edits):
    """Row edits only: the catalog stays a valid database, so every edit reaches the reader."""
    src, _ = pristine
    path = _copy(src, tmp_path_factory.getbasetemp() / "fuzz-rows")
    for table, pick, data in edits:
        _apply(path, ("row", table, pick, data))
    OUTCOMES[_exercise(path, None, limit=15.0, exact="none")] += 1
