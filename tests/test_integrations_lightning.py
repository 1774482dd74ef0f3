"""StepdumpCallback on real Lightning fits (CPU): what each record holds, accumulation,
clipping, resuming, several optimizers and GradScaler skips."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, assert_seen_records, regression_loader, training_scalars
from torch import nn

import stepdump

L = pytest.importorskip("lightning.pytorch")
from stepdump.integrations.lightning import StepdumpCallback  # noqa: E402

# Lightning's own advice (dataloader workers, resumable loaders, deprecations inside it) is noise here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


def _trainer(callbacks, **kw) -> L.Trainer:
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    opts.update(kw)
    return L.Trainer(callbacks=callbacks, **opts)


class Net(L.LightningModule):
    """A small MLP with a BatchNorm buffer; Adam + a per-step LR schedule; keeps what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []
        self.clipped: list[dict[str, torch.Tensor]] = []
        self.at_pre_hook: list[dict[str, torch.Tensor]] = []  # what the optimizer's step pre-hook sees

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return {"loss": loss}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped.append({n: p.grad.clone() for n, p in self.named_parameters()})

    def watch(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        opt.register_step_pre_hook(lambda o, a, k: self.at_pre_hook.append(
            {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}))
        return opt

    def configure_optimizers(self):
        opt = self.watch(torch.optim.Adam(self.parameters(), lr=0.01))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(L.Callback):
    """Clones the live state at on_before_optimizer_step: what each record must equal."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.buffers: list[dict[str, torch.Tensor]] = []  # at the start of each batch
        self.fit_rng: torch.Tensor | None = None  # the torch RNG the fit starts from

    def on_fit_start(self, trainer, pl_module):
        self.fit_rng = torch.get_rng_state()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.buffers.append({n: b.clone() for n, b in pl_module.named_buffers()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self.seen.append({
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None},
            "opt": {(n, k): v.clone() for n, p in pl_module.named_parameters()
                    for k, v in optimizer.state.get(p, {}).items()},
            "sched": None if sched is None else dict(sched.state_dict()),
            "lr": optimizer.param_groups[0]["lr"],
        })


def _check_records(run: stepdump.types.Run, seen: list[dict]) -> None:
    # one record per update seen, then the final record close() writes (no grads)
    assert run.all_steps == list(range(len(seen) + 1)) and run.meta["final_step"] == len(seen)
    assert run.tensors(len(seen), "grads") == {}
    assert_seen_records(run, seen)


def test_records_equal_live_state_with_accumulation_and_clipping(tmp_path):
    torch.manual_seed(0)
    model, probe = Net(), Probe()
    cb = StepdumpCallback(tmp_path / "run")
    # 4 batches an epoch, 2 per step: steps 0, 1 in epoch 0 and step 2 in epoch 1.
    trainer = _trainer([probe, cb], max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05)
    trainer.fit(model, regression_loader())
    assert cb.recorders == []  # closed at the end of the fit
    assert trainer.global_step == 3 and len(probe.seen) == 3

    with stepdump.open(tmp_path / "run") as run:
        _check_records(run, probe.seen)
        # Adam's state before the first update is empty; before update 1 it has exp_avg etc.
        assert run.stats(kind="optimizer", steps=0).empty
        assert len(probe.seen[1]["opt"]) > 0
        sc = run.scalars()
        for t, s in enumerate(probe.seen):
            assert run.scheduler_state_dict(t) == s["sched"]
            assert sc.loc[t, "lr"] == s["lr"]
            # loss: mean over the step's two micro-batches
            assert sc.loc[t, "loss"] == pytest.approx(float(torch.stack(model.losses[2 * t:2 * t + 2]).mean()))
            # grads are recorded before Lightning's clipping: the clipped ones differ, and
            # the recorded total norm is above the clip value
            total = torch.linalg.vector_norm(torch.stack([g.norm() for g in s["grads"].values()]))
            assert total > 0.05
            clipped = model.clipped[t]
            assert any(not torch.equal(clipped[n], g) for n, g in s["grads"].items())
            # Why the callback does not use the optimizer's pre-hook: under Lightning's closure it
            # fires before the last micro-batch's backward, so it sees partial sums.
            assert any(not torch.equal(model.at_pre_hook[t][n], g) for n, g in s["grads"].items())


def test_final_params_follow_from_last_record(tmp_path):
    """Record t+1 holds the result of update t; a plain fit, no accumulation, SGD without state."""

    class Sgd(Net):
        def configure_optimizers(self):
            return self.watch(torch.optim.SGD(self.parameters(), lr=0.1))

    torch.manual_seed(0)
    model, probe = Sgd(), Probe()
    trainer = _trainer([probe, StepdumpCallback(tmp_path / "run")], max_steps=3)
    trainer.fit(model, regression_loader())
    with stepdump.open(tmp_path / "run") as run:
        _check_records(run, probe.seen)
        final = run.meta["final_step"]
        for t in run.all_steps[:-1]:  # buffers: as at the start of iteration t
            sd = run.state_dict(t)
            for n, b in probe.buffers[t].items():
                assert_same(sd[n], b, f"{n} @ {t}")
        last = final - 1  # the last update
        sd = run.state_dict(last)
        for n, p in model.named_parameters():
            expect = sd[n].clone().add_(run.tensor(n, last, "grads"), alpha=-0.1)  # as SGD does it
            assert_same(p.detach(), expect, n)
            assert_same(run.tensor(n, final), p.detach(), f"final record {n}")  # ... which close() stored
        assert list(training_scalars(run)["loss"]) == [float(x) for x in model.losses]
    # Without accumulation the optimizer's pre-hook (not used) would see no grads at step 0
    # and the previous step's grads after that: it fires before backward under Lightning.
    assert model.at_pre_hook[0] == {}
    for t in (1, 2):
        for n, g in model.at_pre_hook[t].items():
            assert_same(g, probe.seen[t - 1]["grads"][n], n)


def test_resume_from_checkpoint_appends_to_the_run(tmp_path):
    torch.manual_seed(0)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.ckpt"
    t1 = _trainer([StepdumpCallback(run_dir)], max_steps=2)
    t1.fit(Net(), regression_loader())
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["state_dict"]

    # A fresh fit into the same directory is refused (no silent mixing of runs).
    with pytest.raises(stepdump.RunExistsError):
        _trainer([StepdumpCallback(run_dir)], max_steps=2).fit(Net(), regression_loader())

    probe = Probe()
    t2 = _trainer([probe, StepdumpCallback(run_dir)], max_steps=4)
    t2.fit(Net(), regression_loader(), ckpt_path=ckpt)
    assert len(probe.seen) == 2
    with stepdump.open(run_dir) as run:
        assert run.all_steps == [0, 1, 2, 3, 4]  # 4: the final record (the trained model)
        assert [h["dropped"] for h in run.meta["history"]] == [[2, 2]]  # t1's final record 2, replaced
        sd = run.state_dict(2)  # params before update 2 == those the checkpoint saved
        for k, v in saved.items():
            assert_same(sd[k], v, k)
        for t, s in zip((2, 3), probe.seen, strict=True):
            for n, v in s["grads"].items():
                assert_same(run.tensor(n, t, "grads"), v, f"grads {n} @ {t}")
            assert run.scheduler_state_dict(t) == s["sched"]
        # the first resumed record's RNG: the one the fit starts from, before the loader's first draw
        assert_same(run.rng_state(2)["torch"], probe.fit_rng, "RNG of record 2")

    # Resuming the step-2 checkpoint again records into the same run: steps 2..4 are dropped first.
    _trainer([StepdumpCallback(run_dir)], max_steps=4).fit(Net(), regression_loader(), ckpt_path=ckpt)
    with stepdump.open(run_dir) as run:
        assert run.all_steps == [0, 1, 2, 3, 4] and run.meta["final_step"] == 4
        assert [(h["resumed_at"], h["dropped"]) for h in run.meta["history"]] == [(2, [2, 2]), (2, [2, 4])]
        for k, v in saved.items():
            assert_same(run.state_dict(2)[k], v, k)
        assert stepdump.verify(run).ok


class TwoOpt(L.LightningModule):
    """Manual optimization with two optimizers (encoder: SGD with momentum, head: Adam)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.enc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        o_enc, o_head = self.optimizers()
        loss = nn.functional.mse_loss(self.head(torch.tanh(self.enc(x))), y)
        o_enc.zero_grad()
        o_head.zero_grad()
        self.manual_backward(loss)
        o_enc.step()
        o_head.step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.enc.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.head.parameters(), lr=0.01)]


def test_several_optimizers_one_run_each(tmp_path):
    torch.manual_seed(0)
    seen: dict[int, list] = {0: [], 1: []}

    class P(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            i = [id(o) for o in trainer.optimizers].index(id(optimizer))
            seen[i].append({n: p.grad.clone() for n, p in pl_module.named_parameters()
                            if any(p is q for g in optimizer.param_groups for q in g["params"])})

    cb = StepdumpCallback(tmp_path / "run")
    trainer = _trainer([P(), cb], max_steps=6, limit_train_batches=3)  # global_step counts both optimizers
    trainer.fit(TwoOpt(), regression_loader())
    for i, prefix in ((0, "enc."), (1, "head.")):
        with stepdump.open(tmp_path / "run" / f"opt{i}") as run:
            assert run.all_steps == [0, 1, 2, 3] and run.meta["final_step"] == 3  # each run closes with one
            assert all(n.startswith(prefix) for n in run.names("params"))
            assert all(n.startswith(prefix) for n in run.names("grads"))
            for t, grads in enumerate(seen[i]):
                for n, g in grads.items():
                    assert_same(run.tensor(n, t, "grads"), g, f"opt{i} {n} @ {t}")
            assert training_scalars(run)["loss"].notna().all()
    assert run.meta["optimizer_class"] in ("SGD", "Adam")


def test_gradscaler_skip_is_recorded(tmp_path):
    """fp16 AMP with a GradScaler on CPU (given as a plugin): an inf loss makes the scaler
    skip the update; the step is still recorded, marked skipped, and numbering goes on."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Boom(Net):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if batch_idx == 1:
                out["loss"] = out["loss"] * float("inf")
            return out

        def configure_gradient_clipping(self, *a, **k):
            pass

    torch.manual_seed(0)
    probe = Probe()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    trainer = _trainer([probe, StepdumpCallback(tmp_path / "run")], max_steps=3, plugins=[plugin])
    trainer.fit(Boom(), regression_loader())
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == [0, 1, 2, 3] and run.meta["final_step"] == 3
        assert run.skipped_steps == [1]
        sc = run.scalars()
        assert sc.loc[1, "grad_scale"] == 2.0**8 and sc.loc[2, "grad_scale"] == 2.0**7
        # the skipped update changed nothing: params of record 2 == params of record 1
        for n in run.names("params"):
            assert_same(run.tensor(n, 2), run.tensor(n, 1), n)
        # the recorded grads are the unscaled ones the probe saw
        for n, v in probe.seen[0]["grads"].items():
            assert_same(run.tensor(n, 0, "grads"), v, n)


def test_lean_mode_with_clipping_keeps_every_steps_grad_stats_without_a_warning(tmp_path, caplog):
    """Lightning clips after on_before_optimizer_step (the record): the lean path reads the grads at
    the record, as full mode stores them, from the first step on (no 'changed in place' warning, no
    step without grad stats), and the stats are those of the unclipped grads."""
    torch.manual_seed(0)
    model, probe = Net(), Probe()
    cb = StepdumpCallback(tmp_path / "run", every=None, stats_every=1)
    trainer = _trainer([probe, cb], max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05)
    with caplog.at_level("WARNING", logger="stepdump"):
        trainer.fit(model, regression_loader())
    assert not [r for r in caplog.records if "changed in place" in r.getMessage()]
    with stepdump.open(tmp_path / "run") as run:
        st = run.stats(kind="grads")
        for t, s in enumerate(probe.seen):
            rows = st[st["step"] == t]
            assert len(rows) == len(s["grads"]), f"grad stats of step {t}"
            for n, g in s["grads"].items():  # the probe's grads: taken before Lightning clipped them
                assert rows[rows["name"] == n]["max"].item() == float(g.max()), f"{n} @ {t}"
