"""Five ordinary setups that used to crash training or give wrong data (issue 12).

Each test trains the same program with and without a Recorder and checks, bit for
bit, that recording changed nothing, that what was recorded is what the training
had, and that a restore continues the same run.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import assert_final_record, assert_same, assert_same_tree, gen, snapshot
from torch import nn

import stepdump


class Bag(nn.Module):
    """A sparse embedding bag with a dense head."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=sparse)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(1))


def _sparse_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(t)
    return torch.randint(0, 20, (6, 3), generator=g), torch.randn(6, 1, generator=g)


def _sparse_setup(opt_name: str) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = Bag()
    if opt_name == "SparseAdam":  # dense params need a dense optimizer beside it
        return model, [torch.optim.SparseAdam(model.emb.parameters(), lr=0.1),
                       torch.optim.SGD(model.head.parameters(), lr=0.1)]
    cls = getattr(torch.optim, opt_name)
    return model, [cls(model.parameters(), lr=0.1)]


@pytest.mark.parametrize("opt_name", ["SGD", "Adagrad", "SparseAdam"])
def test_sparse_gradients_are_recorded_as_they_are_and_training_is_unchanged(tmp_path, opt_name):
    plain, plain_opts = _sparse_setup(opt_name)
    for t in range(4):
        x, y = _sparse_batch(t)
        for o in plain_opts:
            o.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        for o in plain_opts:
            o.step()

    model, opts = _sparse_setup(opt_name)
    opt = opts[0]
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise") as rec:
        for t in range(4):
            x, y = _sparse_batch(t)
            for o in opts:
                o.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            assert model.emb.weight.grad.is_sparse
            snaps.append(snapshot(model, opt))
            for o in opts:
                o.step()
            rec.log(loss=loss)
    for n, p in model.named_parameters():
        assert_same(p.detach(), dict(plain.named_parameters())[n].detach(), f"trained {n}")
    with stepdump.open(tmp_path / "run") as run:
        for t in range(4):
            grad = run.tensor("emb.weight", t, kind="grads")
            want = snaps[t]["grads"]["emb.weight"]  # stored sparse, as the optimizer saw it (FORMAT.md)
            assert grad.layout == torch.sparse_coo and grad.is_coalesced() == want.is_coalesced(), f"step {t}"
            assert_same(grad._indices(), want._indices(), f"step {t} sparse grad indices")
            assert_same(grad._values(), want._values(), f"step {t} sparse grad values")
            for name, want in snaps[t]["optimizer"].items():
                assert_same(run.tensor(name, t, kind="optimizer"), want.to_dense() if want.is_sparse else want, name)


def test_add_param_group_mid_run_is_recorded_and_restored(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        for p in model[2].parameters():
            p.requires_grad_(False)
        opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        return model, opt

    def iteration(model, opt, t):
        if t == 3:  # unfreeze the head and hand it to the optimizer
            for p in model[2].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3})
        g = gen(t)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()

    plain, popt = build(0)
    for t in range(6):
        iteration(plain, popt, t)
        popt.step()

    model, opt = build(0)
    snaps = []
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise"):
        for t in range(6):
            iteration(model, opt, t)
            snaps.append(snapshot(model, opt))
            opt.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_same(p.detach(), q.detach(), f"trained {n}")
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == list(range(7))
        assert_final_record(run, model, opt, step=6)  # with the param group added mid-run
        for t in (2, 3, 5):
            assert sorted(run.names("grads")) == ["0.bias", "0.weight", "2.bias", "2.weight"]
            for kind in ("params", "grads", "optimizer"):
                got = run.tensors(t, kind)
                assert sorted(got) == sorted(snaps[t][kind]), f"step {t} {kind}"
                for k, v in snaps[t][kind].items():
                    assert_same(got[k], v, f"step {t} {kind} {k}")
        assert len(run.optimizer_state_dict(2)["param_groups"]) == 1
        assert len(run.optimizer_state_dict(4)["param_groups"]) == 2
        # restore after the add into a fresh optimizer built as at the start: the
        # missing group is added back, then training continues bit-identically.
        for at in (1, 4):
            fresh, fopt = build(1)
            if at > 3:
                for p in fresh[2].parameters():
                    p.requires_grad_(True)
            run.restore(at, fresh, fopt)
            assert len(fopt.param_groups) == (2 if at > 3 else 1)
            for t in range(at, 6):
                iteration(fresh, fopt, t)
                fopt.step()
            for (n, p), q in zip(fresh.named_parameters(), plain.parameters()):
                assert_same(p.detach(), q.detach(), f"restored at {at}, continued: {n}")


def test_scheduler_state_keeps_its_types_through_restore(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        steps = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
        return model, opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, steps], milestones=[2])

    def iteration(model, opt, sched, t):
        g = gen(t)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 3, generator=g)), torch.randn(4, 1, generator=g)).backward()
        opt.step()
        sched.step()

    model, opt, sched = build(0)
    states = []
    with stepdump.Recorder(tmp_path / "run", model, opt, sched, on_error="raise"):
        for t in range(8):
            states.append(sched.state_dict())
            iteration(model, opt, sched, t)
    with stepdump.open(tmp_path / "run") as run:
        got = run.scheduler_state_dict(1)
        milestones = got["_schedulers"][1]["milestones"]
        assert type(milestones) is collections.Counter, type(milestones)
        assert milestones == collections.Counter([2, 4, 4])
        assert_same_tree(got, states[1], "scheduler state")
        fresh, fopt, fsched = build(1)
        run.restore(1, fresh, fopt, fsched)
        for t in range(1, 8):  # passes both milestones: crashed with a plain dict
            iteration(fresh, fopt, fsched, t)
        for p, q in zip(fresh.parameters(), model.parameters()):
            assert_same(p.detach(), q.detach(), "continued after restore")
        assert fsched.state_dict() == sched.state_dict()


def test_params_outside_the_model_are_restored(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(4, 3)
        temperature = nn.Parameter(torch.tensor(1.0 + seed))
        opt = torch.optim.Adam([{"params": model.parameters()}, {"params": [temperature], "lr": 0.05}], lr=1e-2)
        return model, temperature, opt

    def iteration(model, temp, opt, t):
        g = gen(t)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x) / temp, y).backward()
        opt.step()

    model, temp, opt = build(0)
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise"):
        for t in range(6):
            iteration(model, temp, opt, t)
    with stepdump.open(tmp_path / "run") as run:
        fresh, ftemp, fopt = build(1)
        run.restore(3, fresh, fopt)
        assert_same(ftemp.detach(), run.tensor("group1.param0", 3).detach(), "temperature restored")
        for t in range(3, 6):
            iteration(fresh, ftemp, fopt, t)
        assert_same(ftemp.detach(), temp.detach(), "temperature continued")
        for p, q in zip(fresh.parameters(), model.parameters()):
            assert_same(p.detach(), q.detach(), "model continued")
        # a param outside the model that the run did not record: refuse, naming it
    with stepdump.Recorder(tmp_path / "run2", model, opt, include=["weight", "bias"], on_error="raise"):
        iteration(model, temp, opt, 0)
    with stepdump.open(tmp_path / "run2") as run:
        fresh, ftemp, fopt = build(1)
        with pytest.raises(stepdump.StepdumpError, match="group1.param0"):
            run.restore(0, fresh, fopt)


def test_closure_optimizer_records_the_first_closure_gradients(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(4, 1)
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)

    def train(model, opt, steps, first_grads):
        for _ in range(steps):
            calls = [0]

            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if calls[0] == 0 and first_grads is not None:
                    first_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                    first_grads[-1]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                calls[0] += 1
                return loss

            opt.step(closure)

    plain, popt = build(0)
    train(plain, popt, 4, None)
    model, opt = build(0)
    want: list = []
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise"):
        train(model, opt, 4, want)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_same(p.detach(), q.detach(), "LBFGS training unchanged")
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2, 3, 4] and run.meta["final_step"] == 4
        assert run.tensors(4, "grads") == {}
        for n, p in model.named_parameters():  # the final record: the trained params
            assert_same(run.tensor(n, 4), p.detach(), f"final {n}")
        for t in range(4):
            for n in ("weight", "bias"):
                assert_same(run.tensor(n, t, kind="grads"), want[t][n], f"step {t} grad {n}")
                assert_same(run.tensor(n, t, kind="params"), want[t]["params"][n], f"step {t} param {n}")
        fresh, fopt = build(1)
        run.restore(2, fresh, fopt)
        train(fresh, fopt, 2, None)
        for p, q in zip(fresh.parameters(), model.parameters()):
            assert_same(p.detach(), q.detach(), "restored LBFGS continues")


class WithExtraState(nn.Module):
    """A module with non-tensor extra state in its state_dict (as TransformerEngine layers have)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]


def test_non_tensor_extra_state_is_left_out_with_a_warning_and_restore_keeps_it(tmp_path, caplog):
    import logging

    def build(seed):
        torch.manual_seed(seed)
        model = WithExtraState()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = build(0)
    caplog.set_level(logging.WARNING, logger="stepdump")
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise"):  # used to refuse the model
        for t in range(3):
            g = gen(t)
            opt.zero_grad()
            model(torch.randn(3, 4, generator=g)).square().mean().backward()
            opt.step()
    assert any("'_extra_state'" in r.getMessage() and "not a tensor" in r.getMessage() for r in caplog.records)
    with stepdump.open(tmp_path / "run") as run:
        fresh, fopt = build(1)
        fresh.calls = 7
        run.restore(2, fresh, fopt)
        assert fresh.calls == 7  # left as it was
        assert_same(fresh.fc.weight.detach(), run.tensor("fc.weight", 2), "params restored")
