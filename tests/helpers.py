"""Small models, deterministic data and bitwise comparisons shared by the core tests.

Everything here is written from the spec (DESIGN.md), not from stepdump's code:
the snapshots name tensors the way the spec says a run names them, so a test
comparing a run with a snapshot checks stepdump's naming too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of the same width: equal bits <=> equal.

    Unlike ``torch.equal`` on floats this tells -0.0 from 0.0 and treats a NaN
    as equal to the very same NaN, which is what "recorded bit-exactly" means.
    """
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return t.view(_INT_VIEW[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor), f"{what}: got {type(a).__name__}, not a tensor"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def assert_same_tree(a: Any, b: Any, what: str = "") -> None:
    """Nested dicts/lists/tuples with tensors and plain values, compared exactly."""
    if isinstance(b, torch.Tensor):
        assert_same(a, b, what)
    elif isinstance(b, dict):
        assert isinstance(a, dict), f"{what}: {type(a).__name__} is not a dict"
        assert set(a) == set(b), f"{what}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in b:
            assert_same_tree(a[k], b[k], f"{what}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{what}/{i}")
    elif isinstance(b, float) and b != b:
        assert isinstance(a, float) and a != a, f"{what}: {a!r} is not nan"
    else:
        assert a == b and type(a) is type(b), f"{what}: {a!r} != {b!r}"


# -- snapshots the way the spec names things ---------------------------------------


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> recorded name: model names, else group{i}.param{j}."""
    names = {id(p): n for n, p in model.named_parameters()}
    for i, g in enumerate(optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            names.setdefault(id(p), f"group{i}.param{j}")
    return names


def all_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = param_names(model, optimizer)
    out = {n: p for n, p in model.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            out.setdefault(names[id(p)], p)
    return out


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Clones of params, grads and optimizer state tensors, named as a run names them."""
    params = all_params(model, optimizer)
    snap: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}, "optimizer": {}}
    with torch.no_grad():
        for n, p in params.items():
            snap["params"][n] = p.detach().clone()
            if p.grad is not None:
                snap["grads"][n] = p.grad.detach().clone()
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    snap["optimizer"][f"{n}.{k}"] = v.detach().clone()
    return snap


def assert_run_matches(run: Any, step: int, snap: dict[str, dict[str, torch.Tensor]],
                       kinds: Iterable[str] = ("params", "grads", "optimizer")) -> None:
    """Every kind of a recorded step holds exactly the snapshot's tensors, bit for bit."""
    for kind in kinds:
        got = run.tensors(step, kind)
        want = snap[kind]
        assert sorted(got) == sorted(want), f"step {step} {kind}: names {sorted(got)} != {sorted(want)}"
        for name, t in want.items():
            assert_same(got[name], t, f"step {step} {kind} {name}")
            # tensor() and tensors() must agree
            assert_same(run.tensor(name, step, kind=kind), t, f"step {step} {kind} {name} via tensor()")


def optimizer_state_clone(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of optimizer.state_dict() (tensors cloned)."""
    sd = optimizer.state_dict()
    return {
        "state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                  for i, s in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


# -- data and models ------------------------------------------------------------------


def gen(step: int, salt: int = 0) -> torch.Generator:
    """A generator seeded from the step index: data independent of the global RNG."""
    return torch.Generator().manual_seed(1_000_003 * salt + step)


def regression_batch(step: int, n: int = 8, d_in: int = 10, d_out: int = 1, salt: int = 0):
    g = gen(step, salt)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    return x, y


def classification_batch(step: int, n: int = 8, d_in: int = 784, classes: int = 10, salt: int = 0):
    g = gen(step, salt)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


def train_recorded(path: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0,
                   **rec_kwargs: Any) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Train on regression_batch(t) (8 in, 4 out) for steps start..start+steps-1 under a
    Recorder (resuming the run when start > 0); return a snapshot taken at each pre-step moment."""
    import stepdump

    snaps = []
    with stepdump.Recorder(path, model, opt, resume=start > 0, **rec_kwargs) as rec:
        for t in range(start, start + steps):
            x, y = regression_batch(t, d_in=8, d_out=4)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    return snaps


def peak_traced_bytes(fn: Any) -> int:
    """Peak Python-traced allocation while ``fn()`` runs (tracemalloc: numpy and torch CPU buffers too)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def catalog_sql(run_dir: Any, sql: str, args: Any = ()) -> list[Any]:
    """Run ``sql`` on a run's catalog directly (autocommit): how tests build damaged or hostile stores."""
    import sqlite3
    from pathlib import Path

    con = sqlite3.connect(Path(run_dir) / "catalog.sqlite", isolation_level=None)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()
