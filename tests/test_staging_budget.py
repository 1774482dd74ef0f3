"""Staging memory is a fixed budget (issue 14): tensors beyond it are written live, while the
training thread waits in the pre-hook; records and training stay bitwise what they were."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import assert_run_matches, snapshot
from reliability.faults import FullDisk, HookedStorage, slow_disk
from torch import nn

import stepdump
from stepdump.capture.appender import Appender
from stepdump.capture.staging import Stager, StagingPool
from stepdump.capture.step_state import Entry
from stepdump.errors import ConfigError, StepNotFoundError, WriterError

STEPS = 6


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.BatchNorm1d(64), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _iteration(model: nn.Module, opt: torch.optim.Optimizer, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def _train(path, steps: int = STEPS, **kwargs):
    """Train under a Recorder; return (model, snapshots taken right before each optimizer.step(), rec)."""
    model, opt = _model()
    snaps = []
    with stepdump.Recorder(path, model, opt, on_error="raise", **kwargs) as rec:
        for t in range(steps):
            loss = _iteration(model, opt, t)
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    return model, snaps, rec


def _unrecorded(steps: int = STEPS) -> nn.Module:
    model, opt = _model()
    for t in range(steps):
        _iteration(model, opt, t)
        opt.step()
    return model


def _record_bytes(snap) -> int:
    return sum(t.numel() * t.element_size() for kind in snap.values() for t in kind.values())


@pytest.mark.parametrize("budget,storage", [
    (0, None),  # nothing copied: every tensor written live
    (1024, None),  # a few biases copied, the rest live
    (1024, slow_disk(0.002)),  # a disk slower than training: the live wait must hold the optimizer back
    (3 << 20, None),  # a few MiB: the whole record fits, as before the budget
    (None, None),  # the default
], ids=["0", "1KiB", "1KiB-slow-disk", "3MiB", "default"])
def test_any_budget_records_the_live_tensors_bit_for_bit_and_training_is_unchanged(tmp_path, budget, storage):
    kwargs = {} if budget is None else {"staging_bytes": budget}
    if storage is not None:
        kwargs["storage"] = storage
    model, snaps, _ = _train(tmp_path / "run", **kwargs)
    run = stepdump.open(tmp_path / "run")
    assert run.steps[:STEPS] == list(range(STEPS))
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)
        for name, b in model.named_buffers():  # the BatchNorm running stats go through staging too
            assert run.tensor(name, t, kind="buffers").shape == b.shape
    for (name, p), q in zip(model.named_parameters(), _unrecorded().parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("codec", ["zstd", "delta-lz4"])
def test_live_tensors_through_a_compressing_codec_are_exact(tmp_path, codec):
    """A codec's output for a live tensor is owned by the writer; the bytes stored are still exact."""
    _, snaps, _ = _train(tmp_path / "run", staging_bytes=0, codec=codec)
    run = stepdump.open(tmp_path / "run")
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)


def test_staging_memory_stays_within_the_budget_however_big_the_record(tmp_path):
    budget = 3 << 10
    model, opt = _model()
    held = []
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", staging_bytes=budget,
                           queue_depth=3) as rec:
        pool = rec._pool
        for t in range(STEPS):
            _iteration(model, opt, t)
            opt.step()
            held.append(pool.staged_bytes)
        record = _record_bytes(snapshot(model, opt))
    assert record > 10 * budget  # the record is many times the budget...
    assert max(held) <= budget  # ...and staging never held more than the budget
    assert max(held) > 0  # the budget was used, not ignored
    assert held[-1] == held[-2]  # buffers are kept and reused across steps, not reallocated


def test_a_slot_copies_while_its_budget_lasts_and_reuses_its_buffers():
    pool = StagingPool(2, budget=2 * 1000)  # 1000 bytes per slot
    stager = Stager()
    small, big, other = torch.arange(100.0), torch.arange(1000.0), torch.arange(50.0)  # 400, 4000, 200 bytes
    entries = [Entry("params", "small", small, True), Entry("params", "big", big, True),
               Entry("params", "other", other, True)]
    slot = pool.acquire(lambda: None)
    items = stager.stage(slot, entries)
    assert [(i.name, i.live) for i in items] == [("big", True), ("small", False), ("other", False)]  # live first
    assert items[0].tensor.data_ptr() == big.data_ptr()  # the live tensor itself, not a copy
    assert torch.equal(items[1].tensor, small) and items[1].tensor.data_ptr() != small.data_ptr()
    assert slot.has_live and slot.held == 600 and pool.staged_bytes == 600
    first_buffer = items[1].tensor
    again = stager.stage(slot, entries)
    assert again[1].tensor is first_buffer and slot.held == 600  # reused, nothing new allocated
    # A tensor whose shape changed gives its old buffer's bytes back before taking new ones.
    grown = [Entry("params", "small", torch.arange(200.0), True)]
    assert not stager.stage(slot, grown)[0].live and slot.held == 1000
    pool.release(slot)


def test_a_pool_without_budget_copies_everything():
    pool = StagingPool(1, budget=None)  # ring mode
    slot = pool.acquire(lambda: None)
    items = Stager().stage(slot, [Entry("params", "w", torch.ones(10_000), True)])
    assert not items[0].live and not slot.has_live and pool.staged_bytes == 40_000


def test_the_appender_caps_owned_bytes_waiting_for_the_disk(tmp_path):
    seen = []
    app = Appender(HookedStorage(tmp_path, lambda key, n: seen.append(app.pending)), max_pending=100)
    app.start()
    chunks = [bytes([i]) * 60 for i in range(30)] + [b"x" * 500]  # the last is bigger than the cap: alone
    offset = 0
    for c in chunks:
        app.append("segments/000001.seg", bytearray(c), offset, owned=True)
        offset += len(c)
    app.wait()
    app.stop()
    app.storage.close()
    assert (tmp_path / "segments" / "000001.seg").read_bytes() == b"".join(chunks)
    assert max(seen[:-1]) <= 100 and seen[-1] == 500
    assert app.pending == 0


def _train_in_thread(target) -> threading.Thread:
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout=60)  # a liveness bound, not a timing assert: a hang would never end
    return th


def test_a_writer_failure_while_training_waits_on_live_tensors_raises_instead_of_hanging(tmp_path):
    disk = FullDisk(armed=True, room=3)
    model, opt = _model()
    caught: list[BaseException] = []

    def train() -> None:
        try:
            with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", staging_bytes=0,
                                   storage=disk.storage) as rec:
                for t in range(STEPS):
                    _iteration(model, opt, t)
                    opt.step()
                    rec.log(loss=1.0)
        except WriterError as e:
            caught.append(e)

    assert not _train_in_thread(train).is_alive()
    assert caught and "No space left on device" in str(caught[0])
    assert disk.calls >= 1


def test_a_writer_failure_while_training_waits_on_live_tensors_steps_aside_with_on_error_warn(tmp_path, caplog):
    disk = FullDisk(armed=True, room=3)
    model, opt = _model()

    def train() -> None:
        with stepdump.Recorder(tmp_path / "run", model, opt, staging_bytes=0, storage=disk.storage) as rec:
            for t in range(STEPS):
                _iteration(model, opt, t)
                opt.step()  # never raises
                rec.log(loss=1.0)

    with caplog.at_level(logging.WARNING, logger="stepdump"):
        assert not _train_in_thread(train).is_alive()
    stopped = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert len(stopped) == 1 and "No space left on device" in stopped[0].getMessage()
    for (name, p), q in zip(model.named_parameters(), _unrecorded().parameters()):
        assert torch.equal(p, q), name
    assert "recording_stopped" in stepdump.open(tmp_path / "run").meta


def test_ring_mode_keeps_whole_steps_whatever_the_budget(tmp_path):
    """A ring holds its last N steps in full by definition: its slots have no budget."""
    fire = 4
    model, snaps, rec = _train(tmp_path / "run", ring=2, after=0, staging_bytes=0,
                               trigger=lambda info: info.step == fire)
    assert rec._pool.budget is None
    run = stepdump.open(tmp_path / "run")
    for t in (fire - 2, fire - 1, fire):
        assert_run_matches(run, t, snaps[t])
    with pytest.raises(StepNotFoundError, match="only stats"):  # back to holding steps in memory
        run.tensors(fire + 1, "params")
    for (name, p), q in zip(model.named_parameters(), _unrecorded().parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("value", [-1, True, 1.5, "64MiB"])
def test_staging_bytes_is_checked(tmp_path, value):
    model, opt = _model()
    with pytest.raises(ConfigError, match="staging_bytes="):
        stepdump.Recorder(tmp_path / "run", model, opt, staging_bytes=value)


def test_staging_bytes_in_store_options(tmp_path):
    model, opt = _model()
    with stepdump.Recorder(tmp_path / "run", model, opt, store=stepdump.options.StoreOptions(staging_bytes=4096)) as rec:
        assert rec.options.store.staging_bytes == 4096
        assert rec._pool.budget == 4096
