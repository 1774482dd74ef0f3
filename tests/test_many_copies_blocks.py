"""Held copies of one layout described together in blocks (packed.blocks): however many steps a
commit window holds, a layout keeps one :class:`~stepdump.capture.packed.Segments` (a whole
block's; a smaller block is described by its head) and builds none once it has it, and every
copy's rows and columns are those it gets described alone, bit for bit (lean snapshots:
packed.describe_all / describe_columns; copied gradient-log steps: gradlog_rows.describe_copied)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lean_packed import CONTENTS, _tensor

from stepdump.capture import packed
from stepdump.capture.gradlog_rows import CopiedLayout, CopiedStep, describe_copied
from stepdump.capture.staging import OwnedCopier, Slot, Stager
from stepdump.capture.step_state import Entry
from stepdump.capture.writer import _DIRECT_WRITE, _NO_STATS, _SHARED_KINDS

STEPS = 100  # a millisecond loop's commit window holds 40-80 steps


def _count_segments(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tensors of each Segments built from now on."""
    built: list[int] = []
    real = packed.Segments.__init__

    def spy(self: packed.Segments, kinds, sizes, itemsize) -> None:  # type: ignore[no-untyped-def]
        built.append(len(sizes))
        real(self, kinds, sizes, itemsize)

    monkeypatch.setattr(packed.Segments, "__init__", spy)
    return built


def _lean_entries(step: int) -> list[Entry]:
    """One step's entries (one layout at every step): fp32 and fp64 small tensors whose contents
    change with the step (NaN, Inf, zeros, -0.0, |mean| >> std, ...), and a state tensor."""
    g = torch.Generator().manual_seed(step)
    content = CONTENTS[step % len(CONTENTS)]
    ts = [_tensor(content if i % 2 else "normal", n, dtype, g)
          for i, (n, dtype) in enumerate([(7, torch.float32), (64, torch.float32), (300, torch.float32),
                                          (1, torch.float32), (33, torch.float64), (5, torch.float64)])]
    kinds = ["params", "grads", "optimizer", "params", "grads", "optimizer"]
    return [Entry(k, f"t{i}", t, False) for i, (k, t) in enumerate(zip(kinds, ts, strict=True))] + \
        [Entry("state", "s", torch.arange(6, dtype=torch.float32), False)]


def _columns_bits(blocks: list[packed.StatBlock]) -> list[tuple[bytes, bytes, bytes]]:
    """A snapshot's columns as bytes: every bit of every value (NaN and -0.0 included)."""
    out = []
    for b in blocks:
        c = b.columns
        out.append((np.ascontiguousarray(c.counts).tobytes(), np.ascontiguousarray(c.floats).tobytes(),
                    np.ascontiguousarray(c.fps).tobytes()))
    return out


@pytest.mark.parametrize("block_bytes", [None, 3100], ids=["default", "blocks-of-a-few-copies"])  # 3100: 2 and 10
def test_lean_copies_of_any_count_keep_one_segments_and_give_each_copys_rows(
        monkeypatch: pytest.MonkeyPatch, block_bytes: int | None) -> None:
    if block_bytes is not None:  # (the batches' block size is set when the plan makes them)
        monkeypatch.setattr(packed, "MANY_BYTES", block_bytes)
    first = _lean_entries(0)
    plan = packed.Plan(first, packed.layout_key(first))
    assert len(plan.batches) == 2  # fp32 and fp64
    snaps = [plan.snapshot(_lean_entries(step)) for step in range(STEPS)]
    rows_alone = [repr(packed.describe_all([s])[0]) for s in snaps]
    cols_alone = [_columns_bits(packed.describe_columns([s])[0]) for s in snaps]
    assert len(set(rows_alone)) == STEPS  # the control: every copy's rows differ
    built = _count_segments(monkeypatch)
    for m in range(1, STEPS + 1):
        held = snaps[:m]
        assert [repr(r) for r in packed.describe_all(held)] == rows_alone[:m], m
        assert [_columns_bits(c) for c in packed.describe_columns(held)] == cols_alone[:m], m
    # One Segments per batch: a whole block's (a batch's own, of one copy, was made with the plan).
    assert len(built) <= 2, built
    for b in plan.batches:
        assert b._block is not None and b._block.k == b.segs.k * b._per_block
    # Once built, none more: another window of every count builds nothing.
    del built[:]
    for m in range(2, STEPS + 1):
        packed.describe_columns(snaps[:m])
    assert built == []


def test_blocks_cover_the_copies_in_whole_blocks_then_the_rest() -> None:
    for per_block in (1, 4, 7, 64):
        for m in range(1, 200):
            got = packed.blocks(m, per_block)
            assert [b.first for b in got] == [sum(b.copies for b in got[:i]) for i in range(len(got))]
            assert sum(b.copies for b in got) == m
            assert all(b.copies == per_block for b in got[:-1]) and 0 < got[-1].copies <= per_block, (m, got)
            assert len(got) == -(-m // per_block)
    assert packed.copies_per_block(150 << 10) == 13  # a PPO-sized copy (153 KiB): 13 in 2 MiB
    assert packed.copies_per_block(10) == packed.MANY_COPIES
    assert packed.copies_per_block(packed.MANY_BYTES * 3) == 1


def _gradlog_entries(step: int) -> list[Entry]:
    """A copied gradient-log step: small fp32 and fp64 grads (packed), a larger one and a bf16 one
    (described alone), a state tensor (no stats), contents changing with the step."""
    g = torch.Generator().manual_seed(500 + step)
    content = CONTENTS[step % len(CONTENTS)]
    specs = [("grads", 64, torch.float32), ("grads", 7, torch.float32), ("grads", 40, torch.float32),
             ("grads", 5000, torch.float32), ("grads", 33, torch.bfloat16), ("grads", 17, torch.float64),
             ("grads", 3, torch.float64), ("optimizer", 12, torch.float32)]
    out = [Entry(kind, f"g{i}", _tensor(content if i % 2 else "normal", n, torch.float64, g).to(dtype), True)
           for i, (kind, n, dtype) in enumerate(specs)]
    out.append(Entry("state", "/rng", torch.randint(0, 255, (21,), generator=g, dtype=torch.uint8), True))
    return out


def test_copied_gradlog_steps_of_any_count_keep_one_segments_and_give_each_steps_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stager, copier, slot = Stager(), OwnedCopier(), Slot(0)
    copies = []
    for step in range(STEPS):
        got = copier(stager.stage(slot, _gradlog_entries(step)), 1 << 24)
        assert got is not None
        copies.append(got)
    assert len({id(c.plan) for c in copies}) == 1  # one layout
    layout = CopiedLayout(copies[0].plan, _NO_STATS, _SHARED_KINDS, _DIRECT_WRITE)
    assert layout.bulk and sum(len(p) for p, _ in layout.packed) == 6  # the small fp32 and fp64 ones
    steps = [CopiedStep(t, layout, c.buffers, layout.raws(c.buffers), list(range(layout.k)), t * layout.k, 1,
                        t * layout.total, "raw") for t, c in enumerate(copies)]
    alone = [describe_copied([s]) for s in steps]
    assert len({repr(a.tensors) for a in alone}) == STEPS  # the control: every step's rows differ
    built = _count_segments(monkeypatch)
    for m in range(1, STEPS + 1):
        got = describe_copied(steps[:m])
        assert repr(got.tensors) == repr([r for a in alone[:m] for r in a.tensors]), m
        assert got.blobs == [r for a in alone[:m] for r in a.blobs], m
    assert sorted(layout._segments) == [0, 2]  # one Segments per packed group (fp32, fp64)
    assert built == []  # (made when the first step was described) none built again
    del built[:]
    for m in range(2, STEPS + 1, 3):  # once built, none more
        describe_copied(steps[:m])
    assert built == []


def test_a_head_is_the_segments_of_its_tensors() -> None:
    # Segments.head (a smaller block described by the head of a whole block's Segments) holds what
    # Segments made of the first k tensors holds: small and large tensors, state, one element.
    kinds = ["params", "grads", "state", "optimizer", "params"] * 3
    sizes = [7, packed.SMALL + 1, 4, 1, 300] * 3
    whole = packed.Segments(kinds, sizes, 4)
    for k in range(1, len(sizes) + 1):
        head, want = whole.head(k), packed.Segments(kinds[:k], sizes[:k], 4)
        for name, value in vars(want).items():
            got = getattr(head, name)
            if isinstance(value, np.ndarray):
                assert got.dtype == value.dtype and np.array_equal(got, value), (k, name)
            else:
                assert got == value and type(got) is type(value), (k, name)
    assert whole.head(1).any_large is False and whole.head(2).any_large is True  # the control
