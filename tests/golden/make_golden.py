"""Regenerate tests/golden/v1_run (only when FORMAT_VERSION changes on purpose), and the data that
pins what it holds, v1_expected.json.

    .venv/bin/python tests/golden/make_golden.py             # a new store AND its v1_expected.json
    .venv/bin/python tests/golden/make_golden.py --expected  # only v1_expected.json, from the committed store

v1_expected.json holds the exact bytes (hex) and xxh3-64 of every tensor the store holds, and its
scalars, read straight from the catalog and the segment file with sqlite3 and xxhash (no stepdump
code), each checked against the checksum and fingerprint the writer put in the catalog.
tests/test_format_golden.py compares what stepdump decodes to these: it never recomputes the
values with this host's kernels (a grad made by an AVX-512 matmul differs in the last bits from
an AVX2 one, and the format is not what that would test).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import torch
import xxhash

import stepdump

HERE = Path(__file__).parent


def golden_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def golden_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / (step + 1)
    return x, torch.ones(4, 2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rec: stepdump.Recorder | None, steps: int = 3) -> None:
    for step in range(steps):
        x, y = golden_batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rec is not None:
            rec.log(loss=loss)


#: Tensors of at most this many bytes have their bytes in v1_expected.json, larger ones their xxh3-64 only.
HEX_UP_TO = 256


def pin_expected(run_dir: Path) -> dict[str, Any]:
    """What the store at ``run_dir`` holds, independently of stepdump's reader: each tensor's dtype,
    shape, xxh3-64 (16 hex digits, unsigned) and bytes (hex), and each scalar's value."""
    # immutable: no -wal/-shm files beside the committed store (its catalog is in WAL mode)
    con = sqlite3.connect(f"file:{run_dir / 'catalog.sqlite'}?mode=ro&immutable=1", uri=True)
    try:
        rows = con.execute(
            "SELECT s.kind, s.name, t.step, t.dtype, t.shape, t.fingerprint, b.codec, b.offset, b.length,"
            " b.raw_length, b.checksum, g.key FROM tensors t JOIN series s ON s.id = t.series"
            " JOIN blobs b ON b.id = t.blob JOIN segments g ON g.id = b.segment"
            " ORDER BY s.kind, s.name, t.step").fetchall()
        scalars = con.execute("SELECT name, step, value FROM scalars ORDER BY name, step").fetchall()
    finally:
        con.close()
    tensors = []
    for kind, name, step, dtype, shape, fp, codec, offset, length, raw_length, checksum, key in rows:
        if codec != "raw" or length != raw_length:  # other codecs would need stepdump to decode
            raise SystemExit(f"{kind} {name} step {step}: codec {codec}; pin_expected reads raw blobs only")
        with open(run_dir / key, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        digest = xxhash.xxh3_64_intdigest(data)
        if digest != checksum % 2**64 or digest != fp % 2**64:  # the writer's own hashes of these bytes
            raise SystemExit(f"{kind} {name} step {step}: the bytes do not match the catalog's checksum")
        entry = {"kind": kind, "name": name, "step": step, "dtype": dtype,
                 "shape": [int(d) for d in shape.split(",")] if shape else [], "xxh3_64": f"{digest:016x}"}
        if length <= HEX_UP_TO:  # the values themselves where small; the RNG states (~5 KB) by hash
            entry["hex"] = data.hex()
        tensors.append(entry)
    return {"store": run_dir.name, "regenerate": "python tests/golden/make_golden.py --expected",
            "tensors": tensors, "scalars": [{"name": n, "step": t, "value": v} for n, t, v in scalars]}


def write_expected(run_dir: Path = HERE / "v1_run") -> Path:
    out = HERE / "v1_expected.json"
    pinned = pin_expected(run_dir)
    # One tensor or scalar a line: a regenerated file diffs readably.
    parts = [f" {json.dumps(k)}: " + ("[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
                                       if isinstance(v, list) else json.dumps(v)) for k, v in pinned.items()]
    out.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    return out


def main() -> None:
    out = HERE / "v1_run"
    if "--expected" not in sys.argv[1:]:
        shutil.rmtree(out, ignore_errors=True)
        model, opt = golden_model()
        with stepdump.Recorder(out, model, opt) as rec:
            train(model, opt, rec)
        (out / "LOCK").unlink()
    print(write_expected(out))


if __name__ == "__main__":
    main()
