"""A small gradient-log step's bytes are copied once, straight from the live tensors
(``staging.OwnedCopier.direct``), not staged into a slot and copied out of it again.

What must hold: the copies are the live bytes, exactly what the slot path made (items, order,
dtypes, shapes, bytes); a step the slot path must take (a tensor subclass, a sparse grad, a
step over the limit) still takes it; the copier keeps no live tensor alive; a recorded run's
every step holds its grads bit for bit and takes no staging slot; a failure in the copy leaves
training bitwise unchanged and stops the recording with its mark.
"""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import record_run, tiny_batch, tiny_model

import stepdump
from stepdump.capture import staging
from stepdump.capture.step_state import Entry


def _entries(seed: int) -> list[Entry]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 4, generator=g)
    return [Entry("grads", "a", torch.randn(3, 4, generator=g), True),
            Entry("grads", "t", w.t(), True),  # not contiguous: its elements in logical order
            Entry("grads", "s", torch.randn((), generator=g), True),  # 0-dim
            Entry("grads", "h", torch.randn(5, generator=g).to(torch.bfloat16), True),
            Entry("state", "/rng/t", torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8), True),
            Entry("buffers", "n", torch.arange(3, dtype=torch.int64) + seed, True),
            Entry("extra", "e", torch.randn(2, generator=g), False, None, None),  # stats only: not full
            Entry("grads", "b", torch.randn(7, generator=g, dtype=torch.float64), True)]


def _described(items: list[staging.Item]) -> list[tuple[Any, ...]]:
    return [(i.kind, i.name, i.full, i.param, i.key, i.tensor.dtype, tuple(i.tensor.shape), bytes(i.raw or b""))
            for i in items]


def test_the_direct_copy_is_the_live_bytes_as_the_slot_path_copies_them() -> None:
    copier = staging.OwnedCopier()
    for seed in range(3):  # the plan made at the first step, reused after: each step's own bytes
        entries = _entries(seed)
        direct = copier.direct(entries, 1 << 20)
        slot_copy = staging.OwnedCopier()(staging.Stager().stage(staging.Slot(0), entries), 1 << 20)
        assert direct is not None and slot_copy is not None
        items = direct.items()
        assert _described(items) == _described(slot_copy.items())
        assert direct.nbytes == slot_copy.nbytes == sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
        for item, e in zip(items, entries, strict=True):
            assert torch.equal(item.tensor, e.tensor) and item.tensor.data_ptr() != e.tensor.data_ptr()
            assert bytes(item.raw) == e.tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for e in entries:  # memory of its own: the live tensors changing after does not change it
            e.tensor.zero_()
        assert all(not torch.equal(i.tensor, e.tensor) for i, e in zip(items, entries, strict=True)
                   if i.tensor.count_nonzero() > 0)


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch on sparse and quantized tensors)
def test_what_staging_must_take_is_left_to_it() -> None:
    class Marked(torch.Tensor):
        pass

    copier = staging.OwnedCopier()
    plain = [Entry("grads", "a", torch.randn(4), True)]
    assert copier.direct(plain, 16) is not None
    assert copier.direct(plain, 15) is None  # over the limit
    sub = torch.randn(4).as_subclass(Marked)
    assert copier.direct([Entry("grads", "a", sub, True)], 1 << 20) is None  # a subclass: staging's per-tensor path
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    assert copier.direct([*plain, Entry("grads", "e", sparse, True)], 1 << 20) is None
    assert copier.direct([Entry("grads", "q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
                                True)], 1 << 20) is None
    assert copier.direct([], 1 << 20) is None


def test_the_copier_keeps_no_live_tensor_alive() -> None:
    copier = staging.OwnedCopier()
    live = torch.randn(64)
    gone = weakref.ref(live)
    assert copier.direct([Entry("grads", "a", live, True), Entry("grads", "b", torch.randn(3), True)], 1 << 20)
    del live
    gc.collect()
    assert gone() is None


def test_a_small_gradient_log_step_takes_no_slot_and_keeps_every_grad(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    acquired: list[int] = []
    real = staging.StagingPool.acquire

    def counted(self: Any, *args: Any, **kwargs: Any) -> staging.Slot:
        acquired.append(len(grads) - 1)  # the step whose pre-hook takes it (close(): the last one)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(staging.StagingPool, "acquire", counted)
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def keep(t: int, model: torch.nn.Module, opt: Any) -> None:
        grads[t] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    k, steps = 8, 12
    record_run(tmp_path / "run", steps=steps, gradient_log=k, before_step=keep)
    # The keyframes (0, 8) and the final record at close() are stored in full, through a slot; the
    # other steps copied their grads without one (each took a slot before).
    assert acquired == [0, 8, steps - 1], acquired
    with stepdump.open(tmp_path / "run") as run:
        for t in range(steps):
            for name, want in grads[t].items():
                assert torch.equal(run.tensor(name, t, "grads"), want), (t, name)


def test_a_failure_in_the_copy_leaves_training_unchanged_and_stops_the_recording(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fail_at = 3
    step = [0]
    real = staging.OwnedCopier.direct

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if step[0] >= fail_at:
            raise RuntimeError("planted in the copy")
        return real(self, *args, **kwargs)

    def train(model: torch.nn.Module, opt: Any, rec: Any = None) -> None:
        for t in range(6):
            if rec is not None:
                step[0] = rec.step
            x, y = tiny_batch(t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    plain = tiny_model()
    train(plain, torch.optim.Adam(plain.parameters(), lr=1e-2))
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monkeypatch.setattr(staging.OwnedCopier, "direct", failing)
    caplog.set_level(logging.WARNING, logger="stepdump")
    with stepdump.Recorder(tmp_path / "run", model, opt, gradient_log=16) as rec:
        train(model, opt, rec)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert any("planted in the copy" in r.getMessage() for r in caplog.records)
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["recording_stopped"]["step"] == fail_at
        assert run.all_steps == list(range(fail_at))
