"""Golden bytes: format version 1 must keep reading the committed store and encoding the same bytes.

If one of these fails after a change, the change altered the on-disk format:
bump FORMAT_VERSION, update FORMAT.md and regenerate tests/golden/ on purpose
(``python tests/golden/make_golden.py``: the store and v1_expected.json, the data that pins it).
Nothing here compares to floats computed on this host: the suite passes on every CPU's kernels.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import stepdump
from stepdump.core import tjson
from stepdump.core.hashing import fingerprint, raw_bytes
from stepdump.store.catalog import SCHEMA
from stepdump.store.codecs import get_codec
from stepdump.store.delta import zigzag_delta

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import pin_expected  # noqa: E402


def test_format_versions():
    """This stepdump reads formats 1 to 3 and creates format 1: a store becomes format 2 only
    with its first series of another fingerprint kind than xxh3 (tests/test_fp_kinds_store.py),
    format 3 with its first stat chunk (tests/test_stat_chunks.py)."""
    from stepdump.store.format import FIRST_FORMAT_VERSION, READABLE_FORMAT_VERSIONS

    assert stepdump.FORMAT_VERSION == 3
    assert FIRST_FORMAT_VERSION == 1 and READABLE_FORMAT_VERSIONS == (1, 2, 3)


def test_raw_bytes_and_fingerprint_are_pinned():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert raw.hex() == "000000000000803f0000004000004040000080400000a040"
    assert fingerprint(t) == -2534932567029015254
    assert fingerprint(torch.tensor([1.0], dtype=torch.bfloat16)) == fingerprint(torch.tensor([0x3F80], dtype=torch.int16))


def test_codecs_decode_pinned_payloads():
    raw = bytes(range(64)) * 4
    for name in ("raw", "zstd", "blosc-zstd", "blosc-lz4"):
        codec = get_codec(name)
        enc = bytes(memoryview(codec.encode(memoryview(raw), 4)).cast("B"))
        assert bytes(codec.decode(enc, len(raw))) == raw
    # A zstd frame as version 1 writes it must keep decoding.
    frame = get_codec("zstd").encode(memoryview(raw), 4)
    assert frame[:4] == bytes.fromhex("28b52ffd")  # zstd magic


def test_delta_blob_is_pinned():
    """FORMAT.md's delta codec: zigzag(int32 difference) of the bit patterns, Blosc (bit shuffle, lz4)."""
    base = np.arange(16, dtype=np.float32).tobytes()
    cur = (np.arange(16, dtype=np.float32) + np.float32(1e-5)).tobytes()
    assert [int(v) for v in zigzag_delta(cur, base, 4)[:4]] == [1850706776, 168, 84, 84]
    stored = bytes.fromhex(
        "02013604400000004000000050000000588b4f6ea800000054000000540000002a0000002a0000002a0000002a000000"
        "1400000014000000140000001400000014000000140000001400000014000000"
    )
    codec = get_codec("delta-lz4")
    assert codec.needs_base
    assert bytes(codec.decode(stored, len(cur), base)) == cur
    assert bytes(codec.encode(memoryview(cur), 4, base)) == stored  # and the writer still writes these bytes
    assert codec.keyframe.name == "blosc-lz4-bit"


def test_typed_json_is_pinned():
    tree = tjson.encode({"betas": (0.9, 0.999), 1: float("inf"), "t": torch.zeros(1)}, lambda ref, t: None)
    assert tjson.dumps(tree) == (
        '{"$dict":[["betas",{"$tuple":[0.9,0.999]}],[1,{"$float":"inf"}],["t",{"$tensor":"/t"}]]}'
    )


def test_schema_is_pinned():
    # Read-only and immutable: a plain connect would leave -wal/-shm files in the committed store.
    con = sqlite3.connect(f"file:{GOLDEN / 'v1_run' / 'catalog.sqlite'}?mode=ro&immutable=1", uri=True)
    tables = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"meta", "series", "segments", "blobs", "steps", "tensors", "scalars"}
    cols = {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")] for t in tables}
    assert cols["tensors"] == ["series", "step", "dtype", "shape", "blob", "numel", "nan", "posinf", "neginf",
                               "min", "max", "mean", "std", "norm", "zero_frac", "fingerprint"]
    assert cols["blobs"] == ["id", "segment", "offset", "length", "codec", "raw_length", "checksum", "base"]
    assert cols["steps"] == ["step", "level", "skipped", "time", "state"]
    assert "CREATE TABLE tensors" in SCHEMA


EXPECTED = json.loads((GOLDEN / "v1_expected.json").read_text())


def _pinned(kind: str, name: str, step: int) -> dict[str, Any]:
    (entry,) = [e for e in EXPECTED["tensors"] if (e["kind"], e["name"], e["step"]) == (kind, name, step)]
    return entry


def _assert_pinned(t: torch.Tensor, entry: dict[str, Any]) -> None:
    """``t`` is the pinned tensor: dtype, shape and bytes (or their xxh3-64 where only that is pinned)."""
    what = f"{entry['kind']} {entry['name']} step {entry['step']}"
    assert str(t.dtype).removeprefix("torch.") == entry["dtype"] and list(t.shape) == entry["shape"], what
    data = bytes(raw_bytes(t))
    if "hex" in entry:
        assert data.hex() == entry["hex"], what
    assert f"{xxhash.xxh3_64_intdigest(data):016x}" == entry["xxh3_64"], what


def test_expected_data_pins_the_committed_store():
    """v1_expected.json is what the committed store holds, read without stepdump (make_golden.pin_expected):
    the store's bytes are unchanged and the pinned data is not stale."""
    assert pin_expected(GOLDEN / "v1_run") == EXPECTED
    assert not list((GOLDEN / "v1_run").glob("catalog.sqlite-*"))  # reading it left no side files


def test_committed_v1_store_reads_bit_exact(tmp_path):
    """Every tensor and scalar of the committed store decodes to the pinned bytes.

    The expected values are data (tests/golden/v1_expected.json), never recomputed here: grads
    recomputed with this host's matmul differ in the last bits on another CPU (AVX-512 vs AVX2),
    which would test the host's kernels, not the format (docs/reliability.md)."""
    run_dir = tmp_path / "v1"
    shutil.copytree(GOLDEN / "v1_run", run_dir)  # opening may create -shm files
    run = stepdump.open(run_dir)
    assert run.format_version == 1 and run.steps == [0, 1, 2]
    pinned = {(e["kind"], e["name"], e["step"]) for e in EXPECTED["tensors"]}
    listed = {(k, n, t) for t in run.steps for k in run.kinds() for n in run.stored_names(t, k)}
    assert listed == {key for key in pinned if key[0] != "state"}  # every stored tensor is pinned
    assert {n for k, n, _ in pinned if k == "state"} == {"/rng/torch", "/rng/numpy/keys", "/rng/python/state"}
    for entry in EXPECTED["tensors"]:
        _assert_pinned(run.tensor(entry["name"], entry["step"], kind=entry["kind"]), entry)
    for step in run.steps:  # and through the public composite reads
        for name, t in run.state_dict(step).items():
            _assert_pinned(t, _pinned("params", name, step))
        osd = run.optimizer_state_dict(step)
        for i, name in enumerate(["weight", "bias"]):
            if step == 0:
                assert i not in osd["state"]  # SGD makes its momentum buffers at its first step
            else:
                _assert_pinned(osd["state"][i]["momentum_buffer"], _pinned("optimizer", f"{name}.momentum_buffer", step))
        rng = run.rng_state(step)
        _assert_pinned(rng["torch"], _pinned("state", "/rng/torch", step))
        _assert_pinned(rng["numpy"]["keys"], _pinned("state", "/rng/numpy/keys", step))
        _assert_pinned(rng["python"]["state"], _pinned("state", "/rng/python/state", step))
    scalars = run.scalars()
    got = [{"name": c, "step": int(t), "value": float(scalars.loc[t, c])}
           for c in sorted(c for c in scalars.columns if c != "skipped") for t in scalars.index]
    assert got == EXPECTED["scalars"]  # exact: a REAL is stored and read as the same double
    assert stepdump.verify(run).ok
