"""Recording torch.distributed jobs: DDP and FSDP2 over gloo on CPU, two real processes.

One 2-rank job (tests/dist_worker.py) runs every scenario once per test session;
each rank also saves clones of what it held live (the side channel), and the
tests compare the recording with them bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import dist_worker
import pytest
import torch
import torch.distributed as dist
from gloo_fork import run_ranks
from helpers import LOOPBACK, assert_same
from torch import nn

import stepdump
from stepdump.analysis.cross_rank import cross_rank
from stepdump.errors import (
    ConfigError,
    CorruptDataError,
    FormatVersionError,
    RunExistsError,
    TensorNotFoundError,
)

WORLD = 2
DESYNC_STEP = 3
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")  # the workers' MLP; DDP prefixes "module."





@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank job of tests/dist_worker.py, its ranks forked from this process (gloo_fork)."""
    out = tmp_path_factory.mktemp("dist")
    run_ranks(lambda rank: dist_worker.main(out), WORLD, out / "logs")
    return out


def side(job: Path, name: str, rank: int) -> dict:
    return torch.load(job / "side" / f"{name}_rank{rank}.pt", weights_only=True)


def assert_matches_side(run, job: Path, name: str, *, full: bool = False) -> int:
    """Every tensor each rank held before every update is in its store, bit for bit."""
    checked = 0
    for r in range(WORLD):
        rank_run = run.rank(r)
        for step, snap in side(job, name, r)["local"].items():
            for kind, tensors in snap.items():
                assert sorted(rank_run.tensors(step, kind)) == sorted(tensors), (r, step, kind)
                for n, t in tensors.items():
                    assert_same(rank_run.tensor(n, step, kind), t, f"rank {r} step {step} {kind} {n}")
                    checked += 1
        if full:
            for step, snap in side(job, name, r)["full"].items():
                for kind, tensors in snap.items():
                    for n, t in tensors.items():
                        assert_same(run.tensor(n, step, kind), t, f"full tensor, step {step} {kind} {n}")
    return checked


# -- DDP -----------------------------------------------------------------------------


def test_layout_is_one_store_per_rank_with_ranks_json(job: Path) -> None:
    root = job / "ddp"
    doc = json.loads((root / "ranks.json").read_text())
    assert doc == {"format": "stepdump-ranks", "format_version": 1, "world_size": 2, "ranks": [0, 1], "backend": "gloo"}
    assert sorted(p.name for p in root.iterdir()) == ["rank00000", "rank00001", "ranks.json"]
    for r in range(WORLD):
        with stepdump.open(root / f"rank{r:05d}") as one:  # each rank's part is an ordinary run
            assert isinstance(one, stepdump.types.Run)
            assert one.meta["distributed"]["rank"] == r and one.meta["distributed"]["world_size"] == 2
            assert one.meta["distributed"]["sharding"] == {}  # DDP: full replicas
            assert one.steps == [0, 1, 2, 3, 4, 5] and one.meta["final_step"] == 5  # each rank closes its part
            assert one.tensors(5, "grads") == {}
    with stepdump.open(root) as run:
        assert isinstance(run, stepdump.types.DistributedRun)
        assert (run.world_size, run.ranks, run.primary) == (2, [0, 1], 0)
        assert run.steps == [0, 1, 2, 3, 4, 5] and run.names("params")[0] == "module.0.weight"
        assert run.meta["final_step"] == 5


def test_ddp_records_what_every_rank_held(job: Path) -> None:
    with stepdump.open(job / "ddp") as run:
        # Per rank: 4 params + 4 grads at step 0, then also 4 x (exp_avg, exp_avg_sq, step) at steps 1..4.
        assert assert_matches_side(run, job, "ddp") == WORLD * (8 + 4 * 20)
        live = side(job, "ddp", 0)["local"][4]["params"]["module.2.weight"]
        assert_same(run.tensor("module.2.weight", 4), live)  # the run's view: rank 0's replica
        assert_same(run.state_dict(4)["module.2.weight"], live)


def test_ddp_stats_cover_every_rank_and_replicas_agree(job: Path) -> None:
    with stepdump.open(job / "ddp") as run:
        df = run.stats()
        assert list(df.columns[:3]) == ["step", "rank", "kind"]
        assert sorted(df["rank"].unique()) == [0, 1]
        per = df.groupby(["step", "kind", "name"])["fingerprint"].nunique()
        assert (per == 1).all()  # DDP: params, grads and Adam state identical on both ranks
        assert len(run.stats(kind="grads", ranks=[1])) == 5 * 4
        # Each rank logged the loss of its own data.
        assert not run.scalars(rank=0)["loss"].equals(run.scalars(rank=1)["loss"])
        assert cross_rank(run) == []
        assert [f for f in stepdump.check(run) if f.rule == "cross_rank"] == []


def test_cross_rank_finds_the_planted_desync(job: Path) -> None:
    with stepdump.open(job / "desync") as run:
        findings = cross_rank(run)
        assert [(f.step, f.kind, f.tensor) for f in findings] == [(DESYNC_STEP, "params", "module.0.weight")]
        f = findings[0]
        assert f.rule == "cross_rank" and f.severity == stepdump.analysis.findings.Severity.ERROR
        assert "rank 0" in f.message and "rank 1" in f.message
        # Recorded bytes agree with the live tensors, the planted change included.
        assert assert_matches_side(run, job, "desync") == WORLD * (8 + 4 * 20)  # as many as the clean run
        ours = [g for g in stepdump.check(run) if g.rule == "cross_rank"]
        assert [(g.step, g.kind, g.tensor) for g in ours] == [(DESYNC_STEP, "params", "module.0.weight")]
    by_name = stepdump.check(str(job / "desync"), rules=["cross_rank"])
    assert [(g.step, g.tensor) for g in by_name] == [(DESYNC_STEP, "module.0.weight")]


def test_verify_and_diff_see_every_rank(job: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ddp"
    shutil.copytree(job / "ddp", copy)
    seg = copy / "rank00001" / "segments" / "000001.seg"
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    with stepdump.open(copy) as run:
        report = stepdump.verify(run)
        assert not report.ok and report.problems[0].where.startswith("rank 1: ")
    # diff of two multi-rank runs compares them rank by rank: rank 1 diverges at the planted
    # edit, rank 0 once that edit has gone through the next allreduce.
    with stepdump.open(job / "ddp") as a, stepdump.open(job / "desync") as b:
        res = stepdump.diff(a, b)
        assert (res.first_step, res.rank) == (DESYNC_STEP, 1)
        assert res.tensors[0].name == "module.0.weight"
        assert res.per_rank[1].first_step == DESYNC_STEP and res.per_rank[0].first_step == DESYNC_STEP + 1


def test_ddp_restore_on_every_rank_continues_bitwise(job: Path) -> None:
    for r in range(WORLD):
        want, got = side(job, "ddp", r)["final"], side(job, "ddp_restored", r)["final"]
        assert sorted(want) == sorted(got) == sorted(f"module.{n}" for n in PARAMS), f"rank {r}: {sorted(got)}"
        for n in want:
            assert_same(got[n], want[n], f"rank {r} {n} after restoring step 2 and redoing 2..4")


def test_only_the_chosen_ranks_record(job: Path) -> None:
    root = job / "only0"
    assert sorted(p.name for p in root.iterdir()) == ["rank00000", "ranks.json"]
    assert side(job, "only0", 0) == {"recording": True, "step": 2, "type": "Recorder"}
    assert side(job, "only0", 1) == {"recording": False, "step": 2, "type": "Recorder"}  # inactive on this rank
    with stepdump.open(root) as run:
        assert run.ranks == [0] and run.world_size == 2 and run.steps == [0, 1, 2] and run.meta["final_step"] == 2
        with pytest.raises(TensorNotFoundError, match="rank 1 was not recorded"):
            run.rank(1)


def test_ddp_published_to_a_url(job: Path) -> None:
    with stepdump.open((job / "remote").as_uri(), cache_dir=job / "cache") as run:
        assert isinstance(run, stepdump.types.DistributedRun) and isinstance(run.rank(1), stepdump.types.RemoteRun)
        assert run.steps == [0, 1, 2, 3] and run.meta["final_step"] == 3
        assert assert_matches_side(run, job, "remote") > 0


# -- FSDP2 -----------------------------------------------------------------------------


def test_fsdp2_records_shards_and_reads_full_tensors(job: Path) -> None:
    with stepdump.open(job / "fsdp") as run:
        assert assert_matches_side(run, job, "fsdp", full=True) > 0
        s0, s1 = run.sharding("2.weight", 0), run.sharding("2.weight", 1)
        # 3 rows over 2 ranks: torch.chunk gives 2 + 1.
        assert (s0["global_shape"], s0["local_shape"], s0["offset"]) == ([3, 16], [2, 16], [0, 0])
        assert (s1["local_shape"], s1["offset"], s1["placements"]) == ([1, 16], [2, 0], ["shard(0)"])
        assert tuple(run.tensor("2.weight", 1, local=True).shape) == (2, 16)
        assert tuple(run.tensor("2.weight", 1, rank=1).shape) == (1, 16)
        full = side(job, "fsdp", 0)["full"][2]
        sd = run.state_dict(2)
        for n, t in full["params"].items():
            assert_same(sd[n], t, f"state_dict {n}")
        osd = run.optimizer_state_dict(2)
        assert_same(osd["state"][2]["exp_avg"], full["optimizer"]["2.weight.exp_avg"])
        assert_same(osd["state"][2]["step"], full["optimizer"]["2.weight.step"])
        assert set(run.tensors(2, "grads")) == set(full["grads"])
        # Shards are not replicas: nothing to compare, nothing reported.
        assert cross_rank(run) == []


def test_fsdp2_restore_loads_each_ranks_shard(job: Path) -> None:
    for r in range(WORLD):
        want, got = side(job, "fsdp", r)["final"], side(job, "fsdp_restored", r)["final"]
        assert sorted(want) == sorted(got) == sorted(PARAMS), f"rank {r}: {sorted(got)}"
        for n in want:
            assert_same(got[n], want[n], f"rank {r} shard of {n} after restoring step 2 and redoing 2..3")


def test_cross_rank_finds_a_desync_between_hsdp_replicas(job: Path) -> None:
    with stepdump.open(job / "hsdp") as run:
        assert run.sharding("0.weight", 1)["placements"] == ["replicate", "shard(0)"]
        findings = cross_rank(run)
        assert [(f.step, f.kind, f.tensor) for f in findings] == [(DESYNC_STEP, "params", "0.weight")]


# -- in this process: argument checks and the layout's rules -------------------------------


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A world_size=1 gloo group in this process, torn down after the test."""
    for k, v in LOOPBACK.items():
        monkeypatch.setenv(k, v)
    store = dist.FileStore(str(tmp_path / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()


def test_ranks_argument_is_checked(tmp_path: Path) -> None:
    model, opt = _model_opt()
    for bad in ("some", [], [-1], [0.5], 3):
        with pytest.raises(ConfigError, match="ranks="):
            stepdump.Recorder(tmp_path / "r", model, opt, ranks=bad)
    # Without a process group, ranks= has nothing to choose from: a plain single-process run.
    with stepdump.Recorder(tmp_path / "plain", model, opt, ranks=[1]) as rec:
        _one_step(model, opt)
    assert rec.recording and (tmp_path / "plain" / "catalog.sqlite").exists()


def test_layout_rules_in_a_one_rank_group(tmp_path: Path, one_rank_group: None) -> None:
    model, opt = _model_opt()
    with pytest.raises(ConfigError, match="world_size=1"):
        stepdump.Recorder(tmp_path / "a", model, opt, ranks=[1])
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        _one_step(model, opt)
    assert rec.path == tmp_path / "run" / "rank00000"
    # ranks=None ignores the process group: the path itself is the store.
    with stepdump.Recorder(tmp_path / "single", model, opt, ranks=None):
        _one_step(model, opt)
    with stepdump.open(tmp_path / "single") as single:
        assert isinstance(single, stepdump.types.Run)
    with pytest.raises(RunExistsError, match="single-process run"):
        stepdump.Recorder(tmp_path / "single", model, opt)
    # Another job's ranks.json is never mixed with this one.
    other = tmp_path / "other"
    other.mkdir()
    (other / "ranks.json").write_text(json.dumps(
        {"format": "stepdump-ranks", "format_version": 1, "world_size": 8, "ranks": [0, 1], "backend": "nccl"}))
    with pytest.raises(ConfigError, match="world_size=8"):
        stepdump.Recorder(other, model, opt)
    # Resuming this rank's part continues its steps: at its final record 1, which it replaces.
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1] and run.meta["final_step"] == 1
    with stepdump.Recorder(tmp_path / "run", model, opt, resume=True) as rec:
        assert rec.step == 1
        _one_step(model, opt)
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2] and run.ranks == [0] and run.meta["final_step"] == 2


def test_bad_ranks_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ranks.json").write_text("{not json")
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        stepdump.open(tmp_path)
    (tmp_path / "ranks.json").write_text(json.dumps(
        {"format": "stepdump-ranks", "format_version": 99, "world_size": 2, "ranks": [0]}))
    with pytest.raises(FormatVersionError, match="version 99"):
        stepdump.open(tmp_path)
    (tmp_path / "ranks.json").write_text(json.dumps(
        {"format": "stepdump-ranks", "format_version": 1, "world_size": 2, "ranks": [0, 5]}))
    with pytest.raises(CorruptDataError, match="invalid world_size or ranks"):
        stepdump.open(tmp_path)
