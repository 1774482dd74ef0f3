"""A copied gradient-log step's rows made in bulk (writer._append_copied, gradlog_rows.CopiedLayout,
describe_copied) are the rows, blobs and bytes the per-item path (Writer._item_row) makes of the same
steps: compared on two writers fed the same messages, one of them kept to the per-item path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import catalog_sql

from stepdump.capture import writer as writer_mod
from stepdump.capture.staging import Item, OwnedCopier, Slot, StagingPool, Stager
from stepdump.capture.step_state import Entry
from stepdump.capture.writer import StepMessage, Writer
from stepdump.store.catalog import create
from stepdump.store.format import LEVEL_STATS
from stepdump.store.storage import LocalStorage


def _grads(step: int, layout: int) -> list[Entry]:
    """One step's entries: small, large, 0-dim, empty, bf16, fp64, non-contiguous, NaN/Inf, a
    LayerNorm-like weight (|mean| >> std), a ``state`` tensor; layout 1 leaves some out."""
    g = torch.Generator().manual_seed(1000 + step)
    big = torch.randn(70, 80, generator=g)
    nan_large = torch.randn(5000, generator=g)
    nan_large[[3, 70]] = float("nan")
    nan_large[9] = float("inf")
    nan_small = torch.randn(40, generator=g)
    nan_small[1] = float("-inf")
    zeros = torch.randn(300, generator=g)
    zeros[::3] = 0.0
    zeros[1] = -0.0
    out = [
        Entry("grads", "h.0.bias", torch.randn(64, generator=g), True),
        Entry("grads", "h.0.weight", torch.randn(64, 256, generator=g), True),
        Entry("grads", "ln.weight", 1.0 + 1e-4 * torch.randn(64, generator=g), True),
        Entry("grads", "ln_big.weight", 3.0 + 1e-5 * torch.randn(6000, generator=g), True),
        Entry("grads", "scale", torch.randn((), generator=g), True),
        Entry("grads", "empty", torch.empty(0, 3), True),
        Entry("grads", "t.weight", big.t(), True),  # non-contiguous: staged contiguous
        Entry("grads", "bf.small", torch.randn(33, generator=g).to(torch.bfloat16), True),
        Entry("grads", "bf.large", torch.randn(5000, generator=g).to(torch.bfloat16), True),
        Entry("grads", "d.a", torch.randn(17, generator=g, dtype=torch.float64), True),
        Entry("grads", "d.b", torch.randn(3, 5, generator=g, dtype=torch.float64), True),
        Entry("grads", "nan.large", nan_large, True),
        Entry("grads", "nan.small", nan_small, True),
        Entry("grads", "zeros", zeros, True),
        Entry("grads", "pos", torch.rand(4100, generator=g) + 0.5, True),
        Entry("state", "/rng/x", torch.randint(0, 255, (21,), generator=g, dtype=torch.uint8), True),
        Entry("grads", "last.bias", torch.randn(7, generator=g), True),
        Entry("grads", "d.large", torch.randn(90, 50, generator=g, dtype=torch.float64), True),
        Entry("grads", "zeros.large", torch.where(torch.rand(5000, generator=g) < 0.3, 0.0, 1.5), True),
        Entry("grads", "wide", torch.randn(300, 256, generator=g), True),  # 300 KiB: its own append
    ]
    if layout == 1:  # grads that became None (the fp64 group left with small ones only): another copy plan
        out = [e for e in out if e.name not in ("h.0.weight", "d.large")]
    return out


FULL = 20  # entries of layout 0
# (layout of each step): a layout change and back, so the held steps of a commit mix layouts
LAYOUTS = [0, 0, 0, 1, 1, 0, 0, 1, 0, 0]


def _messages() -> list[StepMessage]:
    stager, copier, slots = Stager(), OwnedCopier(), [Slot(0), Slot(1)]
    out = []
    for step, layout in enumerate(LAYOUTS):  # two slots, as a Recorder's: a copy plan each per layout
        items = stager.stage(slots[step % 2], _grads(step, layout))
        copied = copier(items, 1 << 24)
        assert copied is not None
        extra = [Item("inputs", "batch/0", torch.arange(step, step + 9, dtype=torch.int64), True)] if step == 6 else []
        out.append(StepMessage(step, level=LEVEL_STATS, items=extra, copied=copied))
    return out


def _write(path: Path, messages: list[StepMessage]) -> Writer:
    path.mkdir()
    create(path, {})
    w = Writer(path, StagingPool(1), "raw", "flush", 4 << 20, 4, storage=LocalStorage(path))
    w.start()
    w.wait_ready()
    for m in messages:
        w.queue.put(m)
    w.queue.put(None)
    w.join()
    assert w.error is None, w.error
    return w


def _store(path: Path) -> tuple[list, list, list, bytes]:
    tensors = catalog_sql(path, "SELECT s.kind, s.name, t.* FROM tensors t JOIN series s ON s.id = t.series "
                                "ORDER BY t.series, t.step")
    blobs = catalog_sql(path, "SELECT * FROM blobs ORDER BY id")
    series = catalog_sql(path, "SELECT * FROM series ORDER BY id")
    data = b"".join(p.read_bytes() for p in sorted((path / "segments").iterdir()))
    return tensors, blobs, series, data


@pytest.mark.parametrize("held_bytes", [writer_mod.HELD_PACKED_BYTES, 1], ids=["at-commit", "each-step"])
def test_bulk_rows_are_the_per_item_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_bytes: int) -> None:
    """Bulk (described at the commit, several steps and layouts together, or step by step when the
    held bytes pass their bound) and per-item: the same tensor rows (stats bit for bit, NULLs where
    not measured), blob rows, series and segment bytes; and the bulk path did take the steps."""
    monkeypatch.setattr(writer_mod, "HELD_PACKED_BYTES", held_bytes)
    bulk: list[bool] = []
    append = Writer._append_copied

    def spy(self: Writer, *args: object) -> bool:
        got = append(self, *args)  # type: ignore[arg-type]
        bulk.append(got)
        return got

    monkeypatch.setattr(Writer, "_append_copied", spy)
    w = _write(tmp_path / "bulk", _messages())
    # Four copy plans (two slots, two layouts), two layouts worked out: one per layout.
    assert len({id(plan) for plan, _ in w._layouts.values()}) == 4
    assert len({id(layout) for _, layout in w._layouts.values()}) == 2
    # The first step opens the first segment, and a step that fills one opens the next (item by
    # item, 4 MiB segments here); every other one is in bulk.
    assert bulk[0] is False and bulk[1:].count(False) == 1 and len(bulk) == len(LAYOUTS)
    monkeypatch.setattr(Writer, "_append_copied", lambda self, *args: False)
    _write(tmp_path / "items", _messages())
    got, want = _store(tmp_path / "bulk"), _store(tmp_path / "items")
    assert len(got[0]) == sum(FULL if layout == 0 else FULL - 2 for layout in LAYOUTS) + 1
    for a, b in zip(got[0], want[0], strict=True):  # float columns compared bit for bit (NaN-safe, -0.0)
        assert [repr(v) for v in a] == [repr(v) for v in b], (a, b)
    assert got[1:] == want[1:]


def test_bulk_blobs_hold_each_tensors_bytes(tmp_path: Path) -> None:
    """Each bulk row's blob is its tensor's bytes at that step, checksummed as its fingerprint."""
    from stepdump.core.hashing import fingerprint_bytes, raw_bytes

    _write(tmp_path / "run", _messages())
    rows = catalog_sql(tmp_path / "run", "SELECT s.name, t.step, g.key, b.offset, b.length, b.checksum, "
                                         "t.fingerprint FROM tensors t JOIN series s ON s.id = t.series "
                                         "JOIN blobs b ON b.id = t.blob JOIN segments g ON g.id = b.segment "
                                         "WHERE s.kind != 'inputs'")
    assert len(rows) == sum(FULL if layout == 0 else FULL - 2 for layout in LAYOUTS)
    assert len({r[2] for r in rows}) >= 2  # the steps filled a segment and went on in the next
    for name, step, key, offset, length, checksum, fp in rows:
        data = (tmp_path / "run" / key).read_bytes()
        (want,) = [e.tensor for e in _grads(step, LAYOUTS[step]) if e.name == name]
        raw = bytes(raw_bytes(want))
        assert data[offset:offset + length] == raw, (name, step)
        assert checksum == fp == fingerprint_bytes(raw)


def test_large_stats_are_compute_stats() -> None:
    """gradlog_rows.large_stats: compute_stats of each tensor, bit for bit (its torch path's reads,
    read back together), NaN/Inf, one-sign, zeros, |mean| >> std, fp64, bf16 and small ones too."""
    from stepdump.capture.gradlog_rows import large_stats
    from stepdump.core.stats import compute_stats

    g = torch.Generator().manual_seed(7)
    buf = torch.randn(40_000, generator=g)
    buf[100:200] = 0.0
    buf[5000:5003] = float("nan")
    buf[12_000] = float("-inf")
    buf[20_000:26_000] = 2.0 + 1e-5 * buf[20_000:26_000]
    xs = [buf[1:4999], buf[4999:9000], buf[9000:15_000], buf[20_000:26_000], buf[26_000:26_010],
          buf[26_010:26_010], torch.rand(5000, generator=g, dtype=torch.float64) + 1.0,
          torch.randn(6000, generator=g).to(torch.bfloat16), torch.zeros(5000), buf[30_000:40_000]]
    got = large_stats(xs)
    assert [repr(s) for s in got] == [repr(compute_stats(x)) for x in xs]
