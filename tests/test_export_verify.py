"""Export to checkpoints and verify a store's blobs."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import record_run, tiny_model
from safetensors.torch import load_file

import stepdump


def test_export_round_trips_into_fresh_objects(tmp_path):
    run = stepdump.open(record_run(tmp_path / "run", steps=12))
    out = run.export(6, tmp_path / "ckpt.pt")
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["step"] == 6
    model = tiny_model(123)
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    for name, p in model.named_parameters():
        assert torch.equal(p, run.tensor(name, 6))
        for key, v in opt.state[p].items():
            assert torch.equal(v, run.tensor(f"{name}.{key}", 6, kind="optimizer"))
    assert opt.param_groups[0]["lr"] == run.optimizer_state_dict(6)["param_groups"][0]["lr"]
    assert sched.last_epoch == run.scheduler_state_dict(6)["last_epoch"]
    assert ckpt["scaler"] is None


def test_export_safetensors_with_grads(tmp_path):
    run = stepdump.open(record_run(tmp_path / "run", steps=3))
    out = run.export(2, tmp_path / "s.safetensors", format="safetensors", grads=True)
    tensors = load_file(out)
    assert torch.equal(tensors["0.weight"], run.tensor("0.weight", 2))
    assert torch.equal(tensors["grads/2.bias"], run.tensor("2.bias", 2, kind="grads"))
    with pytest.raises(stepdump.ConfigError, match="unknown export format"):
        run.export(2, tmp_path / "x", format="npz")
    with pytest.raises(stepdump.StepNotFoundError, match="nearest recorded steps"):
        run.export(99, tmp_path / "y.pt")
    assert not (tmp_path / "y.pt").exists() and not (tmp_path / "y.pt.partial").exists()


def test_verify_intact_then_names_every_flipped_blob(tmp_path):
    path = record_run(tmp_path / "run", steps=5)
    run = stepdump.open(path)
    report = stepdump.verify(run)
    assert report.ok and report.blobs_checked > 0
    # Flip one byte inside two different blobs.
    rows = run._con.execute(
        "SELECT b.id, s.key, b.offset, b.length FROM blobs b JOIN segments s ON s.id=b.segment "
        "WHERE b.length > 8 ORDER BY b.id LIMIT 2"
    ).fetchall()
    for _bid, key, offset, length in rows:
        with open(path / key, "r+b") as f:
            f.seek(offset + length // 2)
            b = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([b[0] ^ 0x10]))
    run.close()
    run = stepdump.open(path)
    report = stepdump.verify(run)
    assert not report.ok
    assert {p.where.split()[1] for p in report.problems} == {str(r[0]) for r in rows}
    assert all("checksum" in p.detail for p in report.problems)
    bad = run._con.execute(
        "SELECT s.kind, s.name, t.step FROM tensors t JOIN series s ON s.id=t.series WHERE t.blob=?", (rows[0][0],)
    ).fetchone()
    with pytest.raises(stepdump.CorruptDataError, match="checksum"):
        run.tensor(bad[1], bad[2], kind=bad[0])


def test_truncated_segment_is_reported(tmp_path):
    path = record_run(tmp_path / "run", steps=3)
    seg = next((path / "segments").glob("*.seg"))
    os.truncate(seg, seg.stat().st_size // 2)
    with stepdump.open(path) as run:
        report = stepdump.verify(run)
        assert not report.ok
        assert any("truncated" in p.detail for p in report.problems)
