"""Sparse gradients are recorded exactly as the optimizer sees them (issue 22, item 5).

``nn.Embedding(sparse=True)`` gives a sparse COO gradient whose indices repeat when a
batch looks a row up twice; the update adds the duplicates one by one, ``to_dense()``
sums them first, and the two differ in the last bits. A recorded sparse gradient must
read back as the very tensor the optimizer was handed: the same indices and values in
the same order, the same coalesced flag, the same size (FORMAT.md, "Sparse tensors").

The matrix: every optimizer that takes sparse gradients x the recording modes (every step
in full, tiered lean stats-only steps, a gradient log) x the gradient's structure
(duplicate indices from one backward, coalesced by the loop, accumulated over two
backwards). Each case checks against the live gradient cloned at the optimizer's
pre-step hook: reads, fingerprints (computed here from FORMAT.md's definition), stats,
rebuilt params of a gradient log, restore + redo, and the diff of an identical rerun.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash
from helpers import assert_same, gen
from torch import nn

import stepdump

STEPS = 5
ROWS, DIM = 30, 6


class Net(nn.Module):
    """A sparse embedding, with a dense head unless the optimizer takes sparse grads only."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.head = nn.Linear(DIM, 2) if head else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(1)
        return self.head(h) if self.head is not None else h[:, :2]


OPTIMIZERS: dict[str, tuple[bool, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]] = {
    "SGD": (True, lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "SGD-momentum": (True, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),  # a sparse momentum buffer
    "SparseAdam": (False, lambda ps: torch.optim.SparseAdam(ps, lr=0.05)),  # refuses dense grads
    "Adagrad": (True, lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
}


def _fires_at_3(info: Any) -> bool:
    return info.grads_finite() and info.step == 3  # grads_finite looks at the sparse grad too


MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lean": {"every": 2, "stats_every": 1},  # odd steps: stats and fingerprints of the live tensors only
    "gradlog": {"gradient_log": 3},  # grads every step, params rebuilt from keyframes 0 and 3
    "ring": {"ring": 2, "trigger": _fires_at_3, "after": 1},  # 1, 2 held in memory, 3 the trigger, 4 after
    "keyframes": {"keyframe_every": 3},  # keyframes 0 and 3, the others rebuilt by stepdump.replay
}
# The steps each mode stores in full (or rebuilds on read); the others have stats and fingerprints.
STORED = {"full": {0, 1, 2, 3, 4}, "lean": {0, 2, 4}, "gradlog": {0, 1, 2, 3, 4}, "ring": {1, 2, 3, 4},
          "keyframes": {0, 3}}
# The step each mode restores and redoes (stored in full, or rebuilt from the gradient log).
REDO = {"full": 2, "lean": 2, "gradlog": 2, "ring": 2, "keyframes": 3}
FORMS = ("duplicates", "coalesced", "accumulated")


def build(opt_name: str) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    head, make = OPTIMIZERS[opt_name]
    model = Net(head)
    return model, make(list(model.parameters()))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(t)
    idx = torch.randint(0, ROWS, (5, 4), generator=g)
    idx[1, 1] = idx[0, 0]  # a row looked up twice: a duplicate index in the grad, always
    return idx, torch.randn(5, 2, generator=g)


def iteration(model: Net, opt: torch.optim.Optimizer, t: int, form: str, data: Any = None) -> None:
    idx, y = batch(t) if data is None else data
    opt.zero_grad(set_to_none=True)
    if form == "accumulated":  # two micro-batches: the second grad is appended to the first, uncoalesced
        for half in (slice(0, 2), slice(2, 5)):
            nn.functional.mse_loss(model(idx[half]), y[half]).backward()
    else:
        nn.functional.mse_loss(model(idx), y).backward()
    if form == "coalesced":
        model.emb.weight.grad = model.emb.weight.grad.coalesce()
    opt.step()


def clone(t: torch.Tensor) -> torch.Tensor:
    """An exact private copy, sparse structure included (order of indices, coalesced flag)."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return torch.sparse_coo_tensor(t._indices().clone(), t._values().clone(), t.shape,
                                       is_coalesced=t.is_coalesced(), check_invariants=True)
    return t.clone()


def watch(model: Net, opt: torch.optim.Optimizer) -> list[dict[str, dict[str, torch.Tensor]]]:
    """What the optimizer sees at each step, cloned at its pre-step hook: params and grads by name."""
    seen: list[dict[str, dict[str, torch.Tensor]]] = []

    def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        named = dict(model.named_parameters())
        seen.append({"params": {n: clone(p) for n, p in named.items()},
                     "grads": {n: clone(p.grad) for n, p in named.items() if p.grad is not None},
                     # a sparse momentum buffer's series is dense; the state_dict has it exact
                     "optimizer": {f"{n}.{k}": v.detach().to_dense() if v.is_sparse else v.detach().clone()
                                   for n, p in named.items() for k, v in opt.state.get(p, {}).items()
                                   if isinstance(v, torch.Tensor)},
                     "state_dict": copy.deepcopy(opt.state_dict())})

    opt.register_step_pre_hook(hook)
    return seen


def same(got: Any, want: torch.Tensor, what: str) -> None:
    """Bitwise equal; a sparse tensor also in its structure (indices order, coalesced flag, size)."""
    assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__} is not a tensor"
    assert got.layout == want.layout, f"{what}: layout {got.layout}, the optimizer saw {want.layout}"
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced(), f"{what}: coalesced flag {got.is_coalesced()}"
        assert got.shape == want.shape and got.sparse_dim() == want.sparse_dim(), f"{what}: size {got.shape}"
        assert_same(got._indices(), want._indices(), f"{what} indices")
        assert_same(got._values(), want._values(), f"{what} values")
    else:
        assert_same(got, want, what)


def same_tree(got: Any, want: Any, what: str) -> None:
    if isinstance(want, torch.Tensor):
        same(got, want, what)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: keys {got!r} != {want!r}"
        for k in want:
            same_tree(got[k], want[k], f"{what}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{what}: {got!r} != {want!r}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same_tree(a, b, f"{what}/{i}")
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def spec_fingerprint(t: torch.Tensor) -> int:
    """FORMAT.md's fingerprint of a sparse COO tensor, written from the spec: xxh3-64 of the
    32-byte header (b"COO1", flags with bit 0 = coalesced, sparse_dim, nnz, 0), the int64
    indices and the values, little-endian, as a signed 64-bit integer."""
    idx, val = t._indices().contiguous(), t._values().contiguous()
    head = struct.pack("<4sIQQQ", b"COO1", int(t.is_coalesced()), t.sparse_dim(), t._nnz(), 0)
    data = head + idx.numpy().tobytes() + val.numpy().tobytes()
    u = xxhash.xxh3_64_intdigest(data)
    return u - (1 << 64) if u >= 1 << 63 else u


def record(path: Any, opt_name: str, mode: str, form: str) -> tuple[list[dict[str, dict[str, torch.Tensor]]], Net]:
    model, opt = build(opt_name)
    seen = watch(model, opt)
    with stepdump.Recorder(path, model, opt, on_error="raise", **MODES[mode]) as rec:
        for t in range(STEPS):
            rec.log_batch(batch(t))  # for stepdump.replay (kept at every step in keyframe mode only)
            iteration(model, opt, t, form)
    assert len(seen) == STEPS
    for t in range(STEPS):  # the case is what it says it is
        g = seen[t]["grads"]["emb.weight"]
        assert g.layout == torch.sparse_coo and g.is_coalesced() == (form == "coalesced"), f"step {t}: {g}"
    return seen, model


CASES = [pytest.param(o, m, f, id=f"{o}-{m}-{f}") for o in OPTIMIZERS for m in MODES for f in FORMS]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str, str], tuple[Any, list[Any]]]:
    """The run of a case and what its optimizer saw, recorded once for the tests that only read it."""
    cache: dict[tuple[str, str, str], tuple[Any, list[Any]]] = {}

    def get(opt_name: str, mode: str, form: str) -> tuple[Any, list[Any]]:
        key = (opt_name, mode, form)
        if key not in cache:
            path = tmp_path_factory.mktemp("run") / "-".join(key)
            cache[key] = (path, record(path, opt_name, mode, form)[0])
        return cache[key]

    return get


@pytest.mark.parametrize("opt_name,mode,form", CASES)
def test_a_sparse_grad_reads_back_as_the_optimizer_saw_it(recorded, opt_name, mode, form):
    path, seen = recorded(opt_name, mode, form)
    with stepdump.open(path) as run:
        stored = set(run.steps)
        stats = run.stats(kind="grads", name="emb.weight").set_index("step")
        for t in range(STEPS):
            fps = run.fingerprints(t, kinds=("grads", "params"))
            want = seen[t]["grads"]["emb.weight"]
            assert fps[("grads", "emb.weight")] == spec_fingerprint(want), f"step {t}: grad fingerprint"
            row = stats.loc[t]
            assert row["numel"] == ROWS * DIM and row["nan"] == 0, f"step {t}: {row}"
            dense_zeros = int((want.coalesce().to_dense() == 0).sum())
            if row["zero_frac"] == row["zero_frac"]:  # measured: counts the implicit zeros too
                assert row["zero_frac"] == dense_zeros / (ROWS * DIM), f"step {t}: zero_frac {row['zero_frac']}"
            assert (t in stored) == (t in STORED[mode]), f"mode {mode}: steps {sorted(stored)} stored in full"
            if t not in stored:
                continue
            for n, g in seen[t]["grads"].items():
                same(run.tensor(n, t, kind="grads"), g, f"step {t} grad {n}")
                same(run.tensors(t, kind="grads")[n], g, f"step {t} grad {n} via tensors()")
            for n, p in seen[t]["params"].items():  # a gradient log rebuilds these from the sparse grads
                same(run.tensor(n, t, kind="params"), p, f"step {t} param {n}")
            got = run.tensors(t, kind="optimizer")
            assert sorted(got) == sorted(seen[t]["optimizer"]), f"step {t}: optimizer state {sorted(got)}"
            for n, v in seen[t]["optimizer"].items():
                same(got[n], v, f"step {t} optimizer {n}")
            same_tree(run.optimizer_state_dict(t), seen[t]["state_dict"], f"step {t} optimizer_state_dict")


@pytest.mark.parametrize("opt_name,mode,form", CASES)
def test_restore_and_redo_a_step_gives_the_next_record(recorded, opt_name, mode, form):
    path, _ = recorded(opt_name, mode, form)
    k = REDO[mode]  # a full step (a rebuilt one in the gradient log)
    with stepdump.open(path) as run:
        model, opt = build(opt_name)
        run.restore(k, model, opt)
        seen = watch(model, opt)
        iteration(model, opt, k, form)
        for n, g in seen[0]["grads"].items():
            same(run.tensor(n, k, kind="grads"), g, f"redone step {k} grad {n}")
        if k + 1 in run.steps:  # stored (or rebuilt): the values; at a lean step the fingerprints below
            for n, p in model.named_parameters():
                same(run.tensor(n, k + 1, kind="params"), p.detach(), f"{n} after the redo of step {k}")
            same_tree(dict(run.state_dict(k + 1)), dict(model.state_dict()), "state_dict after the redo")
            same_tree(run.optimizer_state_dict(k + 1), opt.state_dict(), "optimizer state after the redo")
        fps = run.fingerprints(k + 1, kinds=("params",))
        for n, p in model.named_parameters():
            assert fps[("params", n)] == stepdump_fingerprint(p.detach()), f"{n} after the redo of step {k}"


@pytest.mark.parametrize("opt_name,form", [pytest.param(o, f, id=f"{o}-{f}") for o in OPTIMIZERS for f in FORMS])
def test_replay_of_a_keyframe_run_redoes_the_sparse_grads_bitwise(recorded, opt_name, form):
    """stepdump.replay checks every replayed step's live grads (sparse ones too) against the
    recorded fingerprints, and hands back the step's sparse grad as the optimizer saw it."""
    path, seen = recorded(opt_name, "keyframes", form)
    with stepdump.open(path) as run:
        model, opt = build(opt_name)
        result = stepdump.replay(run, STEPS - 1, model, opt,
                                 lambda m, o, data: iteration(m, o, -1, form, data))
        assert result.keyframe == 3 and result.steps_replayed == 1, result
        for n, g in seen[STEPS - 1]["grads"].items():
            same(result.tensor(n, "grads"), g, f"replayed step {STEPS - 1} grad {n}")


def stepdump_fingerprint(t: torch.Tensor) -> int:
    u = xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy().tobytes())
    return u - (1 << 64) if u >= 1 << 63 else u


@pytest.mark.parametrize("opt_name,mode", [pytest.param(o, m, id=f"{o}-{m}") for o in OPTIMIZERS for m in MODES])
def test_two_identical_runs_with_sparse_grads_diff_identical(recorded, tmp_path, opt_name, mode):
    path, _ = recorded(opt_name, mode, "duplicates")
    record(tmp_path / "b", opt_name, mode, "duplicates")
    with stepdump.open(path) as a, stepdump.open(tmp_path / "b") as b:
        res = stepdump.diff(a, b)
        assert res.identical, res.summary()


def test_a_different_sparse_grad_is_found_by_diff(recorded, tmp_path):
    """The other way round: the same grad coalesced at step 3 (the same dense values) is a difference."""
    path, _ = recorded("SGD", "full", "duplicates")
    model, opt = build("SGD")
    with stepdump.Recorder(tmp_path / "b", model, opt, on_error="raise"):
        for t in range(STEPS):
            iteration(model, opt, t, "coalesced" if t == 3 else "duplicates")
    with stepdump.open(path) as a, stepdump.open(tmp_path / "b") as b:
        res = stepdump.diff(a, b)
        assert not res.identical and res.first_step == 3, res.summary()


@pytest.mark.parametrize("codec", ["zstd", "blosc-lz4-bit", "delta-lz4", "delta-zstd"])
def test_every_codec_keeps_a_sparse_grad_exact(tmp_path, codec):
    """The raw bytes of a sparse grad go through the run's codec like any tensor's; a delta codec
    encodes one against the previous step's when their sizes agree (same nnz)."""
    model, opt = build("SGD")
    seen = watch(model, opt)
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise", codec=codec):
        for t in range(STEPS):
            iteration(model, opt, t, "duplicates")
    with stepdump.open(tmp_path / "run") as run:
        for t in range(STEPS):
            same(run.tensor("emb.weight", t, kind="grads"), seen[t]["grads"]["emb.weight"], f"{codec} step {t}")
