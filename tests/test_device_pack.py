"""capture/device_pack.py on the CPU: the rows a lean CUDA step sends are the pack's, read back
exactly (the same code runs on a GPU with a pinned host copy; tests_gpu/ runs it there)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dmix_reference import reference_dmix64
from helpers import python_calls, record_run

from stepdump.capture.device_pack import DeviceLean, DevicePack, HeadsCache, catalog_rows, heads, pack_on_device, rows
from stepdump.capture.step_state import Entry
from stepdump.capture.writer_lean import LeanRows
from stepdump.core.device_lean import DEVICE_FP_KIND
from stepdump.core.dtypes import stored_dtype
from stepdump.core.hashing import raw_bytes
from stepdump.core.stats import compute_stats, device_stats
from stepdump.store.catalog import CatalogWriter
from stepdump.store.format import format_shape


def _entries(nonfinite: bool) -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    ts = {
        "w": torch.randn(33, 7, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "z": torch.zeros(5, dtype=torch.float16),
        "e": torch.empty(0),
        "step": torch.tensor(7.0),
        "i": torch.randint(-9, 9, (4, 5), generator=g),
    }
    if nonfinite:
        ts["w"].view(-1)[::5] = float("nan")
        ts["w"].view(-1)[1::11] = float("-inf")
        ts["b"][0] = float("inf")
    out = [Entry("params", n, t, False) for n, t in ts.items()]
    out.append(Entry("optimizer", "w.exp_avg", torch.ones(2, 2), False, "w", "exp_avg"))
    return out


@pytest.mark.parametrize("nonfinite", [False, True])
def test_rows_are_the_stats_and_dmix64_of_each_tensor(nonfinite: bool) -> None:
    entries = _entries(nonfinite)
    host = pack_on_device(entries, pin=False)
    got = rows(DevicePack(heads(entries), host))
    assert [(r.kind, r.name, r.param, r.key) for r in got] == [e[0:2] + e[4:6] for e in entries]
    for r, e in zip(got, entries, strict=True):
        t = e[2]
        assert r.dtype == stored_dtype(t) and r.shape == format_shape(t.shape)
        assert r.fp_kind == DEVICE_FP_KIND
        assert r.fp == reference_dmix64(bytes(raw_bytes(t))), e[1]
        want = device_stats(t).tolist()
        assert r.stats[:4] == tuple(int(v) for v in want[:4]) and all(isinstance(v, int) for v in r.stats[:4])
        for v, w in zip(r.stats[4:], want[4:], strict=True):
            assert (v is None and math.isnan(w)) or (v is not None and v == w), (e[1], r.stats, want)


def test_a_finite_tensor_row_agrees_with_the_host_stats_where_they_are_exact() -> None:
    """Counts, min, max and the zero fraction are the same numbers the CPU path stores."""
    entries = [e for e in _entries(False) if e[2].numel()]
    host = pack_on_device(entries, pin=False)
    for r, e in zip(rows(DevicePack(heads(entries), host)), entries, strict=True):
        want = compute_stats(e[2])
        assert r.stats[:6] == want[:6] and r.stats[9] == want[9], (e[1], r.stats, want)


def test_empty_tensor_has_no_values() -> None:
    entries = [Entry("grads", "e", torch.empty(0, 3), False)]
    host = pack_on_device(entries, pin=False)
    (r,) = rows(DevicePack(heads(entries), host))
    assert r.stats == (0, 0, 0, 0, None, None, None, None, None, None)
    assert r.shape == format_shape((0, 3))


# -- a steady step: one heads list, and the writer's rows without a LeanRow per tensor -------------

def test_heads_cache_gives_the_same_list_while_the_layout_stays() -> None:
    """New tensor objects of the same kinds, names, dtypes and shapes (grads set to None and made
    again) keep the list object the writer keys its series ids on; any change makes a new one, right."""
    cache = HeadsCache()
    entries = _entries(False)
    first = cache(entries)
    assert first == heads(entries)
    again = [e._replace(tensor=e.tensor.clone()) for e in entries]
    assert cache(again) is first
    for i, change in ((0, lambda t: t.double()), (1, lambda t: t.reshape(1, -1)), (2, lambda t: t[:2])):
        other = list(again)
        other[i] = other[i]._replace(tensor=change(other[i].tensor))
        got = cache(other)
        assert got is not first and got == heads(other) and got[i] != first[i]
        assert cache(other) is got
    renamed = [entries[0]._replace(name="w2")] + entries[1:]
    got = cache(renamed)
    assert got is not first and got[0][1] == "w2"


@pytest.mark.parametrize("nonfinite", [False, True])
def test_catalog_rows_are_the_lean_rows_the_writer_made(nonfinite: bool) -> None:
    """catalog_rows = the (series, step, dtype, shape, blob, *stats, fp) tuples of rows(), value
    for value and type for type (int counts, None for no value), with rows left out by ``keep``."""
    entries = _entries(nonfinite)
    pack = DevicePack(heads(entries), pack_on_device(entries, pin=False))
    sids = list(range(100, 100 + len(entries)))
    want = [(sid, 7, r.dtype, r.shape, None, *r.stats, r.fp) for sid, r in zip(sids, rows(pack), strict=True)]
    got = catalog_rows(pack, 7, sids)
    assert got == want
    assert [tuple(map(type, g)) for g in got] == [tuple(map(type, w)) for w in want]
    keep = [i % 2 == 0 for i in range(len(entries))]
    assert catalog_rows(pack, 7, sids, keep) == want[::2]
    assert catalog_rows(DevicePack([], pack_on_device([], pin=False)), 7, []) == []


def test_writer_looks_series_up_once_per_heads_list_and_again_after_a_rollback(tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The writer's device rows: series made dmix64 on first sight, their ids reused while the heads
    list is the same object (no series lookup per tensor), looked up again after a rollback (ids
    may have gone), and a series of another kind left out with one warning (never a row of a kind
    its series does not have)."""
    run = record_run(tmp_path / "run", steps=1)
    cat = CatalogWriter(run)
    calls = []
    real = cat.series_id
    cat.series_id = lambda *a: calls.append(a) or real(*a)  # type: ignore[method-assign]
    entries = _entries(False)
    w = LeanRows()
    hs = heads(entries)
    out: list[tuple] = []
    w.device_rows(cat, 5, DevicePack(hs, pack_on_device(entries, pin=False)), out)
    assert len(calls) == len(entries) and len(out) == len(entries)
    assert {cat.fp_kind(r[0]) for r in out} == {DEVICE_FP_KIND}
    out2: list[tuple] = []
    w.device_rows(cat, 6, DevicePack(hs, pack_on_device(entries, pin=False)), out2)
    assert len(calls) == len(entries)  # the same heads list: no lookup
    assert [r[0] for r in out2] == [r[0] for r in out] and {r[1] for r in out2} == {6}
    cat.rollback()  # the series made in the rolled-back transaction are gone
    out3: list[tuple] = []
    w.device_rows(cat, 6, DevicePack(hs, pack_on_device(entries, pin=False)), out3)
    assert len(calls) == 2 * len(entries)
    assert {cat.fp_kind(r[0]) for r in out3} == {DEVICE_FP_KIND}
    # A series that is xxh3 in this store (a recorded param of the CPU run) gets no dmix64 row.
    name = next(n for k, n in cat._series if k == "params")
    mixed = [Entry("params", name, torch.ones(3), False), *entries]
    out4: list[tuple] = []
    with caplog.at_level("WARNING", logger="stepdump.capture.writer"):
        for _ in range(2):
            w.device_rows(cat, 8, DevicePack(heads(mixed), pack_on_device(mixed, pin=False)), out4)
    assert len(out4) == 2 * len(entries)
    assert all(cat.fp_kind(r[0]) == DEVICE_FP_KIND for r in out4)
    assert sum("fingerprints in this run" in r.message for r in caplog.records) == 1
    # Series ids may also go with drop_empty_series, and another catalog has ids of its own.
    w.device_rows(cat, 9, DevicePack(hs, pack_on_device(entries, pin=False)), [])
    n = len(calls)
    w.device_rows(cat, 9, DevicePack(hs, pack_on_device(entries, pin=False)), [])
    assert len(calls) == n  # the control: cached
    cat.drop_empty_series(("grads",))
    w.device_rows(cat, 9, DevicePack(hs, pack_on_device(entries, pin=False)), [])
    assert len(calls) == n + len(entries)
    cat.close()
    cat2 = CatalogWriter(run)  # ids of its own: looked up again, whatever its generation
    real2 = cat2.series_id
    cat2.series_id = lambda *a: calls.append(a) or real2(*a)  # type: ignore[method-assign]
    w.device_rows(cat2, 10, DevicePack(hs, pack_on_device(entries, pin=False)), [])
    assert len(calls) == n + 2 * len(entries)
    cat2.close()


# -- DeviceLean: the layout read once a step, a steady step without per-tensor Python -------------

def test_device_lean_packs_what_the_old_path_packed_and_reuses_a_steady_layout() -> None:
    """prepare + launch = pack_on_device + heads (the rows, value for value); the same layout again
    keeps the heads list (the writer's series ids hang on it); new memory of the same layout too,
    with the new tensors' rows; another shape or name makes new heads."""
    lean = DeviceLean("cpu")
    entries = [e for e in _entries(True)]
    want = rows(DevicePack(heads(entries), pack_on_device(entries, pin=False)))
    first = lean.prepare(entries)
    assert first is not None and first.heads == heads(entries)
    assert rows(first.launch(pin=False)) == want
    again = lean.prepare(entries)
    assert again is not None and again.heads is first.heads
    moved = [e._replace(tensor=e.tensor.clone()) for e in entries]
    moved[0][2].view(-1)[0] = 123.0
    got = lean.prepare(moved)
    assert got is not None and got.heads is first.heads and all(a is b[2] for a, b in zip(got.tensors, moved))
    assert rows(got.launch(pin=False)) == rows(DevicePack(heads(moved), pack_on_device(moved, pin=False)))
    reshaped = [moved[0]._replace(tensor=moved[0].tensor.reshape(-1)), *moved[1:]]
    other = lean.prepare(reshaped)
    assert other is not None and other.heads is not first.heads and other.heads == heads(reshaped)
    renamed = [moved[0]._replace(name="w9"), *moved[1:]]
    named = lean.prepare(renamed)
    assert named is not None and named.heads[0][1] == "w9"


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("case", ["full", "sparse", "subclass", "quantized", "two devices", "meta device", "empty"])
def test_device_lean_declines_what_it_does_not_take(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with an entry stored in full, a sparse, subclass or quantized tensor, or tensors on
    two devices (or none) goes to the staging path (None); the next plain step is taken again."""
    lean = DeviceLean("cpu")
    entries = _entries(False)
    assert lean.prepare(entries) is not None
    bad = list(entries)
    t = torch.ones(4, 4)
    if case == "full":
        bad[0] = bad[0]._replace(full=True)
    elif case == "sparse":
        bad[1] = Entry("grads", "s", t.to_sparse(), False)
    elif case == "subclass":
        bad[1] = Entry("params", "s", t.as_subclass(_Sub), False)
    elif case == "quantized":
        bad[1] = Entry("params", "q", torch.quantize_per_tensor(t, 0.1, 0, torch.qint8), False)
    elif case == "two devices":  # the same device type, another index (what two GPUs look like)
        other = torch.ones(4)
        real = torch.Tensor.get_device
        monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 1 if t is other else real(t))
        bad[1] = Entry("params", "o", other, False)
    elif case == "meta device":
        bad = [Entry("params", "m", torch.empty(4, device="meta"), False)]
    else:
        bad = []
    assert lean.prepare(bad) is None, case
    assert lean.prepare(entries) is not None


def test_a_steady_prepare_makes_as_many_python_calls_for_600_tensors_as_for_6() -> None:
    """The layout is read by C-level maps over the list and compared as lists: no Python per
    tensor at a steady step (the control: a first prepare, which builds the heads, scales)."""
    def entries(n: int) -> list[tuple]:
        return [Entry("params", f"p{i}", torch.ones(3 + i % 5), False) for i in range(n)]

    small, big = entries(6), entries(600)
    DeviceLean("cpu").prepare(entries(1))  # any first-use import out of the counts
    a, b = DeviceLean("cpu"), DeviceLean("cpu")
    first_small, first_big = python_calls(lambda: a.prepare(small)), python_calls(lambda: b.prepare(big))
    steady_small, steady_big = python_calls(lambda: a.prepare(small)), python_calls(lambda: b.prepare(big))
    assert first_big > first_small + 500, (first_small, first_big)
    assert steady_big == steady_small, (steady_small, steady_big)


def test_a_structure_is_bound_once_whatever_memory_its_tensors_move_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caching allocator may give a step's grads other addresses at every step: the kernel's
    tables are of the structure and bound once; the data pointers travel with each launch (the
    H200 measured ~3 ms of the training thread's CPU a step when tables were kept per address set:
    every step bound again). A new structure is bound again; heads stay one list per structure."""
    from stepdump.capture import device_pack as dp

    binds: list[int] = []
    real = dp._bind
    monkeypatch.setattr(dp, "_bind", lambda ts, kind: binds.append(len(ts)) or real(ts, kind))
    lean = DeviceLean("cpu")
    a = _entries(False)
    sets = [a] + [[e._replace(tensor=e.tensor.clone()) for e in a] for _ in range(4)]
    got = [lean.prepare(x) for x in sets]
    assert len(binds) == 1
    assert all(g is not None and g.heads is got[0].heads for g in got)  # type: ignore[union-attr]
    for g, x in zip(got, sets):
        assert g is not None and all(t is e[2] for t, e in zip(g.tensors, x))
        assert g.ptrs == tuple(e[2].data_ptr() for e in x)
    lean.prepare(a[:-1])  # another structure
    assert len(binds) == 2
    lean.prepare(a)
    assert len(binds) == 3
