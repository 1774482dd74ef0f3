"""Every reader kind answers the one reader interface (``RunReader``) with the recorded values.

Three runs of the same kind of training: a local directory (``Run``), a ``memory://`` URL
(``RemoteRun``), and a 2-rank DDP job over gloo (``DistributedRun``, two real processes:
this file run as a script is one rank). Each iteration's live tensors are kept (the
"truth"), and every method of the interface is checked against them, bit for bit. The
multi-rank run is also checked with ``check``, ``verify``, ``diff``, ``info``, the report
and export, covering every rank.

Usage as a worker: ``python test_reader_interface.py OUT`` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_same,
    record_run,
    snapshot,
    tiny_batch,
    tiny_model,
    training_scalars,
)
from torch import nn

import stepdump

STEPS = 4  # optimizer steps, each recorded in full
WORLD = 2
DESYNC = 2  # the step at which rank 1 of run "b" edits its replica after the allreduce
KINDS = ("params", "grads", "optimizer")


# -- the 2-rank worker ------------------------------------------------------------------


class Wrapped(nn.Module):
    """Holds a model as ``module`` (as DDP does), so a plain process can restore a DDP rank."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _train_rank(path: Path, rank: int, desync: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    truth: dict[str, Any] = {"snaps": {}, "loss": {}, "rng": {}}
    with stepdump.Recorder(path, model, opt) as rec:
        for t in range(STEPS):
            truth["rng"][t] = torch.get_rng_state()
            x, y = tiny_batch(10 * t + rank)  # each rank its own data; DDP averages the grads
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if desync and rank == 1 and t == DESYNC:
                with torch.no_grad():
                    model.module[0].weight.add_(1e-3)
            truth["snaps"][t] = snapshot(model, opt)
            truth["loss"][t] = float(loss.detach())
            opt.step()
            rec.log(loss=loss)
    return truth


def _worker(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, desync in (("a", False), ("b", True)):
        torch.save(_train_rank(out / name, rank, desync), out / f"{name}_truth_rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


# -- fixtures -----------------------------------------------------------------------------


def _record_single(path: Any) -> dict[str, Any]:
    truth: dict[str, Any] = {"snaps": {}, "loss": {}, "rng": {}}

    def batch(t: int) -> Any:
        truth["rng"][t] = torch.get_rng_state()
        return tiny_batch(t)

    def keep(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        truth["snaps"][t] = snapshot(model, opt)

    def log(t: int, loss: torch.Tensor) -> dict[str, Any]:
        truth["loss"][t] = float(loss.detach())
        return {"loss": loss}

    model = tiny_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    record_run(path, steps=STEPS, model=model, opt=opt, scheduler=sched, batch=batch, before_step=keep, log=log,
               **({"remote": stepdump.options.Remote(upload_every=1)} if isinstance(path, str) else {}))
    return truth


def _multirank(out: Path) -> None:
    """The 2-rank job (``_worker`` in each rank), its ranks forked from this process (tests/gloo_fork.py)."""
    from gloo_fork import run_ranks

    run_ranks(lambda rank: _worker(out), WORLD, out.with_name(out.name + "-logs"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, dict[int | None, dict[str, Any]]]]:
    """kind -> (a function opening the run, truth by rank: None for a single store)."""
    root = tmp_path_factory.mktemp("readers")
    local_truth = _record_single(root / "local")
    url = f"memory://stepdump-tests/{uuid.uuid4().hex}"
    remote_truth = _record_single(url)
    _multirank(root / "ranks")
    ranks_truth = {r: torch.load(root / "ranks" / f"a_truth_rank{r}.pt", weights_only=False) for r in range(WORLD)}
    return {
        "local": (lambda: stepdump.open(root / "local"), {None: local_truth}),
        "remote": (lambda: stepdump.open(url, cache_dir=root / "cache"), {None: remote_truth}),
        "ranks": (lambda: stepdump.open(root / "ranks" / "a"), ranks_truth),
        "_root": (root, {}),
    }


KIND_NAMES = ("local", "remote", "ranks")


def _primary(truth: dict[int | None, Any]) -> Any:
    """The truth of the store a reader answers for: the single one, or the lowest rank's."""
    return truth[None] if None in truth else truth[min(truth)]  # type: ignore[type-var]


@pytest.fixture(params=KIND_NAMES)
def reader(request: pytest.FixtureRequest, runs: dict) -> Any:
    opener, truth = runs[request.param]
    with opener() as run:
        yield request.param, run, truth


# -- every method on every kind --------------------------------------------------------------


def test_kind_and_identity(reader: Any) -> None:
    from stepdump.read.reader import RunReader
    from stepdump.store.format import FIRST_FORMAT_VERSION

    kind, run, truth = reader
    assert isinstance(run, RunReader)
    want = {"local": stepdump.types.Run, "remote": stepdump.types.RemoteRun, "ranks": stepdump.types.DistributedRun}[kind]
    assert type(run) is want
    assert run.format_version == FIRST_FORMAT_VERSION == run.meta["format_version"]  # xxh3 only: format 1
    assert run.meta["optimizer_class"] == "Adam"
    assert run.live is False
    stores = list(run.stores())
    assert [r for r, _ in stores] == list(truth)
    assert all(isinstance(s, stepdump.types.Run) for _, s in stores)
    if kind != "ranks":
        assert stores[0][1] is run


def test_steps_kinds_names(reader: Any) -> None:
    kind, run, truth = reader
    # STEPS updates, then the final record STEPS that close() writes (every store has its own)
    assert run.all_steps == run.stats_steps == run.steps == list(range(STEPS + 1))
    assert run.meta["final_step"] == STEPS
    assert all(store.meta["final_step"] == STEPS for _, store in run.stores())
    assert run.tensors(STEPS, "grads") == {}
    assert run.skipped_steps == []
    assert set(KINDS) <= set(run.kinds())
    for rank, store in run.stores():
        snap = truth[rank]["snaps"][STEPS - 1]  # Adam's state exists from the first update on
        for k in KINDS:
            assert store.names(k) == list(snap[k]), (rank, k)
    first = _primary(truth)["snaps"][0]
    assert run.names("params") == list(first["params"])


def test_tensors_and_fingerprints_bitwise(reader: Any) -> None:
    from stepdump.core.hashing import fingerprint

    kind, run, truth = reader
    primary = _primary(truth)
    for step in range(STEPS):
        for k in KINDS:
            want = primary["snaps"][step][k]
            got = run.tensors(step, k)
            assert sorted(got) == sorted(want), (step, k)
            for name, t in want.items():
                assert_same(got[name], t, f"{kind} step {step} {k} {name}")
                assert_same(run.tensor(name, step, k), t, f"{kind} tensor() step {step} {k} {name}")
        fps = run.fingerprints(step, KINDS)
        assert fps == {(k, n): fingerprint(t) for k in KINDS for n, t in primary["snaps"][step][k].items()}
    for rank, store in run.stores():  # each store holds its own rank's tensors
        for step, snap in truth[rank]["snaps"].items():
            for k in KINDS:
                for name, t in snap[k].items():
                    assert_same(store.tensor(name, step, k), t, f"rank {rank} step {step} {k} {name}")


def test_state_dicts_and_side_state(reader: Any) -> None:
    kind, run, truth = reader
    primary = _primary(truth)
    for step in range(STEPS):
        snap = primary["snaps"][step]
        sd = run.state_dict(step)
        assert list(sd) == list(snap["params"])  # no buffers in the MLP
        for key, t in snap["params"].items():
            assert_same(sd[key], t, f"state_dict {key} @ {step}")
        osd = run.optimizer_state_dict(step)
        names = list(snap["params"])
        assert osd["param_groups"][0]["params"] == list(range(len(names)))
        assert osd["param_groups"][0]["lr"] == pytest.approx(1e-2)
        for i, name in enumerate(names):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if f"{name}.{key}" in snap["optimizer"]:
                    assert_same(osd["state"][i][key], snap["optimizer"][f"{name}.{key}"], f"{name}.{key}")
        assert (len(osd["state"]) == 0) == (step == 0)  # Adam creates its state at the first update
        state = run.step_state(step)
        assert [g["params"] for g in state["groups"]] == [names]
        assert torch.equal(run.rng_state(step)["torch"], primary["rng"][step])
        sched = run.scheduler_state_dict(step)
        if kind == "ranks":
            assert sched is None
        else:
            assert sched["step_size"] == 5 and sched["last_epoch"] == step
        assert run.scaler_state_dict(step) is None


def test_frames(reader: Any) -> None:
    from stepdump.core.hashing import fingerprint

    kind, run, truth = reader
    primary = _primary(truth)
    assert list(run.scalars().index) == list(range(STEPS + 1))  # a row for the final record too
    sc = training_scalars(run)  # ... with nothing in it
    assert list(sc.index) == list(range(STEPS))
    assert [sc.loc[t, "loss"] for t in range(STEPS)] == [primary["loss"][t] for t in range(STEPS)]
    assert not sc["skipped"].any()
    rows = [r for r in run.scalar_rows() if r[1] == "loss"]
    assert rows == [(t, "loss", primary["loss"][t]) for t in range(STEPS)]
    assert run.scalar_rows(nan_only=True) == []
    prof = run.profile()
    assert list(prof.index) == list(range(STEPS + 1))
    assert prof.loc[STEPS].drop("skipped").isna().all()  # the final record: no iteration ran
    assert all(c.startswith("sys/") or c == "skipped" for c in prof.columns)
    final = run.stats(steps=STEPS)  # the final record: params and optimizer state, stored
    assert set(final["kind"]) == {"params", "optimizer"} and final["stored"].all()
    st = run.stats(steps=range(STEPS))
    for rank, store in run.stores():
        mine = st if rank is None else st[st["rank"] == rank]
        assert len(mine) == sum(len(s[k]) for s in truth[rank]["snaps"].values() for k in KINDS)
        for r in mine.itertuples(index=False):
            live = truth[rank]["snaps"][r.step][r.kind][r.name]
            assert r.fingerprint == fingerprint(live) and r.stored
            assert r.numel == live.numel()
    if kind == "ranks":
        assert sorted(set(st["rank"])) == [0, 1]
    name = list(_primary(truth)["snaps"][0]["grads"])[0]
    one = run.stats(kind="grads", name=name, steps=range(2))
    if kind == "ranks":
        assert sorted(zip(one["rank"], one["step"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    else:
        assert list(one["step"]) == [0, 1] and set(one["name"]) == {name}


def test_blob_bytes_over_every_store(reader: Any) -> None:
    kind, run, truth = reader
    stored, raw = run.blob_bytes()
    per = [s.blob_bytes() for _, s in run.stores()]
    assert (stored, raw) == (sum(s for s, _ in per), sum(r for _, r in per))
    tensor_bytes = sum(t.numel() * t.element_size() for rank in truth for s in truth[rank]["snaps"].values()
                       for k in KINDS for t in s[k].values())
    assert raw >= tensor_bytes > 0 and stored > 0


def test_restore_and_export(reader: Any, tmp_path: Path) -> None:
    kind, run, truth = reader
    step = 2
    for rank, _ in run.stores():
        model = tiny_model(99)
        target = Wrapped(model) if rank is not None else model
        opt = torch.optim.Adam(target.parameters(), lr=1e-2)
        if rank is None:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            run.restore(step, target, opt, sched)
            assert sched.last_epoch == step
        else:
            run.restore(step, target, opt, rank=rank)
        for name, p in target.named_parameters():
            assert_same(p.detach(), truth[rank]["snaps"][step]["params"][name], f"restored rank {rank} {name}")
        assert torch.equal(torch.get_rng_state(), truth[rank]["rng"][step])
    out = run.export(step, tmp_path / "ckpt.pt")
    ckpt = torch.load(out, weights_only=True)
    primary = _primary(truth)
    assert ckpt["step"] == step and list(ckpt["model"]) == list(primary["snaps"][step]["params"])
    for name, t in primary["snaps"][step]["params"].items():
        assert_same(ckpt["model"][name], t, f"exported {name}")


# -- analyses over every rank of a multi-rank run ---------------------------------------------


def test_check_runs_every_rule_on_every_rank(runs: dict) -> None:
    root = runs["_root"][0]
    seen: list[int] = []

    def note_rank(run: Any) -> list[Any]:
        seen.append(run.meta["distributed"]["rank"])
        return []

    note_rank.name = "note_rank"  # type: ignore[attr-defined]
    with stepdump.open(root / "ranks" / "a") as run:
        assert stepdump.check(run, rules=[note_rank]) == []
    assert seen == [0, 1]
    with stepdump.open(root / "ranks" / "b") as run:
        found = [(f.rule, f.step, f.tensor) for f in stepdump.check(run)]
    assert ("cross_rank", DESYNC, "module.0.weight") in found


def test_verify_names_the_damaged_rank(runs: dict, tmp_path: Path) -> None:
    root = runs["_root"][0]
    with stepdump.open(root / "ranks" / "a") as run:
        whole = stepdump.verify(run)
        alone = [stepdump.verify(run.rank(r)) for r in range(WORLD)]
    assert whole.ok and whole.blobs_checked == sum(a.blobs_checked for a in alone) > alone[0].blobs_checked
    copy = tmp_path / "a"
    shutil.copytree(root / "ranks" / "a", copy)
    seg = next((copy / "rank00001" / "segments").glob("*.seg"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with stepdump.open(copy) as run:
        report = stepdump.verify(run)
    assert not report.ok and all(p.where.startswith("rank 1: ") for p in report.problems)


def test_diff_compares_rank_by_rank(runs: dict) -> None:
    root = runs["_root"][0]
    with stepdump.open(root / "ranks" / "a") as a, stepdump.open(root / "ranks" / "b") as b:
        same = stepdump.diff(a, a)
        assert same.identical and sorted(same.per_rank) == [0, 1] and same.rank is None
        res = stepdump.diff(a, b)
        assert (res.first_step, res.rank) == (DESYNC, 1)
        assert [(t.kind, t.name) for t in res.tensors][:1] == [("params", "module.0.weight")]
        assert res.per_rank[0].first_step == DESYNC + 1  # rank 0 once the edit went through the allreduce
        assert "rank 1" in res.summary()
        with stepdump.open(root / "local") as single, pytest.raises(stepdump.ConfigError, match="rank by rank"):
            stepdump.diff(a, single)


def test_info_report_and_tensorboard_cover_every_rank(runs: dict, cli: Any, tmp_path: Path) -> None:
    from stepdump.analysis.report import build_report_data

    root = runs["_root"][0]
    out = cli("info", root / "ranks" / "a").stdout
    assert "ranks recorded" in out and "rank 0" in out and "rank 1" in out and "tensor data" in out
    with stepdump.open(root / "ranks" / "a") as run:
        data = build_report_data(run)
        names = data["grad_norms"]["names"]
        assert names == [f"rank{r}/{n}" for r in range(WORLD) for n in run.rank(r).names("grads")]
        assert data["summary"]["ranks"] == [0, 1]
        assert {s["name"] for s in data["scalars"]} >= {"rank0/loss", "rank1/loss"}
    cli("report", root / "ranks" / "b", "-o", tmp_path / "r.html")
    assert "cross_rank" in (tmp_path / "r.html").read_text()


def test_replay_leaves_the_run_as_recorded(tmp_path: Path) -> None:
    """replay() rebuilds a step into live objects and hands it back; the run still reads as recorded."""
    def train_step(model: nn.Module, opt: torch.optim.Optimizer, b: Any) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(b[0]), b[1]).backward()
        opt.step()

    model = tiny_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "kf", model, opt, keyframe_every=3) as rec:
        for t in range(5):
            rec.log_batch(tiny_batch(t))
            train_step(model, opt, tiny_batch(t))
    with stepdump.open(tmp_path / "kf") as run:
        assert run.steps == [0, 3, 5] and run.stats_steps == list(range(6))  # 5: the final record
        before = run.tensor("0.weight", 3)
        with pytest.raises(stepdump.StepNotFoundError, match="only stats"):
            run.tensor("0.weight", 2)
        fresh = tiny_model(7)
        res = stepdump.replay(run, 2, fresh, torch.optim.Adam(fresh.parameters(), lr=1e-2), train_step)
        assert res.tensor("0.weight").shape == before.shape
        with pytest.raises(stepdump.StepNotFoundError, match="only stats"):
            run.tensor("0.weight", 2)  # still not stored: replay did not write into the run
        assert_same(run.tensor("0.weight", 3), before, "a stored tensor after replay")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(Path(sys.argv[1]))
