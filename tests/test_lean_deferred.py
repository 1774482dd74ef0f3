"""A small stats-only step: copied at the step on the training thread, described by the writer (issue 25).

What must hold (capture/lean.py ``LeanCapture.take``, capture/packed.py ``Snapshot``): the numpy
passes that describe a small record run on the writer thread, not on the training thread; the
rows describe the bytes as they were at the step (the optimizer pre-hook), even when the writer
reads them after the update has changed the live tensors; and they are the rows the training
thread computed before this change (the same function on the same bytes: compared bitwise).
"""

from __future__ import annotations

import threading

import pytest

import torch
from helpers import snapshot
from torch import nn

import stepdump
from stepdump.capture import lean, packed
from stepdump.capture.step_state import Entry
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import compute_stats

LEAN = {"every": None, "stats_every": 1}


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()


def test_the_packed_passes_run_on_the_writer_thread_not_the_training_thread(tmp_path, monkeypatch) -> None:
    threads: list[str] = []
    real = packed.Segments._passes  # the passes rows() and columns() share

    def spy(self, buf):
        threads.append(threading.current_thread().name)
        return real(self, buf)

    monkeypatch.setattr(packed.Segments, "_passes", spy)
    model, opt = _model()
    with stepdump.Recorder(tmp_path / "r", model, opt, on_error="raise", **LEAN):
        for t in range(4):
            _step(model, opt, t)
            opt.step()
            opt.zero_grad()
    # The first step is read by the stats worker (from the forward on: its size is not known yet);
    # every later one is copied at the pre-hook and described by the writer.
    assert threads.count("stepdump-writer") >= 3, threads
    assert threading.main_thread().name not in threads, threads


def test_rows_describe_the_bytes_at_the_step_though_the_writer_reads_after_the_update(tmp_path,
                                                                                      monkeypatch) -> None:
    # The writer is held until the optimizer has changed every param and its state: a row computed
    # from the live tensors then would describe the next step's bytes, not the recorded step's.
    release = threading.Event()
    real = packed.Snapshot.rows

    def late(self):
        release.wait(timeout=30)
        return real(self)

    monkeypatch.setattr(packed.Snapshot, "rows", late)
    model, opt = _model()
    caps = []
    with stepdump.Recorder(tmp_path / "r", model, opt, on_error="raise", **LEAN):
        for t in range(2):  # the writer's queue holds both steps' messages while it waits
            _step(model, opt, t)
            caps.append(snapshot(model, opt))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # and after the update, once more
                for p in model.parameters():
                    p.mul_(0.5)
        release.set()
    run = stepdump.open(tmp_path / "r")
    frame = run.stats()
    assert lean.INLINE_BYTES >= sum(p.numel() * 4 for p in model.parameters()) * 4  # the inline path
    for t, cap in enumerate(caps):
        fps = run.fingerprints(t)
        for kind in ("params", "grads"):
            for name, live in cap[kind].items():
                assert fps[(kind, name)] == fingerprint(live), (t, kind, name)
                row = frame[(frame.step == t) & (frame.kind == kind) & (frame.name == name)].iloc[0]
                want = compute_stats(live)
                assert (row["min"], row["max"], row["mean"], row["std"], row["norm"]) == want[4:9], (t, kind, name)


def test_the_rows_equal_those_computed_on_the_training_thread_bitwise(tmp_path, monkeypatch) -> None:
    # The same recording twice: rows described by the writer (now), and by the training thread at
    # the step (lean.DEFER_PACKED = False: Plan.rows at the pre-hook, no snapshot handed on).
    def record(path, defer: bool) -> stepdump.types.Run:
        monkeypatch.setattr(lean, "DEFER_PACKED", defer)  # False: the rows are computed at the pre-hook
        model, opt = _model()
        with stepdump.Recorder(path, model, opt, on_error="raise", **LEAN):
            for t in range(4):
                _step(model, opt, t)
                opt.step()
                opt.zero_grad()
        monkeypatch.undo()
        return stepdump.open(path)

    a, b = record(tmp_path / "writer", True), record(tmp_path / "training", False)
    cols = ["step", "kind", "name", "numel", "min", "max", "mean", "std", "norm", "zero_frac"]
    fa = a.stats()[cols].sort_values(["step", "kind", "name"]).reset_index(drop=True)
    fb = b.stats()[cols].sort_values(["step", "kind", "name"]).reset_index(drop=True)
    assert len(fa) > 0 and fa.equals(fb)
    for t in range(4):
        assert a.fingerprints(t) == b.fingerprints(t)


def _plan_and_entries(sizes: list[int], seed: int, content: str = "normal"):
    from test_lean_packed import CONTENTS, _tensor  # the packed tests' contents: zeros, NaN, LayerNorm-like...

    assert content in CONTENTS
    g = torch.Generator().manual_seed(seed)
    ts = [_tensor(content if i % 2 else "normal", n, torch.float32, g) for i, n in enumerate(sizes)]
    entries = [Entry(("params", "grads", "optimizer")[i % 3], f"t{i}", t, False) for i, t in enumerate(ts)]
    return packed.Plan(entries, packed.layout_key(entries)), entries


@pytest.mark.parametrize("content", ["normal", "zeros", "layernorm", "sparse-ish", "nan", "posinf", "huge"])
def test_copies_described_together_give_each_copy_its_own_rows_bitwise(content: str) -> None:
    # Held steps of one layout (and of another, interleaved), small and large copies: describe_all
    # gives each snapshot the rows its own rows() gives, value for value and type for type.
    small, _ = _plan_and_entries([7, 64, 300, 4096, 1], 0)
    large, _ = _plan_and_entries([70_000, 5], 0)  # over TOGETHER_BYTES: described alone
    snaps = []
    for step in range(7):
        plan, entries = _plan_and_entries([7, 64, 300, 4096, 1], step, content) if step % 3 else \
            _plan_and_entries([70_000, 5], step, content)
        plan = small if step % 3 else large
        snaps.append(plan.snapshot(entries))
    together = packed.describe_all(snaps)
    assert [repr(r) for r in together] == [repr(s.rows()) for s in snaps]
    assert small.batches[0]._block is not None  # the small ones went together, in one pass


def _held_run(path, monkeypatch, steps: int, bound: int | None = None):
    """A lean run with every step after the first held until close() (and, with ``bound``, held
    copies kept at most that many bytes): the sizes of the packed passes made, and each step's
    tensors as the update read them."""
    from stepdump.capture import writer

    monkeypatch.setattr(writer, "COMMIT_WINDOW", 3600.0)
    if bound is not None:
        monkeypatch.setattr(writer, "HELD_PACKED_BYTES", bound)
    passes: list[int] = []
    real = packed.Segments._passes  # the passes rows() and columns() share

    def spy(self, buf):
        passes.append(self.k)
        return real(self, buf)

    monkeypatch.setattr(packed.Segments, "_passes", spy)
    model, opt = _model()
    caps = []
    with stepdump.Recorder(path, model, opt, on_error="raise", **LEAN):
        for t in range(steps):
            _step(model, opt, t)
            caps.append(snapshot(model, opt))
            opt.step()
            opt.zero_grad()
    return passes, caps, 2 * len(list(model.parameters()))


def _assert_fingerprints(path, caps, kinds=("params", "grads")) -> None:
    run = stepdump.open(path)
    for t, cap in enumerate(caps):
        fps = run.fingerprints(t)
        for kind in kinds:
            for name, live in cap[kind].items():
                assert fps[(kind, name)] == fingerprint(live), (t, kind, name)


def test_held_steps_of_a_small_model_are_described_at_the_commit_in_one_pass(tmp_path, monkeypatch) -> None:
    passes, caps, k = _held_run(tmp_path / "r", monkeypatch, 8)
    assert max(passes) >= 5 * k, passes  # most held steps in one pass (k: params + grads a step)
    _assert_fingerprints(tmp_path / "r", caps)


@pytest.mark.parametrize("bound", [1, 1 << 40], ids=["past-the-bound", "under-it"])
def test_held_copies_past_their_memory_bound_are_described_before_the_commit(tmp_path, monkeypatch,
                                                                            bound: int) -> None:
    # A fast loop with a record near lean.INLINE_BYTES would hold a window's worth of copies: past
    # HELD_PACKED_BYTES they are described at once (their memory let go), and committed later.
    passes, caps, _ = _held_run(tmp_path / "r", monkeypatch, 6, bound)
    if bound == 1:  # each step's copies described as they came: a pass per step
        assert len(passes) >= 6, passes
    else:  # held until close(): a pass per layout (with and without the optimizer state), and step 0's
        assert len(passes) <= 4, passes
    assert stepdump.open(tmp_path / "r").stats_steps[:6] == list(range(6))  # (then the final record)
    _assert_fingerprints(tmp_path / "r", caps, ("params",))


def test_a_copy_goes_into_a_buffer_given_back_and_equals_the_tensors_end_to_end() -> None:
    # The copies of a layout reuse the buffers described before (no fresh memory, no page faults
    # on the training thread at every step); a reused buffer holds exactly the new step's bytes,
    # non-contiguous and 0-dim tensors included, as flattening them end to end gives.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(12, 5, generator=g)
    ts = [torch.randn(7, generator=g), base.t(), torch.randn((), generator=g), torch.randn(2, 3, 4, generator=g)[:, 1]]
    entries = [Entry("params", f"t{i}", t, False) for i, t in enumerate(ts)]
    plan = packed.Plan(entries, packed.layout_key(entries))
    first = plan.snapshot(entries)
    buf0 = first._bufs[0]
    assert torch.equal(buf0, torch.cat([t.reshape(-1) for t in ts]))
    rows = first.rows()
    first.release()
    for t in ts:
        t.add_(1.0)  # the next step's values
    second = plan.snapshot(entries)
    assert second._bufs[0].data_ptr() == buf0.data_ptr()  # the buffer given back, reused
    assert torch.equal(second._bufs[0], torch.cat([t.reshape(-1) for t in ts]))
    assert [r.fp for r in second.rows()] == [fingerprint(t.contiguous()) for t in ts]
    assert [r.fp for r in rows] != [r.fp for r in second.rows()]
    other = plan.snapshot(entries)  # taken while `second` is held: a buffer of its own
    assert other._bufs[0].data_ptr() != second._bufs[0].data_ptr()


def test_buffers_kept_for_reuse_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(packed, "POOL_BYTES", 3 * 64 * 4)  # three copies of a 64-element layout
    entries = [Entry("params", "w", torch.randn(64), False)]
    plan = packed.Plan(entries, packed.layout_key(entries))
    snaps = [plan.snapshot(entries) for _ in range(6)]
    assert len({s._bufs[0].data_ptr() for s in snaps}) == 6
    for s in snaps:
        s.release()
    assert len(plan.batches[0]._free) == 3


def test_a_recorded_run_reuses_its_copies_buffers(tmp_path, monkeypatch) -> None:
    # The writer gives the described copies back: after a lean run, the layout's batches hold
    # buffers for the next steps, and every step's fingerprints are those of the live tensors.
    made = []
    real = packed.Plan.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(packed.Plan, "__init__", spy)
    passes, caps, _ = _held_run(tmp_path / "r", monkeypatch, 12, bound=1)  # described at every step
    assert any(b._free for p in made for b in p.batches)
    _assert_fingerprints(tmp_path / "r", caps)
