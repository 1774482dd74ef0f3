"""The gradient log's read overlaps each re-applied update with reading the next update's grads
on a worker thread (src/stepdump/read/gradlog.py, docs/gradient-log.md "Cost").

What must hold whatever the worker does: the values are bitwise the training's, every grad is
checked (checksum and fingerprint) before an update uses it, an error met on the worker is
raised on the reading thread as the same error a read without a worker raises, and no worker
thread is left running after a read, whether it returned or raised. No timing is asserted here
(benchmarks/leave_on.py --only gradlog measures it).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, catalog_sql, record_run, snapshot

import stepdump
from stepdump.errors import CorruptDataError
from stepdump.read.blobs import BlobReader
from stepdump.store.storage import LocalStorage

K = 8
STEPS = 9  # keyframes 0 and 8: reading step 7 re-applies updates 0..6


def _workers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stepdump-gradlog")]


@pytest.fixture(scope="module", params=["raw", "zstd"])
def recorded(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, dict[str, torch.Tensor]]]]:
    """A recorded gradient log (grads stored as they are, or compressed: the worker decodes them
    too) and the live params / optimizer state before each update."""
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    path = record_run(tmp_path_factory.mktemp("overlap") / "run", steps=STEPS, gradient_log=K, codec=request.param,
                      before_step=lambda t, m, o: snaps.append(snapshot(m, o)))
    assert {c for (c,) in catalog_sql(path, "SELECT DISTINCT codec FROM blobs")} == {request.param}
    return path, snaps


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count, by outcome, the grads the worker reads, and the reads done on the reading thread."""
    seen = {"ahead ok": 0, "ahead failed": 0, "read_into": 0}
    ahead, into = BlobReader.read_ahead, BlobReader.read_into

    def read_ahead(self: BlobReader, *a: Any) -> bool:
        assert threading.current_thread() is not threading.main_thread()
        ok = ahead(self, *a)
        seen["ahead ok" if ok else "ahead failed"] += 1
        return ok

    def read_into(self: BlobReader, *a: Any, **kw: Any) -> torch.Tensor:
        assert threading.current_thread() is threading.main_thread()
        seen["read_into"] += 1
        return into(self, *a, **kw)

    monkeypatch.setattr(BlobReader, "read_ahead", read_ahead)
    monkeypatch.setattr(BlobReader, "read_into", read_into)
    return seen


def _check_step(run: Any, step: int, snaps: list[dict[str, dict[str, torch.Tensor]]]) -> None:
    for kind in ("params", "optimizer"):
        got = run.tensors(step, kind)
        assert sorted(got) == sorted(snaps[step][kind])
        for name, want in snaps[step][kind].items():
            assert_same(got[name], want, f"step {step} {kind} {name}")


def test_grads_read_ahead_are_used_and_the_rebuild_is_bitwise_the_training(recorded: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path, snaps = recorded
    with stepdump.open(path) as run:
        n = len(run.names("params"))
        seen = _count(monkeypatch)
        _check_step(run, K - 1, snaps)
        assert run._gradlog is not None and run._gradlog.updates_applied == K - 1
        # The keyframe's params and update 0's grads are read by the worker while the reading
        # thread reads the keyframe's optimizer state; those of updates 1 .. K-2 while the update
        # before them ran.
        assert seen["ahead ok"] == n + (K - 1) * n and seen["ahead failed"] == 0
        assert _workers() == []  # joined when the read returned
        _check_step(run, K - 2, snaps)  # back within the segment: a fresh chain from the keyframe
    assert _workers() == []


def test_a_failing_worker_leaves_its_grads_to_the_reading_thread(recorded: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path, snaps = recorded
    seen = _count(monkeypatch)
    direct, whole = LocalStorage.read_into, LocalStorage.read
    worker = lambda: threading.current_thread() is not threading.main_thread()

    def read_into(self: LocalStorage, key: str, offset: int, buf: memoryview) -> None:
        if worker():
            direct(self, key, offset, buf[: len(buf) // 2])  # half the bytes land, then the read fails
            raise OSError("the worker's read failed")
        direct(self, key, offset, buf)

    def read(self: LocalStorage, key: str, offset: int, length: int) -> bytes:  # compressed blobs
        if worker():
            raise OSError("the worker's read failed")
        return whole(self, key, offset, length)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    monkeypatch.setattr(LocalStorage, "read", read)
    with stepdump.open(path) as run:
        n = len(run.names("params"))
        _check_step(run, K - 1, snaps)
    assert seen["ahead ok"] == 0 and seen["ahead failed"] == n + (K - 1) * n  # keyframe params, every update's grads
    assert seen["read_into"] >= (K - 1) * n  # every grad read, and checked, on the reading thread
    assert _workers() == []


def _damage(path: Path, step: int, name: str) -> None:
    """Flip one byte of the stored gradient of ``name`` at ``step`` in its segment file."""
    ((key, offset, length),) = catalog_sql(
        path, "SELECT s.key, b.offset, b.length FROM tensors t JOIN blobs b ON b.id = t.blob "
              "JOIN segments s ON s.id = b.segment WHERE t.step = ? AND t.series = "
              "(SELECT id FROM series WHERE kind = 'grads' AND name = ?)", (step, name))
    with open(path / key, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def _error_of(path: Path, step: int) -> CorruptDataError:
    with stepdump.open(path) as run, pytest.raises(CorruptDataError) as e:
        run.tensors(step, "params")
    return e.value


def test_a_damaged_grad_read_ahead_raises_the_error_of_a_read_without_the_worker(
        recorded: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, snaps = recorded
    path = tmp_path / "damaged"
    shutil.copytree(src, path)
    _damage(path, 4, "0.weight")  # update 4's grad: read by the worker while update 3 runs
    with stepdump.open(path) as run:
        _check_step(run, 4, snaps)  # before the damage is needed: as recorded
    seen = _count(monkeypatch)
    with_worker = _error_of(path, K - 1)
    assert seen["ahead failed"] == 1  # the worker met it, and the reading thread raised it
    assert "fails its checksum" in str(with_worker)
    assert _workers() == []  # joined on the error path too
    monkeypatch.setattr(BlobReader, "read_ahead", lambda *a: False)  # no worker reads: the reading thread alone
    without = _error_of(path, K - 1)
    assert (type(with_worker), str(with_worker)) == (type(without), str(without))
    assert _workers() == []


def test_verify_runs_its_segments_with_the_worker_and_leaves_no_thread(recorded: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.analysis.verify import verify

    path, _ = recorded
    seen = _count(monkeypatch)
    with stepdump.open(path) as run:
        report = verify(run)
    assert report.problems == [] and report.segments_checked >= 1
    assert seen["ahead ok"] > 0 and seen["ahead failed"] == 0
    assert _workers() == []
