"""Stats as columns (FORMAT.md "Stat chunks"): the stats-only rows of a commit window are one
compressed, checksummed chunk, not a catalog row per tensor per step.

Held to what the recording saw: every stats-only row of a lean run reads back from its chunk with
the live tensor's fingerprint (xxh3 of its bytes, computed here apart from the recorder) and the
stats ``compute_stats`` gives the same tensor in this process; the catalog's tensors table keeps
only rows with bytes. The chunk layout is pinned by bytes written here and decoded by the reader,
and every kind of damage (a flipped bit, a truncated chunk, a header that lies about its rows,
sizes or codes) is refused by name, never read as numbers. A store that says format 2 and holds
a stat_chunks table is refused (a reader of format 2 would miss its rows). A resume that drops
steps inside a chunk keeps the chunk's earlier rows.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers import catalog_format_version, catalog_sql, catalog_tables, record_run, snapshot

import stepdump
from stepdump.core.hashing import raw_bytes, signed64
from stepdump.core.stats import compute_stats
from stepdump.errors import CorruptDataError
from stepdump.store import stat_chunk
from stepdump.store.queries import CatalogReader

LEAN = {"every": None, "stats_every": 1}
STEPS = 6


def _lean_run(path: Path) -> tuple[Path, list[dict[str, dict[str, torch.Tensor]]]]:
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    record_run(path, steps=STEPS, before_step=lambda t, m, o: snaps.append(snapshot(m, o)), on_error="raise", **LEAN)
    return path, snaps


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, dict[str, torch.Tensor]]]]:
    return _lean_run(tmp_path_factory.mktemp("chunks") / "run")


def test_stats_only_rows_live_in_chunks_and_read_back_exactly(lean: tuple[Path, list]) -> None:
    path, snaps = lean
    assert "stat_chunks" in catalog_tables(path) and catalog_format_version(path) == 3
    # the tensors table keeps rows with bytes only (the final record's); the lean rows are in chunks
    assert catalog_sql(path, "SELECT count(*) FROM main.tensors WHERE blob IS NULL") == [(0,)]
    assert catalog_sql(path, "SELECT count(*) FROM main.stat_chunks")[0][0] >= 1
    checked = 0
    with stepdump.open(path) as run:
        stats = run.stats()
        for step in range(STEPS):
            at = stats[stats["step"] == step]
            assert set(at["kind"]) == {"params", "grads"}, step  # what a lean step describes
            for _, r in at.iterrows():
                kind, name = r["kind"], r["name"]
                if kind not in snaps[step]:
                    continue
                t = snaps[step][kind][name]
                assert int(r["fingerprint"]) == signed64(xxhash.xxh3_64_intdigest(bytes(raw_bytes(t))))
                want = compute_stats(t)
                got = [r[c] for c in ("numel", "nan", "posinf", "neginf", "min", "max", "mean", "std", "norm",
                                      "zero_frac")]
                for g, w in zip(got, want, strict=True):
                    assert (w is None and g != g) or g == w, (step, kind, name, got, want)
                assert not bool(r["stored"])
                checked += 1
    assert checked == STEPS * 8  # the control: the tiny model's 4 params and 4 grads at every step


def test_every_query_reads_chunk_rows_like_table_rows(lean: tuple[Path, list]) -> None:
    """The reader's per-step and per-series queries see the chunk rows (the same rows as run.stats())."""
    path, snaps = lean
    reader = CatalogReader(path)
    try:
        assert reader.has_stat_chunks
        names = {name for name in snaps[2]["grads"]}
        fps = {(k, n): fp for k, n, fp in reader.fingerprints(2)}
        assert {n for k, n in fps if k == "grads"} == names
        for name, t in snaps[2]["grads"].items():
            assert fps[("grads", name)] == signed64(xxhash.xxh3_64_intdigest(bytes(raw_bytes(t))))
        sid = reader.series_id("grads", sorted(names)[0])
        rows = reader.series_stat_rows(sid)
        assert [r[0] for r in rows] == list(range(STEPS))  # the final record has no grads
        block = reader.fingerprint_block(1, 2)
        assert {r.step for r in block} == {1, 2} and all(r.blob is None for r in block)
        row = reader.tensor_row(sid, 3)
        assert row is not None and row.blob is None and row.fingerprint == rows[3][-2]
        assert reader.total_numel("grads", 0) == sum(t.numel() for t in snaps[0]["grads"].values())
        assert [s for s, _ in reader.norm_squares("grads", "*")] == list(range(STEPS))
        assert reader.nonfinite_counts() == []
        buckets = reader.stat_buckets("grads", 0, 2, change=True)
        assert sorted({b[1] for b in buckets}) == [0, 1, 2] and all(b[4] == 2 for b in buckets)
    finally:
        reader.close()


def test_chunk_layout_is_pinned() -> None:
    """A chunk written now decodes to its rows; its header and first column are what FORMAT.md says."""
    rows = [(1, 7, "float32", "2,3", None, 6, 0, 0, 0, -1.5, 2.0, 0.25, 1.0, 3.0, 0.5, -5),
            (2, 7, "int64", "", None, 1, None, None, None, None, None, None, None, None, None, 9)]
    data, first, last = stat_chunk.encode_rows(rows)
    assert (first, last) == (7, 7)
    magic, size = struct.unpack_from("<4sI", data)
    assert magic == b"SDS1"
    head = stat_chunk.read_header(data, 2, "pinned")
    assert head.dtypes == ["float32", "int64"] and head.shapes == ["2,3", ""] and head.body == 8 + size
    a = stat_chunk.decode(data, 2, stat_chunk.COUNT_STATS + stat_chunk.FLOAT_STATS, "pinned")
    assert a.series.tolist() == [1, 2] and a.fingerprint.tolist() == [-5, 9] and a.blob.tolist() == [-1, -1]
    assert a.stats["nan"].tolist() == [0, -1] and a.stats["min"][0] == -1.5 and np.isnan(a.stats["min"][1])
    assert stat_chunk.row_values(a, ["nan", "norm"]) == [[0, None], [3.0, None]]
    import zstandard
    off, length = head.columns["series"]
    raw = zstandard.ZstdDecompressor().decompress(data[head.body + off:head.body + off + length])
    assert raw == struct.pack("<qq", 1, 2)



def test_blocks_sharing_their_name_lists_code_like_rows_one_by_one() -> None:
    """Blocks of one batch share its dtype and shape lists (coded once per list): the dictionaries
    and every row's dtype and shape are those of coding each row's text in order."""
    dtypes, shapes = ["float32", "float64", "float32"], ["3", "2,2", ""]
    other_shapes = ["3", "7", ""]  # equal texts in another list object
    z = np.zeros

    def block(step: int, sh: list[str]) -> stat_chunk.ColumnBlock:
        return stat_chunk.ColumnBlock(np.array([1, 2, 3], np.int64), step, dtypes, sh, z((4, 3), np.int64),
                                      z((6, 3)), np.array([step, step + 1, step + 2], np.int64))

    rows = [(9, 0, "int64", "5", None, 5, 0, 0, 0, 0.0, 1.0, 0.5, 0.1, 1.2, 0.0, 4)]
    blocks = [block(1, shapes), block(2, shapes), block(3, other_shapes), block(4, shapes)]
    data, first, last = stat_chunk.encode_rows(rows, blocks)
    assert (first, last) == (0, 4)
    head = stat_chunk.read_header(data, 13, "shared")
    assert head.dtypes == ["int64", "float32", "float64"] and head.shapes == ["5", "3", "2,2", "", "7"]
    a = stat_chunk.decode(data, 13, [], "shared")
    want_dt = ["int64"] + dtypes * 4
    want_sh = ["5"] + shapes * 2 + other_shapes + shapes
    assert a.dtype.tolist() == want_dt and a.shape.tolist() == want_sh
    assert a.step.tolist() == [0] + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3

def _rows_data(n: int = 3) -> bytes:
    rows = [(i, 4, "float32", "3", None, 3, 0, 0, 0, 0.0, 1.0, 0.5, 0.1, 1.2, 0.0, i * 11) for i in range(n)]
    return stat_chunk.encode_rows(rows)[0]


@pytest.mark.parametrize("damage", ["magic", "header size", "rows", "column offset", "column bytes", "code",
                                    "truncated", "more rows in a column"])
def test_a_damaged_chunk_is_refused_by_name(damage: str) -> None:
    data = bytearray(_rows_data())
    rows = 3
    head = stat_chunk.read_header(bytes(data), 3, "ok")
    if damage == "magic":
        data[0:4] = b"XXXX"
    elif damage == "header size":
        data[4:8] = struct.pack("<I", 1 << 30)
    elif damage == "rows":
        rows = 4
    elif damage == "column offset":
        import json
        h = json.loads(bytes(data[8:head.body]))
        h["columns"]["norm"] = [10**9, 5]
        text = json.dumps(h).encode()
        data = bytearray(struct.pack("<4sI", b"SDS1", len(text)) + text + bytes(data[head.body:]))
    elif damage == "column bytes":
        off, length = head.columns["norm"]
        data[head.body + off + length // 2] ^= 0xFF
    elif damage == "code":
        import json

        import zstandard
        h = json.loads(bytes(data[8:head.body]))
        h["dtypes"] = []  # codes now index past an empty list
        text = json.dumps(h).encode()
        data = bytearray(struct.pack("<4sI", b"SDS1", len(text)) + text + bytes(data[head.body:]))
        del zstandard
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "more rows in a column":
        rows = 2  # the catalog says 2: a column of 3 values is more than the budget allows
    with pytest.raises(CorruptDataError):
        stat_chunk.decode(bytes(data), rows, stat_chunk.COUNT_STATS + stat_chunk.FLOAT_STATS, "chunk 1")


def test_a_flipped_bit_in_a_stored_chunk_is_damage_not_numbers(tmp_path: Path) -> None:
    path, _ = _lean_run(tmp_path / "run")
    (cid, data), *_ = catalog_sql(path, "SELECT id, data FROM main.stat_chunks ORDER BY id")
    bad = bytearray(data)
    bad[len(bad) - 3] ^= 0x01
    catalog_sql(path, "UPDATE stat_chunks SET data = ? WHERE id = ?", (bytes(bad), cid))
    with stepdump.open(path) as run, pytest.raises(stepdump.CorruptDataError, match=f"stat chunk {cid}.*checksum"):
        run.stats()
    with stepdump.open(path) as run:
        report = stepdump.verify(run)
    assert not report.ok and any(p.where == f"stat chunk {cid}" for p in report.problems), report.problems


def test_a_format_2_store_with_a_stat_chunks_table_is_refused(lean: tuple[Path, list], tmp_path: Path) -> None:
    import shutil
    path = tmp_path / "copy"
    shutil.copytree(lean[0], path)
    catalog_sql(path, "UPDATE meta SET value = '2' WHERE key = 'format_version'")
    with pytest.raises(stepdump.CorruptDataError, match="stat_chunks"):
        stepdump.open(path)


def test_a_resume_inside_a_chunk_keeps_its_earlier_rows(tmp_path: Path) -> None:
    path, snaps = _lean_run(tmp_path / "run")
    record_run(path, steps=2, start=3, start_step=3, on_error="raise", **LEAN)  # drops steps 3.. and records 3, 4 again
    with stepdump.open(path) as run:
        stats = run.stats(kind="grads")
        assert sorted(set(stats["step"])) == [0, 1, 2, 3, 4]
        per_step = stats.groupby("step").size()
        assert per_step.nunique() == 1  # every grad at every step, once
        for step in (0, 1, 2):
            at = stats[stats["step"] == step]
            for name, t in snaps[step]["grads"].items():
                fp = int(at[at["name"] == name].iloc[0]["fingerprint"])
                assert fp == signed64(xxhash.xxh3_64_intdigest(bytes(raw_bytes(t)))), (step, name)
        assert stepdump.verify(run).ok


def test_dropping_steps_rewrites_a_chunk_that_straddles_them(tmp_path: Path) -> None:
    """catalog.resume(drop_from=3) over one chunk of steps 0..5: steps 0..2 stay, exactly."""
    from stepdump.store.catalog import CatalogWriter, create, resume

    run = tmp_path / "run"
    run.mkdir()
    create(run, {})
    cat = CatalogWriter(run)
    sids = [cat.series_id("grads", f"g{i}") for i in range(3)]
    rows = [(sid, step, "float32", "4", None, 4, 0, 0, 0, float(step), 2.0, 1.0, 0.5, 3.0, 0.0, step * 100 + sid)
            for step in range(6) for sid in sids]
    cat.add_steps([(step, 1, 0, 0.0, None) for step in range(6)])
    cat.add_stat_chunk(rows)
    cat.close()
    resume(run, 3, [])
    reader = CatalogReader(run)
    try:
        a = reader.stat_arrays("grads")
        assert a.step.tolist() == [s for s in range(3) for _ in sids]
        assert a.fingerprint.tolist() == [s * 100 + sid for s in range(3) for sid in sids]
        assert a.stats["min"].tolist() == [float(s) for s in range(3) for _ in sids]
        assert reader.names("grads") == ["g0", "g1", "g2"]  # series named only by a chunk are kept
        assert reader.check_stat_chunks() == (1, [])
    finally:
        reader.close()


HOSTILE_ROWS = [
    ("rows as text", "UPDATE stat_chunks SET rows = 'many'", "stat_chunks row"),
    ("a checksum that is not an integer", "UPDATE stat_chunks SET checksum = 1.5", "stat_chunks row"),
    ("data as text", "UPDATE stat_chunks SET data = 'abc'", "has no bytes"),
    ("rows past the bound", "UPDATE stat_chunks SET rows = 1099511627776", "checksum|rows"),
]


@pytest.mark.parametrize(("what", "sql", "match"), HOSTILE_ROWS, ids=[h[0] for h in HOSTILE_ROWS])
def test_a_hostile_stat_chunks_row_is_refused_by_name(lean: tuple[Path, list], tmp_path: Path, what: str, sql: str,
                                                      match: str) -> None:
    import shutil
    path = tmp_path / "copy"
    shutil.copytree(lean[0], path)
    catalog_sql(path, sql)
    with stepdump.open(path) as run:
        with pytest.raises(stepdump.CorruptDataError, match=match):
            run.stats()
        report = stepdump.verify(run)
    assert not report.ok, what
