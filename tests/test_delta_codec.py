"""Delta codecs (delta-lz4, delta-zstd): exact bytes back, bounded chains, damage found, fewer bytes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import MLP, assert_run_matches, train_recorded
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stepdump
from stepdump.store.codecs import CODEC_NAMES, SeriesEncoder, get_codec
from stepdump.store.delta import undo_zigzag_delta, zigzag_delta


def _train(path: Path, model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0,
           **kwargs) -> list[dict]:
    return train_recorded(path, model, opt, steps, start, **kwargs)


def _blobs(path: Path) -> list[tuple]:
    con = sqlite3.connect(path / "catalog.sqlite")
    try:
        return con.execute("SELECT id, codec, base, segment, offset, length FROM blobs ORDER BY id").fetchall()
    finally:
        con.close()


@given(data=st.binary(min_size=0, max_size=256), base=st.binary(min_size=0, max_size=256),
       width=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=200, deadline=None)
def test_zigzag_delta_is_exact_for_any_bytes(data, base, width):
    n = min(len(data), len(base)) // width * width
    cur, ref = data[:n], base[:n]
    z = zigzag_delta(cur, ref, width)
    assert bytes(undo_zigzag_delta(z.copy(), ref, width)) == cur


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_round_trips_through_the_one_interface(name):
    """What the writer and the reader do, with no case for delta codecs: SeriesEncoder picks
    bases and codec names, and the codec named on each blob decodes it given its base's bytes."""
    codec = get_codec(name)
    assert not codec.keyframe.needs_base  # a chain always starts somewhere
    if not codec.needs_base:
        assert codec.keyframe is codec
    enc = SeriesEncoder(codec, chain=3)
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal(256).astype(np.float32)]
    for _ in range(6):
        steps.append(steps[-1] + np.float32(1e-3) * rng.standard_normal(256).astype(np.float32))
    stored: dict[int, bytes] = {}  # blob id -> raw bytes, what a reader decodes bases to
    bases = []
    for blob_id, arr in enumerate(steps, start=1):
        raw = arr.tobytes()
        data, base, codec_name = enc.encode(7, blob_id, memoryview(raw), 4)
        bases.append(base)
        decoder = get_codec(codec_name)
        assert decoder.needs_base == (base is not None)
        out = decoder.decode(bytes(memoryview(data).cast("B")), len(raw), stored[base] if base else None)
        assert bytes(out) == raw
        stored[blob_id] = raw
    want = [None, 1, 2, None, 4, 5, None] if codec.needs_base else [None] * 7  # a keyframe every 3 blobs
    assert bases == want
    data, base, codec_name = enc.encode(None, 99, memoryview(steps[0].tobytes()), 4)  # a blob of no series
    assert base is None and codec_name == codec.keyframe.name


def test_zigzag_delta_of_a_small_change_has_small_numbers():
    a = np.linspace(-1, 1, 1000, dtype=np.float32)
    b = np.nextafter(a, np.float32(2))  # every element one ulp up (crossing 0 included)
    z = zigzag_delta(b.tobytes(), a.tobytes(), 4)
    assert int(z.max()) <= 2 ** 24  # not the 2**32 a wrong sign convention would give
    assert bytes(undo_zigzag_delta(z, a.tobytes(), 4)) == b.tobytes()


@pytest.mark.parametrize("codec", ["delta-lz4", "delta-zstd"])
def test_delta_run_reads_back_bitwise_with_bounded_chains_across_resume(tmp_path, codec):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = tmp_path / "run"
    snaps = _train(path, model, opt, 9, codec=codec, delta_chain=4)
    snaps += _train(path, model, opt, 3, start=9, codec=codec, delta_chain=4)  # a second writer session
    with stepdump.open(path) as run:
        # backwards, forwards and at random: every order of reads rebuilds the same bytes
        for t in [11, 0, 5, 3, 10, 1, 2, 4, 6, 7, 8, 9]:
            assert_run_matches(run, t, snaps[t])
        assert stepdump.verify(run).ok
    rows = _blobs(path)
    names = {r[1] for r in rows}
    assert names == {codec, get_codec(codec).keyframe.name}
    by_id = {r[0]: r for r in rows}
    deltas = [r for r in rows if r[2] is not None]
    assert deltas and all(r[1] == codec for r in deltas)
    assert all(r[1] != codec for r in rows if r[2] is None)  # keyframes are self-contained
    for r in rows:  # no chain is longer than delta_chain blobs, bases come first
        depth, cur = 1, r
        while cur[2] is not None:
            assert cur[2] < cur[0]
            cur = by_id[cur[2]]
            depth += 1
        assert depth <= 4
    # the resumed session starts with keyframes: no delta of its first step points into session one
    con = sqlite3.connect(path / "catalog.sqlite")
    first_of_second = con.execute("SELECT min(blob) FROM tensors WHERE step = 9 AND blob IS NOT NULL").fetchone()[0]
    con.close()
    second = [r for r in rows if r[0] >= first_of_second]
    assert all(r[2] is None or r[2] >= first_of_second for r in second)


def test_delta_codec_stores_fewer_bytes_than_its_keyframe_codec(tmp_path):
    """Slowly changing state (small lr) is what deltas are for: measured, not assumed."""
    sizes = {}
    for codec in ("blosc-lz4-bit", "delta-lz4"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        with stepdump.Recorder(tmp_path / codec, model, opt, codec=codec, capture=("params", "optimizer")):
            for t in range(8):
                x = torch.randn(32, 64, generator=torch.Generator().manual_seed(t))
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        sizes[codec] = sum(r[5] for r in _blobs(tmp_path / codec))
        with stepdump.open(tmp_path / codec) as run:  # what `stepdump info` shows as "tensor data"
            stored, raw = run.blob_bytes()
        con = sqlite3.connect(tmp_path / codec / "catalog.sqlite")
        raw_total = con.execute("SELECT sum(raw_length) FROM blobs").fetchone()[0]
        con.close()
        assert stored == sizes[codec] and raw == raw_total
        assert raw > 7 * 3 * sum(p.numel() * 4 for p in model.parameters())  # params + Adam moments, 7+ steps
    assert sizes["delta-lz4"] < 0.9 * sizes["blosc-lz4-bit"], sizes


def test_delta_chain_must_be_positive(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(stepdump.ConfigError, match="delta_chain"):
            stepdump.Recorder(tmp_path / "r", model, opt, codec="delta-lz4", delta_chain=bad)


def test_delta_chain_one_means_keyframes_only(tmp_path):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(tmp_path / "run", model, opt, 3, codec="delta-lz4", delta_chain=1)
    assert all(r[2] is None for r in _blobs(tmp_path / "run"))


# -- damage -------------------------------------------------------------------------------------


def _delta_run(tmp_path: Path) -> tuple[Path, list[dict]]:
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = tmp_path / "run"
    return path, _train(path, model, opt, 5, codec="delta-lz4", delta_chain=8)


def _flip_byte_of_blob(path: Path, blob_id: int) -> None:
    con = sqlite3.connect(path / "catalog.sqlite")
    key, off, ln = con.execute("SELECT s.key, b.offset, b.length FROM blobs b JOIN segments s ON s.id = b.segment "
                               "WHERE b.id = ?", (blob_id,)).fetchone()
    con.close()
    with open(path / key, "r+b") as f:
        f.seek(off + ln // 2)
        b = f.read(1)[0]
        f.seek(off + ln // 2)
        f.write(bytes([b ^ 0x10]))


def test_a_damaged_keyframe_makes_its_deltas_unreadable_not_wrong(tmp_path):
    path, snaps = _delta_run(tmp_path)
    con = sqlite3.connect(path / "catalog.sqlite")
    blob0 = con.execute("SELECT t.blob FROM tensors t JOIN series s ON s.id = t.series "
                        "WHERE s.kind = 'params' AND s.name = 'fc1.weight' AND t.step = 0").fetchone()[0]
    con.close()
    _flip_byte_of_blob(path, blob0)
    with stepdump.open(path) as run:
        assert run.steps == [0, 1, 2, 3, 4, 5] and run.meta["final_step"] == 5
        for t in range(6):  # the final record 5 is a delta on the keyframe too
            with pytest.raises(stepdump.CorruptDataError, match="checksum") as e:
                run.tensor("fc1.weight", t, kind="params")
            if t:
                assert f"delta on blob {blob0}" in str(e.value)
            if t < 5:
                assert torch.equal(run.tensor("fc1.bias", t, kind="params"), snaps[t]["params"]["fc1.bias"])
        run.tensor("fc1.bias", 5, kind="params")  # its other tensors read back
        report = stepdump.verify(run)
    assert not report.ok
    assert len(report.problems) == 6  # the keyframe and the five deltas built on it (final record 5's too)
    assert any(f"blob {blob0} " in p.where for p in report.problems)


@pytest.mark.parametrize("sql, match", [
    ("UPDATE blobs SET base = id WHERE base IS NOT NULL", "not an earlier blob"),
    ("UPDATE blobs SET base = id + 1 WHERE base IS NOT NULL", "not an earlier blob"),
    ("UPDATE blobs SET base = 'x' WHERE base IS NOT NULL", "not an earlier blob"),
    ("UPDATE blobs SET base = NULL WHERE base IS NOT NULL", "names no base"),
    ("UPDATE blobs SET base = 1 WHERE base IS NULL AND id > 1", "names base blob 1"),
    ("UPDATE blobs SET codec = 'raw' WHERE base IS NOT NULL", "names base blob"),
])
def test_hostile_delta_rows_are_refused(tmp_path, sql, match):
    path, _ = _delta_run(tmp_path)
    con = sqlite3.connect(path / "catalog.sqlite")
    with con:
        con.execute(sql)
    con.close()
    with stepdump.open(path) as run:
        errors = []
        for t in range(5):
            for name in run.names("params"):
                try:
                    run.tensor(name, t, kind="params")
                except stepdump.CorruptDataError as e:
                    errors.append(str(e))
    assert errors and any(match in e for e in errors), errors[:3]


def test_a_base_of_another_size_is_refused(tmp_path):
    path, _ = _delta_run(tmp_path)
    con = sqlite3.connect(path / "catalog.sqlite")
    small = con.execute("SELECT id FROM blobs WHERE base IS NULL ORDER BY raw_length LIMIT 1").fetchone()[0]
    big = con.execute("SELECT id FROM blobs WHERE base IS NOT NULL AND id > ? ORDER BY raw_length DESC LIMIT 1",
                      (small,)).fetchone()[0]
    with con:
        con.execute("UPDATE blobs SET base = ? WHERE id = ?", (small, big))
    con.close()
    with stepdump.open(path) as run:
        report = stepdump.verify(run)
    assert any("base of" in p.detail for p in report.problems), report.problems


def test_delta_chain_longer_than_readers_follow_is_refused(tmp_path):
    from stepdump.store.delta import MAX_DELTA_CHAIN

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(stepdump.ConfigError, match=str(MAX_DELTA_CHAIN)):
        stepdump.Recorder(tmp_path / "r", model, opt, codec="delta-lz4", delta_chain=MAX_DELTA_CHAIN + 1)


def test_cache_stays_consistent_when_threads_read_one_run(tmp_path):
    """Several threads reading delta chains through one Run: same bytes, no cache errors."""
    import threading

    path, snaps = _delta_run(tmp_path)
    errors: list[BaseException] = []
    with stepdump.open(path) as run:
        blobs = run._blobs
        blobs_cache_limit = 64 << 10  # tiny, so evictions happen all the time
        import stepdump.read.blobs as blobs_mod

        old = blobs_mod.CACHE_BYTES
        blobs_mod.CACHE_BYTES = blobs_cache_limit
        try:
            def reader(seed: int) -> None:
                order = [(t, n) for t in range(5) for n in snaps[t]["params"]]
                order = order[seed:] + order[:seed]
                try:
                    for _ in range(3):
                        for t, n in order:
                            assert torch.equal(run.tensor(n, t, kind="params"), snaps[t]["params"][n])
                except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                    errors.append(e)

            threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            blobs_mod.CACHE_BYTES = old
        assert not errors, errors[:1]
        assert blobs._cache_bytes == sum(len(v) for v in blobs._cache.values())
