"""What a run records equals, bit for bit, what the training loop had (issue 2 a, b, d).

Each test takes its own clones inside the loop right before ``optimizer.step()``
and compares them with what the run gives back.
"""

from __future__ import annotations

import sqlite3
import time

import pytest
import torch
from helpers import (
    MLP,
    assert_final_record,
    assert_run_matches,
    assert_same,
    classification_batch,
    regression_batch,
    snapshot,
    train_recorded,
)
from torch import nn

import stepdump


def test_linear_adam_every_step_matches_live_clones(tmp_path):
    """(a) Linear(10,1) + Adam + MSE, 100 steps, every tensor of every step."""
    model = nn.Linear(10, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(100):
            x, y = regression_batch(t)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    run = stepdump.open(tmp_path / "run")
    # records 0..99, then close()'s final record 100: the params after the last update
    assert run.steps == list(range(101))
    assert run.all_steps == list(range(101))
    assert_final_record(run, model, opt, step=100)
    assert run.skipped_steps == []
    assert run.names("params") == ["weight", "bias"]
    assert run.names("grads") == ["weight", "bias"]
    assert sorted(run.names("optimizer")) == sorted(
        f"{p}.{k}" for p in ("weight", "bias") for k in ("step", "exp_avg", "exp_avg_sq")
    )
    # Adam creates its state lazily in step 0: record 0 has none, record 1 has all of it.
    assert run.tensors(0, "optimizer") == {}
    assert len(snaps[1]["optimizer"]) == 6
    for t, snap in enumerate(snaps):
        assert_run_matches(run, t, snap)
    # Adam's step counter is state before update t: it counts t updates.
    assert run.tensor("weight.step", 10, kind="optimizer").item() == 10.0
    # The params of record t+1 are what update t produced.
    assert not torch.equal(run.tensor("weight", 50), run.tensor("weight", 51))
    run.close()


def test_mlp_sgd_crossentropy_matches_live_clones(tmp_path):
    """(b) MLP 784-128-10, SGD with momentum, CrossEntropy, synthetic data."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(30):
            x, y = classification_batch(t, n=8)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss.item())
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == list(range(31))
        assert_final_record(run, model, opt, step=30)
        assert run.names("params") == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for t, snap in enumerate(snaps):
            assert_run_matches(run, t, snap)
        assert run.names("optimizer") == [f"{n}.momentum_buffer" for n in run.names("params")]
        losses = run.scalars()["loss"]
        assert list(losses.dropna().index) == list(range(30))  # none at the final record


def test_gradient_accumulation_one_record_per_optimizer_step(tmp_path):
    """(d) 4 micro-batches per optimizer step: one record per step, with the summed grads."""
    model = MLP(8, 16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snaps, first_micro = [], []
    n_steps, micro = 6, 4
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(n_steps):
            opt.zero_grad()
            for m in range(micro):
                x, y = regression_batch(t * micro + m, n=4, d_in=8, d_out=4)
                loss = nn.functional.mse_loss(model(x), y) / micro
                loss.backward()
                if m == 0:
                    first_micro.append(model.fc1.weight.grad.clone())
                rec.log(loss=loss.item())
            snaps.append(snapshot(model, opt))
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == list(range(n_steps + 1))
        assert run.steps == list(range(n_steps + 1))
        assert_final_record(run, model, opt, step=n_steps)
        for t in range(n_steps):
            assert_run_matches(run, t, snaps[t])
            # the accumulated grad, not the one after the first micro-batch
            assert not torch.equal(run.tensor("fc1.weight", t, kind="grads"), first_micro[t])
        assert list(run.scalars()["loss"].dropna().index) == list(range(n_steps))


@pytest.mark.parametrize("codec", ["zstd", "blosc-zstd", "delta-lz4", "delta-zstd"])
def test_codecs_round_trip_bitwise(tmp_path, codec):
    """Compressed codecs give back the exact bytes, for every dtype width and odd shapes."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w32 = nn.Parameter(torch.randn(7, 5))
            self.w64 = nn.Parameter(torch.randn(13, dtype=torch.float64))
            self.wbf = nn.Parameter(torch.randn(3, 4, 2).to(torch.bfloat16))
            self.w16 = nn.Parameter(torch.randn(9).to(torch.float16))
            self.scalar = nn.Parameter(torch.tensor(0.5))
            self.empty = nn.Parameter(torch.empty(0, 3))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))
            self.register_buffer("mask", torch.rand(11) > 0.5)
            self.register_buffer("bytes", torch.randint(0, 255, (6,), dtype=torch.uint8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return (
                (self.w32 * x).sum() + self.w64.sum().float() + self.wbf.float().pow(2).sum()
                + self.w16.float().sum() * self.scalar + self.empty.sum()
            )

    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    snaps, buffers = [], []
    with stepdump.Recorder(tmp_path / "run", model, opt, codec=codec, delta_chain=3) as rec:
        for t in range(5):
            buffers.append({n: b.clone() for n, b in model.named_buffers()})
            loss = model(torch.randn(7, 5))
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(tmp_path / "run") as run:
        for t in range(5):
            assert_run_matches(run, t, snaps[t])
            sd = run.state_dict(t)
            for n, b in buffers[t].items():
                assert_same(sd[n], b, f"step {t} buffer {n}")
        assert run.rng_state(0)["torch"].dtype == torch.uint8
    con = sqlite3.connect(tmp_path / "run" / "catalog.sqlite")
    codecs = {c for (c,) in con.execute("SELECT DISTINCT codec FROM blobs")}
    con.close()
    # a delta codec writes its keyframes with the plain codec of the same compressor
    assert codecs == ({codec, f"blosc-{codec[6:]}-bit"} if codec.startswith("delta-") else {codec})


def test_optimizer_param_outside_model_is_named_by_group(tmp_path):
    model = nn.Linear(3, 2)
    extra = nn.Parameter(torch.randn(4))
    other = nn.Parameter(torch.randn(2, 2))
    opt = torch.optim.Adam(
        [{"params": [*model.parameters(), extra]}, {"params": [other], "lr": 1e-3}], lr=1e-2
    )
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(4):
            x, y = regression_batch(t, d_in=3, d_out=2)
            loss = nn.functional.mse_loss(model(x), y) + extra.pow(2).sum() + other.abs().sum()
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(tmp_path / "run") as run:
        assert run.names("params") == ["weight", "bias", "group0.param2", "group1.param0"]
        assert "group0.param2.exp_avg" in run.names("optimizer")
        for t in range(4):
            assert_run_matches(run, t, snaps[t])
        # the model's state_dict holds only the model's own tensors
        assert list(run.state_dict(2)) == ["weight", "bias"]
        # and the optimizer state loads into an optimizer built the same way
        fresh_extra, fresh_other = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, 2))
        fresh = nn.Linear(3, 2)
        opt2 = torch.optim.Adam(
            [{"params": [*fresh.parameters(), fresh_extra]}, {"params": [fresh_other], "lr": 1e-3}], lr=1e-2
        )
        opt2.load_state_dict(run.optimizer_state_dict(3))
        assert_same(opt2.state[fresh_extra]["exp_avg"], snaps[3]["optimizer"]["group0.param2.exp_avg"])
        assert_same(opt2.state[fresh_other]["exp_avg_sq"], snaps[3]["optimizer"]["group1.param0.exp_avg_sq"])
        assert [g["lr"] for g in opt2.param_groups] == [1e-2, 1e-3]


def test_params_without_grad_are_recorded_without_grads(tmp_path):
    """A frozen param (in the optimizer) and a layer used only on even steps."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(4, 1)
            self.aux = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
            h = self.frozen(x)
            out = self.head(h)
            return out + self.aux(h) if use_aux else out

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(6):
            x, y = regression_batch(t, d_in=4)
            loss = nn.functional.mse_loss(model(x, use_aux=t % 2 == 0), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(tmp_path / "run") as run:
        assert run.names("params") == [n for n, _ in model.named_parameters()]
        assert "frozen.weight" not in run.names("grads")
        assert "aux.weight" in run.names("grads")
        for t in range(6):
            assert_run_matches(run, t, snaps[t])
        assert "aux.weight" not in run.tensors(1, "grads")
        with pytest.raises(stepdump.StepNotFoundError, match="no value at step 1"):
            run.tensor("aux.weight", 1, kind="grads")
        with pytest.raises(stepdump.TensorNotFoundError, match="frozen.weight"):
            run.tensor("frozen.weight", 1, kind="grads")
        # frozen params stay frozen, and are still in the state_dict
        assert_same(run.state_dict(5)["frozen.weight"], model.frozen.weight)
        # grads stats exist only where the grad did
        grad_stats = run.stats(kind="grads", name="aux.*")
        assert sorted(set(grad_stats["step"])) == [0, 2, 4]


def test_state_dict_has_buffers_from_start_of_iteration(tmp_path):
    """BatchNorm running stats in record t are those the forward of iteration t started with."""
    torch.manual_seed(3)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    starts, ends = [], []
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(5):
            starts.append({k: v.clone() for k, v in model.state_dict().items()})
            x, y = regression_batch(t, d_in=6, d_out=2)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            ends.append({k: v.clone() for k, v in model.state_dict().items()})
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(tmp_path / "run") as run:
        for t in range(5):
            sd = run.state_dict(t)
            assert list(sd) == list(starts[t])
            for k in starts[t]:
                assert_same(sd[k], starts[t][k], f"step {t} {k}")
            # the buffers moved during the forward: the test can tell start from end
            assert not torch.equal(sd["1.running_mean"], ends[t]["1.running_mean"])
            assert sd["1.num_batches_tracked"].item() == t
            fresh = make()
            fresh.load_state_dict(sd, strict=True)
            for k, v in fresh.state_dict().items():
                assert_same(v, starts[t][k], f"loaded step {t} {k}")
        assert "1.running_var" in run.names("buffers")


def test_tied_weights_come_back_under_every_key(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt):
        for t in range(3):
            idx = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(t))
            loss = nn.functional.cross_entropy(model(idx), idx)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.names("params") == ["emb.weight"]
        sd = run.state_dict(2)
        assert list(sd) == list(model.state_dict())
        assert_same(sd["emb.weight"], snaps[2]["params"]["emb.weight"])
        assert_same(sd["out.weight"], snaps[2]["params"]["emb.weight"])
        fresh = Tied()
        fresh.load_state_dict(sd)
        assert_same(fresh.out.weight, snaps[2]["params"]["emb.weight"])


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the writer"
        time.sleep(0.01)


def test_run_is_readable_while_being_written(tmp_path):
    model = MLP(8, 16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snaps = []
    rec = stepdump.Recorder(tmp_path / "run", model, opt)
    try:
        for t in range(5):
            x, y = regression_batch(t, d_in=8, d_out=4)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
            rec.log(loss=loss)
        run = stepdump.open(tmp_path / "run")
        assert run.live
        _wait_for(lambda: run.steps == [0, 1, 2, 3, 4])
        assert_run_matches(run, 3, snaps[3])
        assert_same(run.tensor("fc1.weight", 4), snaps[4]["params"]["fc1.weight"])
        # the same Run object sees steps committed after it was opened
        for t in range(5, 8):
            x, y = regression_batch(t, d_in=8, d_out=4)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps.append(snapshot(model, opt))
            opt.step()
        _wait_for(lambda: run.steps == list(range(8)))
        assert_run_matches(run, 7, snaps[7])
    finally:
        rec.close()
    assert not run.live
    assert run.steps == list(range(9))  # and the final record close() wrote
    run.close()
    with stepdump.open(tmp_path / "run") as run:  # meta is read at open: final_step came with close()
        assert_final_record(run, model, opt, step=8)


def test_slow_writer_backpressure_loses_and_mixes_nothing(tmp_path):
    """With one staging slot and a slow disk, training waits; no step is lost or overwritten."""
    from reliability.faults import slow_disk

    model = MLP(8, 16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = train_recorded(tmp_path / "run", model, opt, 12, queue_depth=1, storage=slow_disk(0.005))
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == list(range(13))
        assert_final_record(run, model, opt, step=12)
        for t in range(12):
            assert_run_matches(run, t, snaps[t])


def test_small_segments_fsync_and_start_step(tmp_path):
    """Segment rollover, durability='fsync' and a custom first step number."""
    model = MLP(8, 16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snaps = {}
    with stepdump.Recorder(tmp_path / "run", model, opt, durability="fsync", segment_bytes=2048,
                           start_step=100) as rec:
        assert rec.step == 100
        for t in range(100, 108):
            x, y = regression_batch(t, d_in=8, d_out=4)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            snaps[t] = snapshot(model, opt)
            opt.step()
            rec.log(loss=loss)
    assert len(list((tmp_path / "run" / "segments").glob("*.seg"))) > 1
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == list(range(100, 109))
        final = assert_final_record(run, model, opt, step=108)
        for t, snap in snaps.items():
            assert_run_matches(run, t, snap)
        assert list(run.scalars()["loss"].dropna().index) == list(range(100, 108))
        weight = run.tensor("fc1.weight", final)
    # start_step at or before the last step drops the steps from there on (here all of them)
    rec = stepdump.Recorder(tmp_path / "run", model, opt, resume=True, start_step=50)
    try:
        assert rec.step == 50
        with stepdump.open(tmp_path / "run") as run:
            assert run.steps == [] and "final_step" not in run.meta
            assert run.scalars().empty  # their scalars are dropped too
            (entry,) = run.meta["history"]
            assert entry["resumed_at"] == 50 and entry["dropped"] == [50, 108]
    finally:
        rec.close()
    # close() without an update still records the state it was given: the run ends with its model
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [50]
        assert_final_record(run, model, opt, step=50)
        assert_same(run.tensor("fc1.weight", 50), weight)
