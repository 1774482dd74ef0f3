"""What one read may cost, whatever the store says: issue 16, items 7, 8, 9, 10 and 13.

* A URL run deleted and recorded again is never read from the byte ranges
  cached for the old run (item 7).
* A blob used many times by one call is decoded once and shared, so aliasing
  cannot multiply the memory a call needs (item 8).
* ``file://`` URLs get the same segment checks as local runs: no FIFO blocks,
  no link out of the run is followed, no size claim is allocated (item 9).
* Delta chains are bounded by the bytes they decode, not only by their links (item 10).
* The CLI answers hostile catalogs with stepdump errors and their exit codes (item 13).

Hostile stores are built here by editing a recorded store's catalog with sqlite3.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import assert_same, catalog_sql, one_step_run, peak_traced_bytes, record_run, tiny_model, weight_blob

import stepdump
from stepdump.core.hashing import fingerprint_bytes
from stepdump.store.delta import DeltaCodec

pytestmark = pytest.mark.timeout(120)


def _small(path: Path) -> Path:
    """``one_step_run`` with its WAL folded in: the catalog is one file again."""
    one_step_run(path)
    sqlite3.connect(path / "catalog.sqlite").close()
    return path


def _append(path: Path, data: bytes) -> tuple[int, int]:
    """Append ``data`` to the run's segment; return (segment id, offset)."""
    seg_id, key = catalog_sql(path, "SELECT id, key FROM segments")[0]
    seg = path / key
    offset = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(data)
    return seg_id, offset


def _in_subprocess(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: a read that regresses into minutes of work is killed."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


# -- item 7: a URL run recorded again is not read from the old run's cached ranges --------------------


def test_a_url_run_recorded_again_is_not_read_from_the_old_runs_cache(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    where = f"memory://stepdump-tests/{uuid.uuid4().hex}"
    cache = tmp_path / "cache"  # shared by every reader of the URL, as the default cache is
    record_run(where, steps=2, model=tiny_model(0))
    with stepdump.open(where, cache_dir=cache) as run:
        old = {k: run.tensors(1, k) for k in ("params", "grads")}
    assert list((cache / "ranges").rglob("*-*"))  # the ranges are cached
    fs, root = fsspec.core.url_to_fs(where)
    fs.rm(root, recursive=True)
    record_run(where, steps=2, model=tiny_model(1))  # same model shapes: same keys, offsets and lengths
    want = record_run(tmp_path / "local", steps=2, model=tiny_model(1))
    with stepdump.open(where, cache_dir=cache) as run, stepdump.open(want) as ref:
        for kind in ("params", "grads"):
            got = run.tensors(1, kind)
            for name, t in ref.tensors(1, kind).items():
                assert_same(got[name], t, f"{kind} {name}")
                assert not torch.equal(got[name], old[kind][name])
        assert stepdump.verify(run).ok


def test_a_stale_cached_range_is_fetched_again(tmp_path: Path) -> None:
    """A cached range whose bytes fail their checksum is fetched afresh, not reported as damage."""
    where = f"memory://stepdump-tests/{uuid.uuid4().hex}"
    cache = tmp_path / "cache"
    record_run(where, steps=2)
    with stepdump.open(where, cache_dir=cache) as run:
        want = run.tensor("0.weight", 1)
    for f in (cache / "ranges").rglob("*-*"):
        f.write_bytes(bytes(len(f.read_bytes())))  # a cache entry gone bad (or left by another run)
    with stepdump.open(where, cache_dir=cache) as run:
        assert_same(run.tensor("0.weight", 1), want)


# -- item 8: one blob used many times by one call ------------------------------------------------------

ALIAS_BYTES = 32 << 20
ALIASES = 20


@pytest.fixture
def aliased_state(tmp_path: Path) -> Path:
    """Step 0's state refers to 20 state tensors whose rows all point at one 1 KB zstd blob
    of 32 MiB of zeros (so a reader that decodes it per use needs 640 MiB)."""
    path = _small(tmp_path / "run")
    frame = zstandard.ZstdCompressor(level=3).compress(bytes(ALIAS_BYTES))
    seg_id, offset = _append(path, frame)
    (blob,) = catalog_sql(path, "SELECT max(id) + 1 FROM blobs")[0]
    catalog_sql(path, "INSERT INTO blobs(id, segment, offset, length, codec, raw_length, checksum, base) "
               "VALUES (?, ?, ?, ?, 'zstd', ?, ?, NULL)",
         (blob, seg_id, offset, len(frame), ALIAS_BYTES, fingerprint_bytes(frame)))
    fp = fingerprint_bytes(bytes(ALIAS_BYTES))
    refs = []
    for i in range(ALIASES):
        (sid,) = catalog_sql(path, "INSERT INTO series(kind, name) VALUES ('state', ?) RETURNING id", (f"alias{i}",))[0]
        catalog_sql(path, "INSERT INTO tensors(series, step, dtype, shape, blob, numel, fingerprint) "
                   "VALUES (?, 0, 'uint8', ?, ?, ?, ?)", (sid, str(ALIAS_BYTES), blob, ALIAS_BYTES, fp))
        refs.append({"$tensor": f"alias{i}"})
    catalog_sql(path, "UPDATE steps SET state = ? WHERE step = 0", (json.dumps({"aliases": refs}),))
    return path


def test_a_blob_used_many_times_is_decoded_once_per_call(aliased_state: Path) -> None:
    with stepdump.open(aliased_state) as run:
        out: dict[str, Any] = {}
        peak_state = peak_traced_bytes(lambda: out.update(state=run.step_state(0)))
        got = out.pop("state")["aliases"]
        assert len(got) == ALIASES and all(t.shape == (ALIAS_BYTES,) and not t.any() for t in got)
        del got
        peak_tensors = peak_traced_bytes(lambda: out.update(tensors=run.tensors(0, "state")))
        aliases = [t for n, t in out.pop("tensors").items() if n.startswith("alias")]
        assert len(aliases) == ALIASES and all(t.shape == (ALIAS_BYTES,) and not t.any() for t in aliases)
    # One decoded copy and one tensor's worth of buffer, not 20 of them.
    assert peak_state < 4 * ALIAS_BYTES, f"step_state() peaked at {peak_state >> 20} MiB"
    assert peak_tensors < 4 * ALIAS_BYTES, f"tensors() peaked at {peak_tensors >> 20} MiB"


# -- item 9: file:// URLs get the local segment checks ------------------------------------------------


@pytest.fixture
def file_url_run(tmp_path: Path) -> tuple[str, Path]:
    """A run published to a file:// URL: (url, its directory)."""
    pytest.importorskip("fsspec")
    published = tmp_path / "published"
    return one_step_run(published.as_uri()), published


def _segment(path: Path) -> Path:
    return path / catalog_sql(path, "SELECT key FROM segments")[0][0]


def test_a_fifo_segment_at_a_file_url_is_refused_without_blocking(file_url_run: tuple[str, Path],
                                                                   tmp_path: Path) -> None:
    where, path = file_url_run
    seg = _segment(path)
    seg.unlink()
    os.mkfifo(seg)
    result: dict[str, BaseException] = {}

    def read() -> None:
        try:
            with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
                run.tensor("weight", 0)
        except BaseException as e:  # noqa: BLE001 - the test inspects whatever came out
            result["error"] = e

    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():  # unblock the reader stuck in open() before failing
        fd = os.open(seg, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        th.join(10)
        pytest.fail("reading a FIFO segment at a file:// URL blocked")
    assert isinstance(result.get("error"), stepdump.CorruptDataError), result
    assert "not a regular file" in str(result["error"])


def test_a_segment_linking_out_of_a_file_url_run_is_not_read(file_url_run: tuple[str, Path],
                                                             tmp_path: Path) -> None:
    """The exfiltration case over file://: the catalog describes exactly the bytes of a
    file outside the run; the reader still refuses the link."""
    where, path = file_url_run
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"private key material, 48 bytes long!!!!!!!!!!!!")
    data = secret.read_bytes()
    fp = fingerprint_bytes(data)
    seg = _segment(path)
    seg.unlink()
    seg.symlink_to(secret)
    blob = weight_blob(path)
    catalog_sql(path, "UPDATE blobs SET offset = 0, length = ?, raw_length = ?, checksum = ? WHERE id = ?",
         (len(data), len(data), fp, blob))
    catalog_sql(path, "UPDATE tensors SET dtype = 'uint8', shape = ?, fingerprint = ? WHERE blob = ?",
         (str(len(data)), fp, blob))
    with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
        with pytest.raises(stepdump.CorruptDataError, match="outside the run directory"):
            run.tensor("weight", 0)


def test_a_catalog_linking_out_of_a_file_url_run_is_not_read(file_url_run: tuple[str, Path],
                                                             tmp_path: Path) -> None:
    where, path = file_url_run
    elsewhere = tmp_path / "elsewhere.sqlite"
    shutil.move(path / "catalog.sqlite", elsewhere)
    (path / "catalog.sqlite").symlink_to(elsewhere)
    with pytest.raises(stepdump.CorruptDataError, match="outside the run directory"):
        stepdump.open(where, cache_dir=tmp_path / "cache")


def test_a_40_gb_claim_at_a_file_url_is_refused_before_allocating(file_url_run: tuple[str, Path],
                                                                   tmp_path: Path) -> None:
    where, path = file_url_run
    blob = weight_blob(path)
    catalog_sql(path, "UPDATE tensors SET shape = '100000,100000' WHERE blob = ?", (blob,))
    catalog_sql(path, "UPDATE blobs SET raw_length = ?, length = ?, codec = 'raw' WHERE id = ?", (4 * 10**10, 4 * 10**10, blob))
    with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
        outcome: dict[str, BaseException] = {}

        def read() -> None:
            try:
                run.tensor("weight", 0)
            except BaseException as e:  # noqa: BLE001 - a MemoryError must fail the test, not the run
                outcome["error"] = e

        peak = peak_traced_bytes(read)
    assert isinstance(outcome.get("error"), stepdump.CorruptDataError), outcome
    assert "truncated" in str(outcome["error"])
    assert peak < 32 << 20, f"the reader allocated {peak} bytes for a 40 GB claim"


# -- item 10: delta chains bounded by the work they cost ---------------------------------------------

CHAIN_BYTES = 8 << 20


def _chain(path: Path, links: int) -> Path:
    """The weight's blob replaced by a chain: one keyframe of 8 MiB of zeros, then ``links``
    delta blobs that all alias one stored delta of zeros (a few KB of catalog rows in all)."""
    codec = DeltaCodec("lz4")
    zeros = bytes(CHAIN_BYTES)
    key = codec.keyframe.encode(memoryview(zeros), 4)
    delta = codec.encode(memoryview(zeros), 4, base=zeros)
    seg_id, offset = _append(path, key + delta)
    (first,) = catalog_sql(path, "SELECT max(id) + 1 FROM blobs")[0]
    rows = [(first, seg_id, offset, len(key), codec.keyframe.name, CHAIN_BYTES, fingerprint_bytes(key), None)]
    rows += [(first + i, seg_id, offset + len(key), len(delta), codec.name, CHAIN_BYTES, fingerprint_bytes(delta),
              first + i - 1) for i in range(1, links + 1)]
    con = sqlite3.connect(path / "catalog.sqlite")
    with con:
        con.executemany("INSERT INTO blobs VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        con.execute("UPDATE tensors SET dtype = 'float32', shape = ?, blob = ?, fingerprint = ? WHERE blob = ?",
                    (str(CHAIN_BYTES // 4), first + links, fingerprint_bytes(zeros), weight_blob(path)))
    con.close()
    return path


def test_a_long_chain_of_big_deltas_is_refused_before_the_work(tmp_path: Path) -> None:
    """4,096 links of 8 MiB: 32 GiB of decoding (minutes) for one tensor. Refused up front."""
    path = _chain(_small(tmp_path / "run"), 4096)
    try:  # the time limit catches the work being done (minutes); it is no speed claim
        proc = _in_subprocess(f"""
            import stepdump
            with stepdump.open({str(path)!r}) as run:
                try:
                    run.tensor("weight", 0)
                    print("READ")
                except stepdump.CorruptDataError as e:
                    print("CorruptDataError:", e)
            """, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("reading one tensor of a 4,096-link chain ran for over 45 s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "CorruptDataError:" in out and "decode budget" in out and "STEPDUMP_DECODE_BUDGET" in out, out


def test_a_chain_within_the_budget_reads_and_the_budget_is_configurable(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = _chain(_small(tmp_path / "run"), 20)  # 168 MiB of decoding for 8 MiB: within the default budget
    with stepdump.open(path) as run:
        assert not run.tensor("weight", 0).any()
        assert stepdump.verify(run).ok
    monkeypatch.setenv("STEPDUMP_DECODE_BUDGET", "0")  # no allowance: 16 bytes decoded per byte returned
    with stepdump.open(path) as run:
        with pytest.raises(stepdump.CorruptDataError, match="decode budget") as e:
            run.tensor("weight", 0)
    assert "STEPDUMP_DECODE_BUDGET" in str(e.value)


# -- item 13: the CLI on hostile catalogs -----------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = record_run(tmp_path_factory.mktemp("cli") / "run", steps=3)
    sqlite3.connect(path / "catalog.sqlite").close()
    for leftover in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (path / leftover).unlink(missing_ok=True)
    return path


def _hostile(recorded: Path, where: Path, *sql: str) -> Path:
    path = shutil.copytree(recorded, where)
    for s in sql:
        catalog_sql(path, s)
    return path


TEXT_SCALAR = "UPDATE scalars SET value = 'abc' WHERE step = 1 AND name = 'loss'"
BLOB_NAME = "UPDATE series SET name = x'00ff' WHERE kind = 'params' AND name = '0.weight'"

CLI_CASES = [
    (TEXT_SCALAR, ["report", "{run}", "-o", "{out}/r.html"], "scalar 'loss' at step 1"),
    (TEXT_SCALAR, ["export-tb", "{run}", "{out}/tb"], "scalar 'loss' at step 1"),
    (BLOB_NAME, ["export", "{run}", "--step", "1", "-o", "{out}/x.safetensors", "--format", "safetensors"],
     "not text"),
]


@pytest.mark.parametrize("sql,args,match", CLI_CASES, ids=["report", "export-tb", "export-safetensors"])
def test_the_cli_answers_a_hostile_catalog_with_a_stepdump_error(recorded: Path, tmp_path: Path, sql: str,
                                                                 args: list[str], match: str, cli) -> None:
    from stepdump.cli.exitcodes import Exit

    run = _hostile(recorded, tmp_path / "run", sql)
    argv = [a.format(run=run, out=tmp_path) for a in args]
    err = cli(*argv, ok=Exit.CORRUPT).stderr  # anything but a stepdump error escapes here and fails the test
    assert "Traceback" not in err, err
    assert err.startswith("error:") and match in err, err
    assert "damaged" in err, err


HOSTILE_ROWS = [
    TEXT_SCALAR,
    "UPDATE scalars SET value = x'00' WHERE step = 1",
    "UPDATE scalars SET name = x'ff' WHERE step = 1 AND name = 'loss'",
    "UPDATE scalars SET step = 'x' WHERE step = 1",
    BLOB_NAME,
    "UPDATE series SET param = x'00' WHERE kind = 'optimizer'",
    "UPDATE tensors SET nan = 'x'",
    "UPDATE tensors SET norm = 'abc'",
    "UPDATE tensors SET step = 'x' WHERE step = 1",
    "UPDATE steps SET time = 'abc'",
    "UPDATE meta SET value = '\"abc\"' WHERE key = 'created'",
    "UPDATE meta SET value = '-1e300' WHERE key = 'created'",
    "UPDATE meta SET value = '5' WHERE key = 'capture'",
    "UPDATE meta SET value = 'null' WHERE key = 'layout'",
    "UPDATE meta SET value = '{\"groups\": 5, \"state_dict\": 7}' WHERE key = 'layout'",
]
COMMANDS = [["info"], ["ls"], ["show", "0.weight", "--step", "1"], ["stats"], ["scalars"], ["check"], ["verify"],
            ["report", "-o", "{out}/r.html"], ["export-tb", "{out}/tb"], ["export", "--step", "1", "-o", "{out}/x.pt"],
            ["export", "--step", "1", "-o", "{out}/x.st", "--format", "safetensors", "--grads"]]


@pytest.mark.parametrize("sql", HOSTILE_ROWS)
def test_every_command_answers_hostile_rows_with_a_documented_exit_code(recorded: Path, tmp_path: Path, sql: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The same, in-process for speed, over more damage: values of the wrong SQLite type in
    every table the commands read, and meta values of the wrong JSON type."""
    from stepdump.cli.exitcodes import Exit
    from stepdump.cli.main import main

    run = _hostile(recorded, tmp_path / "run", sql)
    codes = {}
    for cmd in COMMANDS:
        argv = [cmd[0], str(run), *(a.format(out=tmp_path) for a in cmd[1:])]
        codes[cmd[0]] = rc = main(argv)  # anything but a stepdump error escapes here and fails the test
        err = capsys.readouterr().err
        assert rc in {Exit.OK, Exit.FOUND, Exit.NOT_FOUND, Exit.CORRUPT}, (argv, rc, err)
        if rc == Exit.CORRUPT:
            assert err.startswith("error:") and "Traceback" not in err, (argv, err)
    if "steps SET time" not in sql:  # commit times are cosmetic: export-tb leaves a bad one out
        assert Exit.CORRUPT in codes.values(), codes  # the damage is noticed by some command
