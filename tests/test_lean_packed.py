"""A lean step's small tensors described together (capture/packed.py, issue 25): the same rows, cheaper.

What must hold: the vectorised description of a packed batch gives the rows the per-tensor code
gave, bit for bit and type for type (an int stays an int in the catalog, -0.0 stays -0.0), on
every kind of content; a :class:`Plan` (one per layout, cached) gives the rows, in the order, of
the uncached path; and a layout that changes mid-run (a param added to the optimizer, a grad that
becomes None or appears, a param given another shape or dtype, optimizer state appearing) is a
new plan: every recorded row is still the row of the tensor as it was.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from helpers import snapshot
from torch import nn

import stepdump
from stepdump.capture import lean, packed
from stepdump.capture.step_state import Entry, tensor_entries
from stepdump.core.hashing import signed64
from stepdump.core.stats import compute_stats, segment_sums, small_stats


def _reference_packed_rows(kinds, buf, sizes):
    """The per-tensor description packed.packed_rows replaced (lean._packed_rows before issue 25's
    second pass), kept here as the reference its results must equal bit for bit."""
    x = buf.numpy()
    raw = memoryview(buf.view(torch.uint8).numpy()).cast("B")
    isz = buf.element_size()
    starts = [0] * len(sizes)
    for j in range(1, len(sizes)):
        starts[j] = starts[j - 1] + sizes[j - 1]
    with np.errstate(all="ignore"):
        lo = np.minimum.reduceat(x, starts).tolist()
        hi = np.maximum.reduceat(x, starts).tolist()
        sums, sqs = segment_sums(x, starts)
    rows = []
    for kind, a, n, vmin, vmax, vsum, vsq in zip(kinds, starts, sizes, lo, hi, sums, sqs, strict=True):
        fp = signed64(xxhash.xxh3_64_intdigest(raw[a * isz:(a + n) * isz]))
        if kind == "state":
            rows.append(((n,) + (None,) * 9, fp))
            continue
        stats = None
        if n <= 4096:
            stats = small_stats(x[a:a + n], vmin, vmax, vsum, vsq)
        elif math.isfinite(vmin) and math.isfinite(vmax) and math.isfinite(vsq):
            stats = (n, 0, 0, 0, vmin, vmax, None, None, math.sqrt(vsq), 0.0 if vmin > 0 or vmax < 0 else None)
        rows.append((stats if stats is not None else compute_stats(buf[a:a + n]), fp))
    return rows


def _exact(rows) -> list[str]:
    """Rows as text that tells every bit and type apart (repr: 0 from 0.0, -0.0 from 0.0, None)."""
    return [repr(r) for r in rows]


def _tensor(kind: str, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    if kind == "zeros":
        return torch.zeros(n, dtype=dtype)
    if kind == "negzero":
        return torch.full((n,), -0.0, dtype=dtype)
    if kind == "positive":
        return x.abs() + 0.5
    if kind == "negative":
        return -x.abs() - 0.5
    if kind == "layernorm":  # |mean| >> std: the two-pass variance
        return 1.0 + 1e-4 * x
    if kind == "sparse-ish":  # many exact zeros and mixed signs
        return torch.where(x.abs() < 0.7, torch.zeros_like(x), x)
    if kind in ("nan", "posinf", "neginf"):
        x[n // 2] = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf}[kind]
        return x
    if kind == "huge":
        return x * (1e300 if dtype == torch.float64 else 1e30)
    return x


CONTENTS = ["normal", "zeros", "negzero", "positive", "negative", "layernorm", "sparse-ish", "nan", "posinf",
            "neginf", "huge"]
SIZES = [1, 2, 7, 64, 4095, 4096, 4097, 10000, packed.CHUNK]


@pytest.mark.parametrize("vector_min", [0, 10**9], ids=["whole-buffer passes", "one call per tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("content", CONTENTS)
def test_packed_rows_equal_the_per_tensor_rows_bitwise(monkeypatch, content: str, dtype: torch.dtype,
                                                       vector_min: int) -> None:
    # Zero counts and two-pass variances: over the whole buffer, or tensor by tensor (both the same bits).
    monkeypatch.setattr(packed, "VECTOR_MIN", vector_min)
    monkeypatch.setattr(packed, "VECTOR_SPAN", 10**9 if vector_min == 0 else 0)
    g = torch.Generator().manual_seed(len(content))
    # Each size with this content, between normal neighbours (a tensor's row depends on its elements only).
    tensors, kinds = [], []
    for i, n in enumerate(SIZES):
        tensors += [_tensor("normal", 33, dtype, g), _tensor(content, n, dtype, g)]
        kinds += ["params", ("grads", "optimizer", "params")[i % 3]]
    kinds[-1] = "state"  # a state tensor's row: its numel only
    buf = torch.cat([t.reshape(-1) for t in tensors])
    sizes = [t.numel() for t in tensors]
    stats, fps = packed.packed_rows(kinds, buf, sizes)
    assert _exact(zip(stats, fps, strict=True)) == _exact(_reference_packed_rows(kinds, buf, sizes))
    # and the small tensors' stats are compute_stats' own (what a full step records for them)
    for t, kind, s in zip(tensors, kinds, stats, strict=True):
        if t.numel() <= packed.SMALL and kind != "state":
            assert repr(s) == repr(compute_stats(t)), (content, t.numel())


class _Net(nn.Module):
    """Linear layers, a LayerNorm, a lone ``scale`` whose shape and dtype a test may change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)
        self.extra = nn.Linear(4, 4)  # in the optimizer only once a test adds it
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.norm(self.fc1(x))) * self.scale.sum().to(x.dtype)
        return self.extra(y) if self.extra.weight.requires_grad else y


def _entries(model: nn.Module, opt: torch.optim.Optimizer) -> list[Entry]:
    snap = snapshot(model, opt)
    out = [Entry(kind, name, t, False, *(name.rsplit(".", 1) if kind == "optimizer" else (None, None)))
           for kind in ("params", "grads", "optimizer") for name, t in snap[kind].items()]
    return out


def test_a_plan_gives_the_rows_of_the_uncached_path_in_order() -> None:
    model = _Net()
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("extra")], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    entries = _entries(model, opt)
    entries.append(Entry("params", "big", torch.randn(packed.CHUNK + 3), False))  # not packed
    entries.append(Entry("params", "half", torch.randn(5).half(), False))  # not fp32/fp64
    entries.append(Entry("params", "f64", torch.randn(9, dtype=torch.float64), False))  # its own batch
    plans = packed.Plans()
    plan = plans.get(entries)
    assert plan.plain and plan.nbytes == sum(e[2].numel() * e[2].element_size() for e in entries)
    want = _exact(lean.lean_rows(entries, set()))
    assert _exact(lean.lean_rows(entries, set(), plan=plan)) == want
    assert plans.get(list(entries)) is plan and plans.built == 1  # the same layout: the same plan


# name -> what it does to (model, opt) before the forward of step 3
def _add_param(model, opt):
    opt.add_param_group({"params": list(model.extra.parameters())})


def _add_outside_tensor(model, opt):  # not the model's: the layout names it group1.param0
    opt.add_param_group({"params": [nn.Parameter(torch.linspace(-1.0, 1.0, 6))]})


def _grad_becomes_none(model, opt):
    model.scale.requires_grad_(False)
    model.scale.grad = None


def _grad_appears(model, opt):
    model.extra.requires_grad_(True)


def _reshape(model, opt):  # the same Parameter object, other memory of another shape (its momentum reset)
    opt.state.pop(model.scale, None)
    with torch.no_grad():
        model.scale.data = torch.linspace(0.5, 1.5, 5)


def _retype(model, opt):
    opt.state.pop(model.scale, None)
    with torch.no_grad():
        model.scale.data = model.scale.data.double()


def _same_numel_other_shape(model, opt):  # 16 elements either way: only the shape tells the layouts apart
    opt.state.pop(model.fc1.bias, None)
    with torch.no_grad():
        model.fc1.bias.data = model.fc1.bias.data.reshape(2, 8).clone()


CHANGES = {
    "param added to the optimizer": _add_param,
    "tensor outside the model added to the optimizer": _add_outside_tensor,
    "grad becomes None": _grad_becomes_none,
    "grad appears": _grad_appears,
    "param reshaped": _reshape,
    "param dtype changed": _retype,
    "same numel, other shape": _same_numel_other_shape,
}


def _ids(entries: list[tuple]) -> list[tuple]:
    return [(e[0], e[1], id(e[2]), *e[3:]) for e in entries]


class _Bias2d(_Net):
    """_Net with fc1's bias used flat, whatever its shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.fc1.weight, self.fc1.bias.reshape(-1))
        y = self.fc2(self.norm(h)) * self.scale.sum().to(x.dtype)
        return self.extra(y) if self.extra.weight.requires_grad else y


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_layout_change_mid_run_is_a_new_plan_and_every_row_stays_right(tmp_path, monkeypatch, change) -> None:
    monkeypatch.setattr(lean, "INLINE_BYTES", 1 << 40)  # every step read whole at the pre-hook, through plans
    monkeypatch.setattr(lean, "OPTIMIZER_EVERY", 2)
    model = _Bias2d()
    # model.extra: used (trained) while it requires grad; in the optimizer from the start only for "grad appears"
    model.extra.requires_grad_(change == "param added to the optimizer")
    params = [p for n, p in model.named_parameters() if change == "grad appears" or not n.startswith("extra")]
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    caps = []
    g = torch.Generator().manual_seed(1)
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", every=None, stats_every=1) as rec:
        for t in range(7):
            if t == 3:
                CHANGES[change](model, opt)
            opt.zero_grad()
            x = torch.randn(5, 8, generator=g)
            model(x).pow(2).mean().backward()
            caps.append(snapshot(model, opt))
            # the Assembler's stats-only entries (selected params cached per layout) == tensor_entries now
            asm = rec._asm
            want_entries = tensor_entries(asm.layout, opt, asm.kinds, asm.selected, False, {})
            assert _ids(asm.entries(False)) == _ids(want_entries), f"{change}: step {t} entries"
            opt.step()
        plans = rec._lean.plans
    assert plans.built <= 5, plans.built  # steady steps reuse their plan (2 layouts before, 2 after, + step 0)
    run = stepdump.open(tmp_path / "run")
    for t, cap in enumerate(caps):
        want = {}
        for kind in ("params", "grads", "optimizer"):
            if kind == "optimizer" and t % 2:
                continue
            for name, live in cap[kind].items():
                param, key = name.rsplit(".", 1) if kind == "optimizer" else (None, None)
                (row,) = lean.lean_rows([Entry(kind, name, live, False, param, key)], set())  # the uncached path
                want[(kind, name)] = repr((row.dtype, row.shape, *row.stats, row.fp))
        got = {(r[0], r[1]): repr(tuple(r[4:-1])) for r in run.catalog.step_rows(t)
               if r[0] in ("params", "grads", "optimizer")}
        assert got == want, f"{change}: step {t}"


def test_a_few_two_pass_tensors_in_a_large_buffer_are_done_one_by_one(monkeypatch) -> None:
    """nanoGPT tiny's layout: 5 LayerNorm weights (|mean| > 10 std: two-pass variance) among
    ~200k elements. They are done one by one (no float64 copy of the whole buffer, no np.repeat
    of the means over it), with the bits of the per-tensor path."""
    g = torch.Generator().manual_seed(7)
    tensors = [_tensor("normal", 40_000, torch.float32, g) for _ in range(5)]
    for i in range(5):
        tensors.insert(2 * i + 1, _tensor("layernorm", 64, torch.float32, g))
    kinds = ["params"] * len(tensors)
    buf = torch.cat(tensors)
    want = [compute_stats(t) for t in tensors]

    def no_repeat(*args, **kwargs):
        raise AssertionError("a whole-buffer pass for 5 small tensors")

    monkeypatch.setattr(packed.np, "repeat", no_repeat)
    stats, _ = packed.packed_rows(kinds, buf, [t.numel() for t in tensors])
    assert _exact(stats[1::2]) == _exact(want[1::2])  # the LayerNorm weights: every stat, compute_stats' bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_columns_are_the_rows_as_columns(dtype: torch.dtype) -> None:
    """Segments.columns (what the writer puts in a stat chunk) holds exactly the values Segments.rows
    gives (NULL as -1 / NaN): every tensor shape the passes treat apart, a NaN, an Inf, a state
    tensor, one element, a cancellation-regime tensor, one past SMALL, all zeros, mixed signs."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(7, generator=g, dtype=dtype), torch.tensor([1.5], dtype=dtype),
          torch.tensor([float("nan"), 1.0], dtype=dtype), torch.tensor([float("inf"), -2.0], dtype=dtype),
          (1000 + torch.randn(64, generator=g, dtype=dtype) * 1e-3), torch.zeros(5, dtype=dtype),
          torch.randn(packed.SMALL + 10, generator=g, dtype=dtype), torch.rand(9, generator=g, dtype=dtype) + 1,
          torch.tensor([0.0, -0.0, 3.0], dtype=dtype), torch.arange(4, dtype=dtype)]
    kinds = ["params"] * (len(ts) - 1) + ["state"]
    buf = torch.cat(ts)
    segs = packed.Segments(kinds, [t.numel() for t in ts], buf.element_size())
    stats, fps = segs.rows(buf)
    cols = segs.columns(buf)
    assert cols.fps.tolist() == fps
    for i, row in enumerate(stats):
        got = [None if v < 0 else v for v in cols.counts[:, i].tolist()]
        got += [None if v != v else v for v in cols.floats[:, i].tolist()]
        assert got == list(row), (i, got, row)
    assert any(v is None for row in stats for v in row), "the control: some stat not measured"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("content", CONTENTS)
def test_a_batch_of_large_tensors_skips_the_sums_and_gives_the_same_rows(content: str, dtype: torch.dtype) -> None:
    # Only a small tensor's row has a mean, a std and a zero count: a batch of large ones (a plan
    # batches them apart) computes their squares alone, and its rows are the reference's, bitwise.
    g = torch.Generator().manual_seed(len(content))
    tensors = [_tensor(content, n, dtype, g) for n in (4097, 10000, packed.CHUNK)] + [_tensor("normal", 5000, dtype, g)]
    kinds = ["params", "grads", "optimizer", "params"]
    buf = torch.cat([t.reshape(-1) for t in tensors])
    sizes = [t.numel() for t in tensors]
    segs = packed.Segments(kinds, sizes, buf.element_size())
    assert not segs.sums  # no row needs a sum
    assert packed.Segments(["params", *kinds], [7, *sizes], buf.element_size()).sums
    stats, fps = segs.rows(buf)
    assert _exact(zip(stats, fps, strict=True)) == _exact(_reference_packed_rows(kinds, buf, sizes))
    cols = segs.columns(buf)
    assert cols.fps.tolist() == fps and cols.counts[0].tolist() == sizes


def test_a_plan_batches_the_small_tensors_of_a_dtype_apart_from_the_large_ones() -> None:
    entries = [Entry("params", f"p{i}", torch.randn(n), False) for i, n in enumerate((10, 5000, 64, 20000, 3))]
    plan = packed.Plans().get(entries)
    assert [b.names for b in plan.batches] == [["p0", "p2", "p4"], ["p1", "p3"]]
    assert [b.segs.sums for b in plan.batches] == [True, False]
    # the uncached path batches them the same way: the same rows, in the same order
    assert _exact(lean.lean_rows(entries, set(), plan=plan)) == _exact(lean.lean_rows(entries, set()))
