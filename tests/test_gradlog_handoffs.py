"""A gradient-log step is one hand-off and one write (issue 25): batched per step, never per tensor.

On a small model's step the recorder's cost was GIL hand-offs between the training thread and
the recorder's threads, not bytes: every SQLite call the writer makes lets go of the GIL, and so
does every queue or condition a second thread waits on. A gradient-log step stores every grad,
and it inserted each grad's blob row by its own ``executemany`` step (a hand-off per tensor) and
handed its batched bytes to the appender thread and waited for them (two more). These tests pin,
on every codec, durability and optimizer of the row below:

* a step's transaction is a fixed handful of statements, whatever the number of tensors: one
  multi-row INSERT of its blob rows, one of its tensor rows, its step row, its scalars, COMMIT;
* a step with bytes below full commits with the steps of the last ``COMMIT_WINDOW`` (group commit,
  docs/reliability.md), its bytes written before; with ``durability="fsync"`` on its own;
* a small step's bytes are written by the writer itself (one write), not handed to the appender
  thread; a blob large enough to go straight to the file still goes through the appender;
* the run reads back bit-exact: every step's grads, and the params a rebuild derives from them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, tiny_batch, tiny_model

import stepdump
from stepdump.capture import writer
from stepdump.capture.step_state import Entry
from stepdump.store.storage import LocalStorage

K = 4
STEPS = 9


@pytest.fixture
def append_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, bytes) of every segment append."""
    seen: list[tuple[str, int]] = []
    real = LocalStorage.append

    def append(self: LocalStorage, key: str, data: Any) -> int:
        seen.append((threading.current_thread().name, memoryview(data).nbytes))
        return real(self, key, data)

    monkeypatch.setattr(LocalStorage, "append", append)
    return seen


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _big_model() -> torch.nn.Module:
    """The tiny MLP with a 512x1024 layer in front: one grad of 2 MiB, past the writer's direct-write size."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 4))


def _record(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, **kwargs: Any
            ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Train STEPS steps under a gradient log; the grads each update applied and the params after it."""
    grads: list[dict[str, torch.Tensor]] = []
    params: list[dict[str, torch.Tensor]] = []
    with stepdump.Recorder(path, model, opt, gradient_log=K, **kwargs) as rec:
        for t in range(STEPS):
            x, y = tiny_batch(t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
            rec.log(loss=float(t))
    return grads, params


def _transactions(statements: list[str]) -> list[list[str]]:
    """The statements between one COMMIT and the next (each list ends with its COMMIT)."""
    out: list[list[str]] = [[]]
    for s in statements:
        out[-1].append(s)
        if s == "COMMIT":
            out.append([])
    return [t for t in out if t and t[-1] == "COMMIT"]


CASES = [  # (codec, durability, optimizer)
    ("raw", "flush", "adam"),
    ("zstd", "flush", "sgd"),
    ("delta-lz4", "flush", "adamw"),
    ("blosc-lz4", "flush", "adam"),
    ("raw", "fsync", "sgd"),
    ("delta-zstd", "fsync", "adam"),
]


@pytest.mark.parametrize("window", [0.0, 60.0], ids=["each-step-commits", "steps-held-together"])
@pytest.mark.parametrize(("codec", "durability", "optim"), CASES, ids=["-".join(c) for c in CASES])
def test_a_gradient_log_step_is_one_transaction_of_a_few_statements_and_one_write(
        tmp_path: Path, statements: list[str], append_threads: list[tuple[str, int]],
        codec: str, durability: str, optim: str, window: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "COMMIT_WINDOW", window)
    model = tiny_model()
    opt = _optimizer(optim, model)
    grads, params = _record(tmp_path / "run", model, opt, codec=codec, durability=durability)
    steps = [t for t in _transactions(statements) if any(s.startswith("INSERT OR REPLACE INTO steps(") for s in t)]
    if durability == "fsync" or window == 0:
        # Each step with bytes commits on its own (+ the final record's), in one transaction.
        assert len(steps) == STEPS + 1, [len(t) for t in steps]
    else:
        # Group commit: only a layout change (the first two steps make the series and the meta that
        # names them), a keyframe (full: every K steps) and the final record commit at once; the
        # steps between wait for them.
        assert len(steps) <= 2 + STEPS // K + 1 < STEPS + 1, [len(t) for t in steps]
    for t in steps[2:]:
        blobs = [s for s in t if s.startswith("INSERT INTO blobs(")]
        tensors = [s for s in t if s.startswith("INSERT OR REPLACE INTO tensors(")]
        assert len(blobs) == 1 and len(tensors) == 1, (len(blobs), len(tensors), t[:3])
        # BEGIN, blobs, tensors, the stat chunk (the params between keyframes: stats only), steps,
        # scalars, COMMIT: a fixed handful, not one per tensor or step.
        assert len([s for s in t if s.startswith("INSERT INTO stat_chunks(")]) <= 1, [s[:60] for s in t]
        assert len(t) <= 7, [s[:60] for s in t]
    # The model's bytes are small: the writer writes each step's batch itself, no second thread.
    others = [(name, n) for name, n in append_threads if name != "stepdump-writer"]
    assert others == [] and len(append_threads) >= len(steps) - 1, (others, len(append_threads))
    with stepdump.open(tmp_path / "run") as run:
        for step in range(STEPS):
            for name, g in grads[step].items():
                assert_same(run.tensor(name, step, "grads"), g, f"grad {name} at step {step}")
        for step in (K + 1, STEPS - 1):  # not keyframes: params derived from the keyframe and the grads
            sd = run.state_dict(step + 1)
            for name, p in params[step].items():
                assert_same(sd[name], p, f"param {name} after step {step}")


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_blob_past_the_direct_write_size_still_goes_through_the_appender(
        tmp_path: Path, statements: list[str], append_threads: list[tuple[str, int]], codec: str) -> None:
    """The small ones are written by the writer; the 2 MiB grad overlaps with the rest on the appender."""
    model = _big_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    grads, _ = _record(tmp_path / "run", model, opt, codec=codec)
    on_appender = [n for name, n in append_threads if name == "stepdump-appender"]
    assert len(on_appender) >= STEPS and max(on_appender) >= 1 << 20, on_appender[:5]
    for t in _transactions(statements)[2:STEPS]:
        assert sum(s.startswith("INSERT INTO blobs(") for s in t) <= 1, [s[:60] for s in t]
    with stepdump.open(tmp_path / "run") as run:
        for step in (1, K + 1, STEPS - 1):
            for name, g in grads[step].items():
                assert_same(run.tensor(name, step, "grads"), g, f"grad {name} at step {step}")


GRADS = {  # name -> a grad that makes the writer's packed stats take each of their paths
    "normal": lambda g: torch.randn(300, generator=g),
    "zeros": lambda g: torch.zeros(100),
    "signed": lambda g: -torch.rand(50, generator=g) - 0.5,  # one sign: no zero count
    "cancel": lambda g: 1 + 1e-4 * torch.randn(64, generator=g),  # |mean| > 10 std: two passes
    "nan": lambda g: torch.randn(40, generator=g).index_fill_(0, torch.tensor([3]), float("nan")),
    "inf": lambda g: torch.randn(40, generator=g).index_fill_(0, torch.tensor([5]), float("-inf")),
    "one": lambda g: torch.randn(1, generator=g),
    "fp64": lambda g: torch.randn(70, generator=g, dtype=torch.float64),
    "fp64b": lambda g: torch.randn(4096, generator=g, dtype=torch.float64),  # the largest packed size
    "large": lambda g: torch.randn(5000, generator=g),  # past it: compute_stats's torch path
    "fp16": lambda g: torch.randn(80, generator=g).half(),  # not packed either
}


def test_a_gradient_log_steps_grad_rows_are_compute_stats_and_fingerprint_bit_for_bit(tmp_path: Path) -> None:
    """The writer describes a step's small grads together; each row must be what ``compute_stats``
    and ``fingerprint`` give that grad alone, in every regime of the stats (the row above)."""
    from helpers import catalog_sql

    from stepdump.core.hashing import fingerprint
    from stepdump.core.stats import compute_stats

    gen = torch.Generator().manual_seed(0)
    made = {name: f(gen) for name, f in GRADS.items()}
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in made.items()})
    model = torch.nn.Module()
    model.p = params
    opt = torch.optim.SGD(params.parameters(), lr=0.0)
    seen: list[dict[str, torch.Tensor]] = []
    with stepdump.Recorder(tmp_path / "run", model, opt, gradient_log=K):
        for step in range(3):
            grads = {n: f(gen) for n, f in GRADS.items()}
            for n, p in params.items():
                p.grad = grads[n].clone()
            seen.append(grads)
            opt.step()
    for step in range(3):
        rows = catalog_sql(tmp_path / "run", "SELECT s.name, t.numel, t.nan, t.posinf, t.neginf, t.min, t.max, "
                           "t.mean, t.std, t.norm, t.zero_frac, t.fingerprint FROM tensors t JOIN series s "
                           "ON s.id = t.series WHERE s.kind = 'grads' AND t.step = ?", (step,))
        got = {r[0]: tuple(r[1:]) for r in rows}
        assert set(got) == {f"p.{n}" for n in GRADS}, sorted(got)
        for n, g in seen[step].items():
            want = (*compute_stats(g), fingerprint(g))
            assert got[f"p.{n}"] == want, (step, n, got[f"p.{n}"], want)


def _deep(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *[torch.nn.Linear(16, 16) for _ in range(n)],
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("layers", [0, 4, 12])
def test_staging_a_gradient_log_steps_grads_is_not_a_torch_call_per_grad(tmp_path: Path, layers: int) -> None:
    """Each torch call of the training thread lets go of the GIL, and with the writer waiting for it
    that is a hand-off; the step's grads are copied into staging by one call, not one per grad."""
    import sys

    model = _deep(layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    copies = 0
    grads = len(list(model.parameters()))

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal copies
        if event == "c_call" and getattr(arg, "__name__", "") == "copy_":
            copies += 1

    with stepdump.Recorder(tmp_path / "run", model, opt, gradient_log=K):
        for t in range(STEPS):
            x, y = tiny_batch(t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if t >= 2:
                sys.setprofile(prof)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
    steps = STEPS - 2
    assert copies <= steps, (copies, steps, grads)  # was a copy per grad: grads x steps
    with stepdump.open(tmp_path / "run") as run:
        for name, p in model.named_parameters():
            assert_same(run.tensor(name, STEPS, "params"), p.detach(), f"param {name} at the end")


def _staging_calls(tmp_path: Path, layers: int) -> float:
    """Python calls into capture/staging.py per gradient-log step (keyframes excluded) on the training thread."""
    import sys

    model = _deep(layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.endswith("capture/staging.py"):
            calls += 1

    measured = 0
    with stepdump.Recorder(tmp_path / f"run{layers}", model, opt, gradient_log=K):
        for t in range(3 * K + 2):
            x, y = tiny_batch(t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            on = t > 2 * K and t % K != 0  # each slot has seen both layouts (its steps and keyframes)
            measured += on
            if on:
                sys.setprofile(prof)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
    return calls / measured


def test_staging_a_gradient_log_step_costs_no_python_per_tensor(tmp_path: Path) -> None:
    """Once a layout was seen, staging a step does no Python per tensor: a 14-layer model's step
    makes as many calls into staging as a 2-layer one's."""
    small, deep = _staging_calls(tmp_path, 0), _staging_calls(tmp_path, 12)
    assert deep == small, (small, deep)


def _entries(step: int, case: str) -> list[tuple]:
    """A step's ``(kind, name, tensor, full, param, key)`` entries for the stager, new values each step."""
    if case == "empty":  # nothing staged (every tensor lean)
        return []
    g = torch.Generator().manual_seed(step)
    a, b = torch.randn(4, 6, generator=g), torch.randn(10, generator=g)
    full = True
    if case == "shape" and step == 1:
        a = torch.randn(5, 6, generator=g)
    if case == "dtype" and step == 1:
        b = b.double()
    if case == "full_flip":
        full = step % 2 == 0
    if case == "noncontig":
        a = torch.randn(6, 4, generator=g).t()
    if case == "budget" and step >= 1:
        a = torch.randn(40, 60, generator=g)  # past the slot's budget: goes live
    out = [Entry("grads", "a", a, full), Entry("grads", "b", b, True),
           Entry("state", "/rng/x", torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8), True)]
    if case == "new_tensor" and step >= 1:
        out.append(Entry("grads", "c", torch.randn(3, generator=g), True))
    return out


def _count_restages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry each time a stager reuses a plan (Stager._restage)."""
    from stepdump.capture import staging

    seen: list[int] = []
    real = staging.Stager._restage

    def restage(*args: Any) -> list[staging.Item]:
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(staging.Stager, "_restage", staticmethod(restage))
    return seen


@pytest.mark.parametrize("case", ["same", "shape", "dtype", "full_flip", "noncontig", "budget", "new_tensor", "empty"])
def test_a_staging_plan_stages_what_the_per_tensor_path_stages(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Steps of one layout reuse a plan (one copy call); whatever changes between steps, the items
    are those the per-tensor path gives, holding the step's bytes, never a stale buffer's."""
    from stepdump.capture import staging

    planned, slot = staging.Stager(), staging.Slot(0, budget=4096)
    restaged = _count_restages(monkeypatch)
    for step in [0, 1, 2, 0, 1, 2]:
        entries = _entries(step, case)
        got = planned.stage(slot, entries)
        with monkeypatch.context() as m:
            m.setattr(staging, "_PLANS_KEPT", 0)
            want = staging.Stager().stage(staging.Slot(0, budget=4096), entries)
        assert [(i.kind, i.name, i.full, i.live, i.param, i.key) for i in got] == \
            [(i.kind, i.name, i.full, i.live, i.param, i.key) for i in want], (case, step)
        src = {e[1]: e[2] for e in entries}
        for item in got:
            assert_same(item.tensor, src[item.name], f"{case} step {step} {item.name}")
            if item.raw is not None:
                assert bytes(item.raw) == src[item.name].contiguous().numpy().tobytes(), (case, step, item.name)
    # The plans were used (a budget that sends a tensor live gives it up: its buffer was let go; an
    # empty list needs none: stage() returns at once).
    if case == "empty":
        assert restaged == [], restaged
    else:
        assert len(restaged) >= (0 if case == "budget" else 5 if case == "same" else 1), restaged


def test_a_slot_s_plan_survives_another_layout_adding_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient log's keyframe stages params beside the grads into a slot whose steps' plan copies
    the grads only: the buffers it adds leave that plan's buffers as they were, so the next step
    reuses it (it used to be rebuilt, tensor by tensor, after every keyframe the slot took). A
    buffer replaced (a shape change) still retires every plan of the slot."""
    from stepdump.capture import staging

    stager, slot = staging.Stager(), staging.Slot(0)
    restaged = _count_restages(monkeypatch)
    g = torch.Generator().manual_seed(0)
    grads = [Entry("grads", n, torch.randn(5, generator=g), True) for n in "ab"]
    params = [Entry("params", n, torch.randn(5, generator=g), True) for n in "ab"]
    stager.stage(slot, grads)  # the steps' plan
    stager.stage(slot, grads + params)  # a keyframe: two buffers more
    got = stager.stage(slot, grads)
    assert len(restaged) == 1  # the steps' plan, reused
    assert all(torch.equal(i.tensor, e[2]) for i, e in zip(got, grads, strict=True))
    stager.stage(slot, [Entry("grads", "a", torch.randn(7, generator=g), True), grads[1]])  # "a" reshaped
    stager.stage(slot, grads)
    assert len(restaged) == 1  # its buffer for "a" was replaced: rebuilt, not reused
    got = stager.stage(slot, grads)
    assert len(restaged) == 2 and all(torch.equal(i.tensor, e[2]) for i, e in zip(got, grads, strict=True))


def test_a_held_step_s_large_blob_is_written_before_its_staging_memory_is_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grad of 2 MiB goes to the appender as a view of the staging slot (no copy). A step held
    for a group commit must still have it written before the slot goes back to the training
    thread, which copies the next step's grads into it: a slow disk (each append 30 ms late here)
    shows a write that came after as a later step's bytes under this step's row."""
    monkeypatch.setattr(writer, "COMMIT_WINDOW", 3600.0)  # held until a keyframe or close()
    real = LocalStorage.append

    def slow(self: LocalStorage, key: str, data: Any) -> int:
        time.sleep(0.03)
        return real(self, key, data)

    monkeypatch.setattr(LocalStorage, "append", slow)
    model = _big_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    grads, _ = _record(tmp_path / "run", model, opt, codec="raw")
    with stepdump.open(tmp_path / "run") as run:
        assert stepdump.verify(run).ok  # every blob's bytes against its checksum
        for step in range(STEPS):
            for name, g in grads[step].items():
                assert_same(run.tensor(name, step, "grads"), g, f"grad {name} at step {step}")
