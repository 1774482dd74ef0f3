"""What a gradient-log read costs, counted, not timed (issue 25 item 3; docs/gradient-log.md "Cost").

- Reading steps in order (any reader entry point: tensors, state_dict, optimizer_state_dict,
  restore) continues from the cached rebuild: one optimizer application per step, not one per
  step since the keyframe (K²/2 over a segment); every step bitwise the training's. Counted by
  torch's global optimizer step hook, not by the engine's own counter. One row per optimizer
  kernel the run recorded (``foreach`` on/off, ``fused``): the rebuild runs the recorded one.
- The cached rebuild is one per run and is dropped when the run closes.
- Catalog work per re-applied update is constant and small (rows, states, skip flags and blob
  rows are read per window of steps, and the RNG tensors of a step's state are not read at all):
  counted as catalog queries per extra update.
- Every grad, the first update's included, is read on the worker thread (the first while the
  keyframe is read on the reading thread); reading in order, half of each update's grads are
  (nothing is read ahead across read calls), and a damaged one is reported as without the worker.
- The check at the step read hashes the params and the kind read, not the optimizer state for a
  ``state_dict()``; a later optimizer read of that step hashes the state then, once.

Timings: benchmarks/gradlog_read.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, record_run, snapshot, tiny_model
from torch.optim.optimizer import register_optimizer_step_post_hook

import stepdump
from stepdump.read.blobs import BlobReader
from stepdump.store.catalog_read import ReadConnection

K = 4
STEPS = 11  # keyframes 0, 4, 8: steps 0..10 read in order re-apply 11 - 3 = 8 updates

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-no-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "sgd-momentum-no-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
}


def _restore(run: Any, s: int) -> dict[str, torch.Tensor]:
    model = tiny_model(seed=5)
    run.restore(s, model, None, rng=False)
    return {n: p.detach() for n, p in model.named_parameters()}


READS: dict[str, Callable[[Any, int], dict[str, torch.Tensor]]] = {
    "tensors": lambda run, s: run.tensors(s, "params"),
    "tensor": lambda run, s: {n: run.tensor(n, s, "params") for n in run.names("params")},
    "state_dict": lambda run, s: dict(run.state_dict(s)),
    "restore": _restore,
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Any]]]:
    base = tmp_path_factory.mktemp("readcost")
    out = {}
    for name, make in OPTIMIZERS.items():
        model = tiny_model()
        opt = make(model.parameters())
        snaps: list[Any] = []
        path = record_run(base / name, steps=STEPS, model=model, opt=opt, gradient_log=K,
                          before_step=lambda t, m, o: snaps.append(snapshot(m, o)))
        out[name] = (path, snaps)
    return out


class _Applications:
    """Optimizer steps run anywhere in the process (torch's global post hook)."""

    def __init__(self) -> None:
        self.n = 0
        self._h = register_optimizer_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.n += 1

    def remove(self) -> None:
        self._h.remove()


@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_reading_every_step_in_order_applies_one_update_per_step_bitwise(
        logs: dict[str, Any], opt: str, read: str) -> None:
    path, snaps = logs[opt]
    with stepdump.open(path) as run:
        keyframes = run._gradlog.keyframes()
        assert keyframes == [0, 4, 8, STEPS]  # + the final record
        applied = _Applications()
        try:
            for s in range(STEPS):
                got = READS[read](run, s)
                assert sorted(got) == sorted(snaps[s]["params"]), (s, sorted(got))
                for n, want in snaps[s]["params"].items():
                    assert_same(got[n], want, f"{opt} {read} step {s} {n}")
                if opt != "adam" or read != "tensors":
                    continue
                for n, want in snaps[s]["optimizer"].items():  # the optimizer state too, once per kernel
                    assert_same(run.tensor(n, s, "optimizer"), want, f"{opt} step {s} optimizer {n}")
        finally:
            applied.remove()
        assert applied.n == STEPS - 3, applied.n  # was sum of (s - keyframe) over the steps: 12 here


def test_reading_backwards_restarts_from_the_keyframe_and_stays_bitwise(logs: dict[str, Any]) -> None:
    path, snaps = logs["adam"]
    with stepdump.open(path) as run:
        applied = _Applications()
        try:
            for s in (7, 6, 5):
                for n, want in snaps[s]["params"].items():
                    assert_same(run.tensor(n, s, "params"), want, f"step {s} {n}")
        finally:
            applied.remove()
        assert applied.n == 3 + 2 + 1  # nothing to continue from: the state before is not kept


def test_the_cached_rebuild_is_dropped_when_the_run_closes(logs: dict[str, Any]) -> None:
    path, snaps = logs["adam"]
    run = stepdump.open(path)
    engine = run._gradlog
    run.tensors(6, "params")
    assert engine._chain is not None and engine._snapshot is not None  # one cached state, held while open
    run.close()
    assert engine._chain is None and engine._snapshot is None


def _queries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    execute = ReadConnection.execute

    def counted(self: ReadConnection, sql: str, *a: Any, **kw: Any) -> Any:
        seen.append(sql)
        return execute(self, sql, *a, **kw)

    monkeypatch.setattr(ReadConnection, "execute", counted)
    return seen


@pytest.fixture(scope="module")
def long_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(tmp_path_factory.mktemp("long") / "run", steps=41, gradient_log=40)


def test_catalog_queries_per_re_applied_update_are_few(long_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _queries(monkeypatch)
    counts = {}
    for at in (8, 39):
        with stepdump.open(long_log) as run:
            run.names("params")
            seen.clear()
            run.tensors(at, "params")
            counts[at] = len(seen)
    per_update = (counts[39] - counts[8]) / (39 - 8)
    assert per_update <= 0.5, (counts, per_update)  # was 16 (4 params: a blob row per grad, the RNG state's tensors...)


def test_every_grad_is_read_on_the_worker_the_first_update_beside_the_keyframe(
        logs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    path, snaps = logs["adam"]
    ahead, into = BlobReader.read_ahead, BlobReader.read_into
    seen = {"ahead": 0, "grads on the reading thread": 0}

    def read_ahead(self: BlobReader, *a: Any) -> bool:
        ok = ahead(self, *a)
        seen["ahead"] += ok
        return ok

    def read_into(self: BlobReader, out: torch.Tensor, blob: int, *a: Any, **kw: Any) -> torch.Tensor:
        if blob in grad_blobs:
            seen["grads on the reading thread"] += 1
        return into(self, out, blob, *a, **kw)

    monkeypatch.setattr(BlobReader, "read_ahead", read_ahead)
    monkeypatch.setattr(BlobReader, "read_into", read_into)
    with stepdump.open(path) as run:
        grad_blobs = {row[6] for row in run.catalog.fingerprint_block(0, K) if row[1] == "grads"}
        n = len(run.names("params"))
        got = run.tensors(K - 1, "params")
        for name, want in snaps[K - 1]["params"].items():
            assert_same(got[name], want, name)
    assert seen["grads on the reading thread"] == 0, seen  # was n: update 0's, read before the worker started
    assert seen["ahead"] >= (K - 1) * n, seen


@pytest.mark.parametrize("name", ["0.weight", "2.bias"])  # a grad read by the worker or by the reading thread
def test_a_damaged_grad_met_reading_in_order_raises_the_error_of_a_read_without_the_worker(
        logs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Reading in order, each read's update has nothing read ahead: its grads are split between
    the worker and the reading thread. A damaged one is reported as without the worker."""
    import shutil

    from helpers import catalog_sql

    src, snaps = logs["adam"]
    path = tmp_path / "damaged"
    shutil.copytree(src, path)
    ((key, offset, length),) = catalog_sql(
        path, "SELECT s.key, b.offset, b.length FROM tensors t JOIN blobs b ON b.id = t.blob "
              "JOIN segments s ON s.id = b.segment WHERE t.step = 5 AND t.series = "
              "(SELECT id FROM series WHERE kind = 'grads' AND name = ?)", (name,))
    with open(path / key, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))

    def error_reading_in_order() -> str:
        with stepdump.open(path) as run:
            for s in (4, 5):
                for n, want in snaps[s]["params"].items():
                    assert_same(run.tensors(s, "params")[n], want, f"step {s} {n}")
            with pytest.raises(stepdump.StepdumpError) as e:
                run.tensors(6, "params")  # update 5: the damaged grad
            return f"{type(e.value).__name__}: {e.value}"

    with_worker = error_reading_in_order()
    assert "checksum" in with_worker, with_worker
    monkeypatch.setattr(BlobReader, "read_ahead", lambda *a: False)  # the reading thread alone
    assert error_reading_in_order() == with_worker


def test_a_params_read_hashes_the_params_and_a_later_optimizer_read_of_that_step_hashes_its_state_once(
        logs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """state_dict() at a rebuilt step checks the params only (the optimizer state is not handed
    out); reading the optimizer state of that same step afterwards checks it there, without
    re-applying anything or hashing the params again; both bitwise. Counted in elements hashed."""
    from stepdump.read import gradlog_check, rows

    path, snaps = logs["adam"]
    hashed = [0]
    for module in (gradlog_check, rows):
        real = module.fingerprint

        def counted(t: torch.Tensor, real: Any = real) -> int:
            hashed[0] += t.numel()
            return int(real(t))

        monkeypatch.setattr(module, "fingerprint", counted)
    n_params = sum(t.numel() for t in snaps[6]["params"].values())
    n_state = sum(t.numel() for t in snaps[6]["optimizer"].values())  # exp_avg, exp_avg_sq, step
    with stepdump.open(path) as run:
        applied = _Applications()
        try:
            sd = run.state_dict(6)
            for n, want in snaps[6]["params"].items():
                assert_same(sd[n], want, n)
            # The keyframe's tensors were checked as they were read; at step 6 the params alone.
            assert hashed[0] == n_params, (hashed, n_params, n_state)  # was n_params + n_state
            hashed[0] = 0
            got = run.tensors(6, "optimizer")
            assert sorted(got) == sorted(snaps[6]["optimizer"])
            for n, want in snaps[6]["optimizer"].items():
                assert_same(got[n], want, n)
            assert hashed[0] == n_state, (hashed, n_state)
        finally:
            applied.remove()
        assert applied.n == 2  # updates 4 and 5, once
