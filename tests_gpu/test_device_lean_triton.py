"""The fused lean kernel (``stepdump.core.device_lean_triton.fused_pack``) against the references.

Every row of ``fused_pack(tensors)`` must be ``device_stats(tensors[i])`` (counts, min, max and
the zero fraction bit for bit; mean, std and norm within 1e-12 relative: sums in another order)
and the dmix64 fingerprint of the tensor's bytes (bit for bit, against the plain-integer
definition ``reference_dmix64`` and the torch-ops ``device_fingerprint``), for every dtype and
shape of the contract, lists mixing dtypes, NaN / Inf, empty tensors, views at odd element
offsets, tile boundaries and a thousand tensors at once; the same bits at every call; what it
refuses, it refuses for the whole list, with a control that the list without the offender is
taken; and ``g + 1`` launches for ``g`` dtypes, one table build per layout.

Where it runs: on the GPU by ``make test-gpu`` (Triton installed there). Without a GPU, under
Triton's CPU interpreter, on CPU tensors (the module-level switch below: ``TRITON_INTERPRET=1``
makes DEV the CPU and passes ``_allow_cpu``); tests_gpu/conftest.py refuses a CPU run, so skip it:

    TRITON_INTERPRET=1 PYTHONPATH=<dir with triton> .venv/bin/python -m pytest -q --noconftest \\
        tests_gpu/test_device_lean_triton.py -p no:cacheprovider
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE.parent / "tests", _HERE):  # what tests_gpu/conftest.py adds, for a --noconftest run
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dmix_reference import sprinkle_nonfinite  # noqa: E402
from helpers import assert_same, python_calls  # noqa: E402
from test_device_lean_contract import DTYPES, MIXES, SHAPES, _same_or_both_nan, _tensor, reference_dmix64  # noqa: E402

from stepdump.core import device_lean_triton as dlt  # noqa: E402
from stepdump.core.device_lean import device_fingerprint  # noqa: E402
from stepdump.core.hashing import raw_bytes  # noqa: E402
from stepdump.core.stats import STATS_LEN, device_stats  # noqa: E402

# The switch: under Triton's interpreter the kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cpu") if INTERPRET else torch.device("cuda")
EXACT = (0, 1, 2, 3, 4, 5, 9)  # numel, NaN, +Inf, -Inf, min, max, zero fraction
SUMS = (6, 7, 8)  # mean, std, norm


def pack(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    return dlt.fused_pack(tensors, _allow_cpu=INTERPRET)


def taken(tensors: list[torch.Tensor]) -> torch.Tensor:
    got = pack(tensors)
    assert got is not None, "fused_pack refused the list (is Triton importable here?)"
    assert got.shape == (len(tensors), STATS_LEN + 1) and got.dtype == torch.int64, got.shape
    assert got.device == (tensors[0].device if tensors else torch.device("cpu"))
    return got


def check_row(row: torch.Tensor, t: torch.Tensor, what: str, fp: int | None = None,
              value_zero_sign: bool = False) -> None:
    """One packed row against device_stats(t) and the tensor's dmix64 (``fp`` when known)."""
    want = device_stats(t).cpu()
    got = row.cpu()[:STATS_LEN].view(torch.float64)
    for col in EXACT:
        if value_zero_sign and col in (4, 5) and float(want[col]) == 0.0:
            # min / max of a list holding both -0.0 and 0.0: which zero a min returns is the
            # reduction's order (torch's too), so only the value is held here.
            assert float(got[col]) == 0.0, (what, col, float(got[col]))
            continue
        _same_or_both_nan(got[col], want[col], f"{what} column {col}")
    for col in SUMS:
        w, g = float(want[col]), float(got[col])
        assert (w != w and g != g) or abs(g - w) <= 1e-12 * max(1.0, abs(w)), (what, col, g, w)
    want_fp = int(device_fingerprint(t)) if fp is None else fp
    assert int(row[STATS_LEN]) == want_fp, f"{what}: fingerprint {int(row[STATS_LEN])} != {want_fp}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_tensor_equals_the_references(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape).to(DEV)
    want_fp = reference_dmix64(bytes(raw_bytes(t.cpu())))
    assert int(device_fingerprint(t)) == want_fp  # the control: the two references agree
    check_row(taken([t])[0], t, f"{dtype} {shape}", want_fp)


def test_every_dtype_and_shape_in_one_list() -> None:
    """All the contract's cases at once: one launch per dtype, rows back in the list's order."""
    ts = [_tensor(d, s, seed=i).to(DEV) for i, (d, s) in enumerate((d, s) for d in DTYPES for s in SHAPES)]
    ts = ts[::2] + ts[1::2]  # dtypes interleaved: the tile table groups them, the rows must not
    got = taken(ts)
    for i, t in enumerate(ts):
        check_row(got[i], t, f"tensor {i} {t.dtype} {tuple(t.shape)}")


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("nonfinite", [False, True])
def test_mixes_with_and_without_nonfinite(mix: str, nonfinite: bool) -> None:
    """The contract's lists (tensors over several tiles), with NaN / +Inf / -Inf sprinkled in."""
    ts = [_tensor(d, (1 + 1777 * (i + 1), 3), seed=i).to(DEV) for i, d in enumerate(MIXES[mix])]  # 2+ tiles
    ts.append(torch.empty(0, device=DEV))
    if nonfinite:
        sprinkle_nonfinite(ts)
    got = taken(ts)
    for i, t in enumerate(ts):
        check_row(got[i], t, f"{mix} tensor {i}")
    if nonfinite:  # the control: the nonfinite values were counted, not lost
        for i, t in enumerate(ts[:-1]):
            counts = got[i, 1:4].view(torch.float64).tolist()
            assert all(c > 0 for c in counts) == t.dtype.is_floating_point, (mix, i, counts)


def _special(case: str, dtype: torch.dtype) -> torch.Tensor:
    n = 1000
    t = _tensor(dtype, (n,), seed=3)
    if case == "all NaN":
        t.fill_(float("nan"))
    elif case == "all +Inf":
        t.fill_(float("inf"))
    elif case == "Inf of both signs only":
        t[::2], t[1::2] = float("inf"), float("-inf")
    elif case == "one finite among NaN":
        t.fill_(float("nan"))
        t[517] = -2.5
    elif case == "zeros":
        t.zero_()
    elif case == "negative zeros":
        t.fill_(-0.0)
    elif case == "zeros of both signs":
        t[::3] = 0.0
        t[1::3] = -0.0
    elif case == "constant":
        t.fill_(3.25)
    elif case == "subnormals":
        t = t * torch.finfo(dtype).tiny / 4
    elif case == "NaN payloads":  # quiet, signalling and negative NaNs among finite values
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        exp = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
               torch.float64: 0x7FF0000000000000}[dtype]
        bits = t.view(ints).clone()
        bits[::5] = exp | 1
        bits[1::5] = -1  # all ones: a negative NaN in every float format
        bits[2::5] = exp | (exp >> 1 & ~exp)  # the top mantissa bit: a quiet NaN
        t = bits.view(dtype)
    return t


SPECIAL = ["all NaN", "all +Inf", "Inf of both signs only", "one finite among NaN", "zeros", "negative zeros",
           "zeros of both signs", "constant", "subnormals", "NaN payloads"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("case", SPECIAL)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_values(case: str, dtype: torch.dtype) -> None:
    t = _special(case, dtype).to(DEV)
    check_row(taken([t])[0], t, f"{case} {dtype}", value_zero_sign=case == "zeros of both signs")


# Around a block (dlt._BLOCK elements), a chunk (dlt._CHUNK: one program) and a word (8 bytes):
# words built across a block's last elements, partials combined across chunks.
EDGES = [dlt._BLOCK - 1, dlt._BLOCK, dlt._BLOCK + 1, 2 * dlt._BLOCK + 3, 3 * dlt._BLOCK - 5,
         dlt._CHUNK - 1, dlt._CHUNK + 1, 2 * dlt._CHUNK + 3]


@pytest.mark.parametrize("numel", EDGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool], ids=str)
def test_tile_boundaries(dtype: torch.dtype, numel: int) -> None:
    t = _tensor(dtype, (numel,), seed=numel).to(DEV)
    check_row(taken([t])[0], t, f"{dtype} {numel}", reference_dmix64(bytes(raw_bytes(t.cpu()))))


@pytest.mark.parametrize("offset", [1, 3, 5, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.bool, torch.float64], ids=str)
def test_views_at_odd_offsets_are_right(dtype: torch.dtype, offset: int) -> None:
    """A contiguous view whose data pointer is not 8-byte aligned: words are built from its
    elements, from the view's first byte (never from the storage's), and never read past its end."""
    base = _tensor(dtype, (600,), seed=offset).to(DEV)
    view = base[offset:offset + 301]
    assert view.is_contiguous() and (view.data_ptr() % 8 != 0 or dtype.itemsize == 8)
    check_row(taken([view])[0], view, f"{dtype} +{offset}", reference_dmix64(bytes(raw_bytes(view.cpu()))))


def test_many_tensors_at_once() -> None:
    """1,000 small tensors of every dtype and sizes 0..~300, and a few large ones, in one call."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 300, (1000,), generator=gen).tolist()
    ts = [_tensor(DTYPES[i % len(DTYPES)], (s,), seed=i).to(DEV) for i, s in enumerate(sizes)]
    ts[10:10] = [_tensor(torch.float32, (250_000,), seed=1).to(DEV), _tensor(torch.bfloat16, (99_999,)).to(DEV)]
    ts.append(_tensor(torch.float64, (40_001,), seed=2).to(DEV))
    got = taken(ts)
    for i, t in enumerate(ts):
        check_row(got[i], t, f"tensor {i} {t.dtype} {t.numel()}")


def test_same_bits_every_call_and_never_stale() -> None:
    """Called again: the same bits (no atomics, a fixed order). The cached tables hold pointers,
    not contents: after an in-place change the row is of the new bytes."""
    ts = [_tensor(d, (3 * dlt._BLOCK + 17,), seed=i).to(DEV) for i, d in enumerate(DTYPES)]
    first = taken(ts)
    assert_same(taken(ts), first, "second call")
    assert_same(taken(ts), first, "third call")
    ts[0].view(-1)[3 * dlt._BLOCK + 7] += 1
    third = taken(ts)
    assert int(third[0, STATS_LEN]) != int(first[0, STATS_LEN])
    check_row(third[0], ts[0], "after an in-place change")
    assert_same(third[1:], first[1:], "the tensors that did not change")


def _refused(case: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(a list the kernel refuses, the same list without the offender: the control)."""
    ok = [_tensor(torch.float32, (100,)).to(DEV), _tensor(torch.int64, (9,)).to(DEV)]
    bad: torch.Tensor
    if case == "not contiguous":
        bad = _tensor(torch.float32, (16, 12)).to(DEV).T
    elif case == "sparse":
        bad = _tensor(torch.float32, (8, 8)).to(DEV).to_sparse()
    elif case == "complex":
        bad = torch.randn(10, dtype=torch.complex64).to(DEV)
    elif case == "uint16":
        bad = torch.zeros(10, dtype=torch.uint16).to(DEV)
    elif case == "float8":
        bad = torch.randn(10).to(torch.float8_e4m3fn).to(DEV)
    else:  # "on another device": a CPU tensor among device tensors (on the GPU), or a meta tensor
        bad = torch.empty(10, device="meta") if INTERPRET else _tensor(torch.float32, (10,))
    return [*ok[:1], bad, *ok[1:]], ok


REFUSALS = ["not contiguous", "sparse", "complex", "uint16", "float8", "on another device"]


@pytest.mark.parametrize("case", REFUSALS)
def test_refuses_what_it_does_not_handle(case: str) -> None:
    bad, ok = _refused(case)
    assert pack(bad) is None, case
    got = taken(ok)  # the control: the offender alone made the difference
    for i, t in enumerate(ok):
        check_row(got[i], t, f"{case} control {i}")


def test_refuses_cpu_tensors_outside_the_interpreter() -> None:
    ts = [_tensor(torch.float32, (100,))]
    assert dlt.fused_pack(ts) is None
    if INTERPRET:
        assert dlt.fused_pack(ts, _allow_cpu=True) is not None  # the control


class _Counting:
    """A kernel wrapped to count its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            return launch(*args, **kwargs)

        return counted


def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No structure of an earlier test."""
    monkeypatch.setattr(dlt, "_structures", type(dlt._structures)())


def test_launches_per_dtype_and_tables_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT-2-like step (params, grads, two moments fp32; an int64 step; bf16 copies): g + 1
    launches for g dtypes, whatever the number of tensors; the tables built once per layout."""
    tile, combine = _Counting(dlt._chunk_kernel), _Counting(dlt._combine_kernel)
    plans: list[int] = []
    _fresh_caches(monkeypatch)
    real_plan = dlt._plan
    monkeypatch.setattr(dlt, "_chunk_kernel", tile)
    monkeypatch.setattr(dlt, "_combine_kernel", combine)
    monkeypatch.setattr(dlt, "_plan", lambda *a: plans.append(1) or real_plan(*a))
    ts = [_tensor(torch.float32, (1 + 997 * i,), seed=i).to(DEV) for i in range(4 * 12)]
    ts += [_tensor(torch.int64, (), seed=i).to(DEV) for i in range(12)]
    ts += [_tensor(torch.bfloat16, (50 + i,), seed=i).to(DEV) for i in range(12)]
    first = taken(ts)
    assert (tile.launches, combine.launches, len(plans)) == (3, 1, 1)
    assert_same(taken(ts), first, "second call")
    assert (tile.launches, combine.launches, len(plans)) == (6, 2, 1), "the second call rebuilt the tables"
    taken(ts[:-1])  # another layout: its own tables
    assert len(plans) == 2


class _NoLaunch:
    """A kernel stand-in that launches nothing (the host side of a call, measured alone)."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def test_steady_call_does_no_per_tensor_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call on a cached layout makes as many Python-level calls for 600 tensors as for 6 (the
    key is mapped over the list in C); the kernels are stubbed so the count is the host's own.
    The control: a first call (tables to build) does scale with the list."""
    monkeypatch.setattr(dlt, "_chunk_kernel", _NoLaunch())
    monkeypatch.setattr(dlt, "_combine_kernel", _NoLaunch())
    small = [_tensor(torch.float32, (10 + i,), seed=i).to(DEV) for i in range(6)]
    big = [_tensor(torch.float32, (10 + i,), seed=i).to(DEV) for i in range(600)]
    first_small, first_big = python_calls(lambda: pack(small)), python_calls(lambda: pack(big))
    steady_small, steady_big = python_calls(lambda: pack(small)), python_calls(lambda: pack(big))
    assert first_big > first_small + 600, (first_small, first_big)  # the control
    assert steady_big == steady_small, (steady_small, steady_big)
    assert steady_small < 100, steady_small  # 19 under the interpreter (no CUDA device context)


def test_new_memory_same_structure_reuses_the_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors given new memory (grads set to None and allocated again) keep their structure's
    tile tables; only the pointer table is new, and the rows are of the new memory's bytes."""
    _fresh_caches(monkeypatch)
    plans: list[int] = []
    real_plan = dlt._plan
    monkeypatch.setattr(dlt, "_plan", lambda *a: plans.append(1) or real_plan(*a))
    ts = [_tensor(d, (2 * dlt._BLOCK + 5 * i,), seed=i).to(DEV) for i, d in enumerate(DTYPES)]
    first = taken(ts)
    moved = [t.clone() for t in ts]
    assert all(m.data_ptr() != t.data_ptr() for m, t in zip(moved, ts))  # the control: new memory
    moved[0].view(-1)[7] += 1  # float32: one element of the new memory differs from the old
    got = taken(moved)
    assert len(plans) == 1, "the tables were built again for the same structure"
    assert int(got[0, STATS_LEN]) != int(first[0, STATS_LEN])
    check_row(got[0], moved[0], "the changed tensor, read from its new memory")
    assert_same(got[1:], first[1:], "the same bytes in new memory")
    del ts, first  # the old memory goes back to the allocator: the rows stay those of `moved`
    assert_same(taken(moved), got, "again, after the old memory was freed")


def _seeing_alignment(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The chunk kernel wrapped to note each launch's ALIGNED (words or elements), in order."""
    seen: list[bool] = []

    class _Seeing(_Counting):
        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            launch = self.kernel[grid]
            return lambda *a, **kw: seen.append(kw["ALIGNED"]) or launch(*a, **kw)

    monkeypatch.setattr(dlt, "_chunk_kernel", _Seeing(dlt._chunk_kernel))
    return seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_blocks_read_as_words_agree_with_elements(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype whose every tensor starts on an 8-byte boundary has its whole blocks read as words
    (ALIGNED); one misaligned view among them makes the whole dtype read element by element. Both
    readings give each tensor's rows (checked against the references), so the same exact columns
    and fingerprints, and the launch took the reading it should (the control that both ran)."""
    _fresh_caches(monkeypatch)
    seen = _seeing_alignment(monkeypatch)
    sizes = (3 * dlt._BLOCK, 3 * dlt._BLOCK + 1, 2 * dlt._BLOCK - 1, dlt._BLOCK + 9, 7, 0, dlt._CHUNK + dlt._BLOCK + 3)
    ts = [_tensor(dtype, (n,), seed=i).to(DEV) for i, n in enumerate(sizes)]
    ts[1].view(-1)[dlt._BLOCK + 5 : dlt._BLOCK + 9] = torch.tensor([0, 1, 0, 1]).to(dtype)  # zeros in a whole block
    assert all(t.data_ptr() % 8 == 0 for t in ts)
    words = taken(ts)
    assert seen == [True]
    for i, t in enumerate(ts):
        check_row(words[i], t, f"{dtype} {t.numel()} as words")
    base = _tensor(dtype, (3 * dlt._BLOCK + 8,), seed=99).to(DEV)
    odd = base[1:] if dtype.itemsize < 8 else base  # an 8-byte dtype is on a word boundary at any element
    elements = taken([*ts, odd])
    assert seen == [True, dtype.itemsize == 8]
    for i, t in enumerate([*ts, odd]):
        check_row(elements[i], t, f"{dtype} {t.numel()} element by element")
    for col in (0, 1, 2, 3, 9, STATS_LEN):  # counts, zero fraction, fingerprint: the same bits either way
        assert torch.equal(elements[:-1, col], words[:, col]), col


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_one_plan_launched_at_aligned_then_misaligned_memory(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading (words or elements) is decided at each launch from that launch's pointers, never
    kept with the structure's tables: the same plan launched on a view on an 8-byte boundary, then
    on one 1 element further (same dtype and numel), reads words then elements, right both times
    (8-byte loads at a misaligned address would be a fatal error on a GPU)."""
    _fresh_caches(monkeypatch)
    seen = _seeing_alignment(monkeypatch)
    n = 3 * dlt._BLOCK + 5
    base = _tensor(dtype, (n + 8,), seed=4).to(DEV)
    at, off = base[:n], base[1:n + 1]
    assert at.data_ptr() % 8 == 0 and off.data_ptr() % 8 != 0
    plan = dlt.bind([at], _allow_cpu=INTERPRET)
    assert plan is not None and dlt.bind([off], _allow_cpu=INTERPRET) is plan  # one structure
    for view in (at, off, at):
        check_row(dlt.launch(plan, [view.data_ptr()])[0], view, f"{dtype} at +{(view.data_ptr() - base.data_ptr())}")
    assert seen == [True, False, True]
