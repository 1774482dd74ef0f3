"""Golden bytes: format version 1 must keep reading the committed store and encoding the same bytes.

If one of these fails after a change, the change altered the on-disk format:
bump FORMAT_VERSION, update FORMAT.md and regenerate tests/golden/ on purpose.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from pathlib import Path

import numpy as np
import torch

import stepdump
from stepdump.core import tjson
from stepdump.core.hashing import fingerprint
from stepdump.store.catalog import SCHEMA
from stepdump.store.codecs import get_codec
from stepdump.store.delta import zigzag_delta

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import golden_batch, golden_model  # noqa: E402


def test_format_version_is_1():
    assert stepdump.FORMAT_VERSION == 1


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
    con = sqlite3.connect(GOLDEN / "v1_run" / "catalog.sqlite")
    tables = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"meta", "series", "segments", "blobs", "steps", "tensors", "scalars"}
    cols = {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")] for t in tables}
    assert cols["tensors"] == ["series", "step", "dtype", "shape", "blob", "numel", "nan", "posinf", "neginf",
                               "min", "max", "mean", "std", "norm", "zero_frac", "fingerprint"]
    assert cols["blobs"] == ["id", "segment", "offset", "length", "codec", "raw_length", "checksum", "base"]
    assert cols["steps"] == ["step", "level", "skipped", "time", "state"]
    assert "CREATE TABLE tensors" in SCHEMA


def test_committed_v1_store_reads_bit_exact(tmp_path):
    run_dir = tmp_path / "v1"
    shutil.copytree(GOLDEN / "v1_run", run_dir)  # opening may create -shm files
    run = stepdump.open(run_dir)
    assert run.format_version == 1 and run.steps == [0, 1, 2]
    # Rebuild the exact live values the generator saw, step by step.
    model, opt = golden_model()
    for step in range(3):
        for n, p in model.named_parameters():
            assert torch.equal(run.tensor(n, step), p.detach())
        x, y = golden_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for n, p in model.named_parameters():
            assert torch.equal(run.tensor(n, step, kind="grads"), p.grad)
        opt.step()
    assert run.scalars()["loss"].notna().all()
    assert stepdump.verify(run).ok
