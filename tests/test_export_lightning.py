"""Export a recorded step as a Lightning .ckpt and resume a real Lightning fit from it.

A small MLP with BatchNorm and dropout (so the RNG matters) trains 8 optimizer steps on a
shuffled loader of 4 batches per epoch, recorded by StepdumpCallback, while Lightning's
ModelCheckpoint saves its own checkpoints every 2 steps. The export of a step must hold what
Lightning's own checkpoint of that step holds (weights, optimizer, scheduler, loop counters),
and a fit resumed from it at an epoch boundary must end bit for bit where the original ended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, param_clones
from torch import nn

import stepdump

L = pytest.importorskip("lightning.pytorch")
from stepdump.integrations.lightning import StepdumpCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

MAX_STEPS = 8


class Net(L.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)


def _trainer(callbacks: list[Any], **kw: Any) -> L.Trainer:
    opts: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
        "deterministic": True, "max_steps": MAX_STEPS,
    }
    opts.update(kw)
    return L.Trainer(callbacks=callbacks, **opts)


def _train(tmp: Path, accumulate: int = 1) -> dict[str, Any]:
    """The original fit: recorded, with Lightning's own checkpoints every 2 optimizer steps."""
    L.seed_everything(0, verbose=False)
    model = Net()
    saver = L.callbacks.ModelCheckpoint(dirpath=tmp / "ckpts", every_n_train_steps=2, save_top_k=-1,
                                        filename="{step}")
    steps = MAX_STEPS // accumulate
    _trainer([StepdumpCallback(tmp / "run"), saver], enable_checkpointing=True, max_steps=steps,
             accumulate_grad_batches=accumulate).fit(model, _data())
    return {"run": tmp / "run", "ckpts": tmp / "ckpts", "final": param_clones(model), "steps": steps}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("lit"))


def _assert_same_ckpt(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key in ("epoch", "global_step", "pytorch-lightning_version", "loops"):
        assert ours[key] == theirs[key], key
    assert_same_tree(ours["state_dict"], theirs["state_dict"], "state_dict")
    assert_same_tree(ours["optimizer_states"], theirs["optimizer_states"], "optimizer_states")
    assert ours["lr_schedulers"] == theirs["lr_schedulers"]


@pytest.mark.parametrize("step", [2, 4, 6])
def test_export_holds_what_lightning_saves(original: dict[str, Any], tmp_path: Path, step: int) -> None:
    with stepdump.open(original["run"]) as run:
        out = run.export(step, tmp_path / "x.ckpt", format="lightning")
    ours = torch.load(out, weights_only=True)  # no pickled objects: loads as plain data
    theirs = torch.load(original["ckpts"] / f"step={step}.ckpt", weights_only=False)
    _assert_same_ckpt(ours, theirs)
    assert ours["stepdump"]["step"] == step


def test_loop_counters_under_gradient_accumulation(tmp_path: Path) -> None:
    orig = _train(tmp_path, accumulate=2)  # 2 optimizer steps per epoch
    with stepdump.open(orig["run"]) as run:
        for step in (2, 4):
            out = run.export(step, tmp_path / f"{step}.ckpt", format="lightning")
            _assert_same_ckpt(torch.load(out, weights_only=True),
                              torch.load(orig["ckpts"] / f"step={step}.ckpt", weights_only=False))


def test_fit_resumed_from_export_ends_bit_identical(original: dict[str, Any], tmp_path: Path) -> None:
    """At an epoch boundary (step 4 of 4 batches per epoch) the data order is Lightning's own;
    the model, optimizer, scheduler and loops come from the .ckpt, the RNG (dropout, the next
    epoch's shuffle) from StepdumpCallback.on_load_checkpoint."""
    with stepdump.open(original["run"]) as run:
        ckpt = run.export(4, tmp_path / "step4.ckpt", format="lightning")
    L.seed_everything(123, verbose=False)  # another RNG: it must come from the checkpoint
    model = Net(seed=123)
    trainer = _trainer([StepdumpCallback(tmp_path / "resumed")])
    trainer.fit(model, _data(), ckpt_path=str(ckpt))
    assert trainer.global_step == MAX_STEPS
    for n, p in model.named_parameters():
        assert_same(p.detach(), original["final"][n], n)
    with stepdump.open(tmp_path / "resumed") as resumed, stepdump.open(original["run"]) as run:
        assert resumed.all_steps[0] == 4
        for t in range(4, MAX_STEPS):
            kinds = ["params", "grads", "optimizer"]
            assert resumed.fingerprints(t, kinds) == run.fingerprints(t, kinds), t
        # diff(original, resumed): identical, RNG included (issue 22, item 8)
        res = stepdump.diff(run, resumed)
        assert res.identical and res.steps_compared == MAX_STEPS - 4 + 1, res.summary()
        assert res.rng == [] and res.notes == [] and res.coverage.rng_steps == MAX_STEPS - 4 + 1, res.summary()
        assert_same_tree(resumed.rng_state(4), run.rng_state(4), "RNG of the first resumed record")


def test_fit_resumed_mid_epoch_starts_from_the_record(original: dict[str, Any], tmp_path: Path) -> None:
    """Mid-epoch, Lightning restarts a plain DataLoader from its first batch (it warns so), so
    the batches differ from the original's; what holds is the state the fit resumes from, and
    diff says exactly that: at the first resumed step the params, optimizer state and RNG are
    the original's, and the batch (which the callback logs) differs (docs/integrations.md: why
    this cannot be exact)."""
    with stepdump.open(original["run"]) as run:
        ckpt = run.export(2, tmp_path / "step2.ckpt", format="lightning")
    model = Net(seed=123)
    trainer = _trainer([StepdumpCallback(tmp_path / "resumed")])
    trainer.fit(model, _data(), ckpt_path=str(ckpt))
    assert trainer.global_step == MAX_STEPS
    with stepdump.open(tmp_path / "resumed") as resumed, stepdump.open(original["run"]) as run:
        assert resumed.all_steps[0] == 2
        kinds = ["params", "optimizer"]
        assert resumed.fingerprints(2, kinds) == run.fingerprints(2, kinds)
        assert resumed.scheduler_state_dict(2) == run.scheduler_state_dict(2)
        assert_same_tree(resumed.rng_state(2), run.rng_state(2), "RNG of the first resumed record")
        res = stepdump.diff(run, resumed)
        # the callback logs every batch (issue 24): diff names the batch itself as the cause
        assert res.first_step == 2 and (res.cause.stage, res.cause.what) == ("batch", "inputs batch/0"), res.summary()
        assert res.rng == [] and "rng" in res.coverage.state_parts, res.summary()
        assert res.reading == ("the batch differs at step 2 (inputs batch/0, inputs batch/1) → the data differs "
                               "(order, shuffling seed, augmentation)")


def test_fit_from_the_export_of_step_zero_is_the_original_fit(original: dict[str, Any], tmp_path: Path) -> None:
    """Step 0 exports as a fit from the start: with its RNG restored, the fit is the original's,
    record 0 included (its RNG is the one from before the loader's first draw)."""
    with stepdump.open(original["run"]) as run:
        ckpt = run.export(0, tmp_path / "step0.ckpt", format="lightning")
    L.seed_everything(123, verbose=False)
    model = Net(seed=123)
    _trainer([StepdumpCallback(tmp_path / "resumed")]).fit(model, _data(), ckpt_path=str(ckpt))
    for n, p in model.named_parameters():
        assert_same(p.detach(), original["final"][n], n)
    with stepdump.open(tmp_path / "resumed") as resumed, stepdump.open(original["run"]) as run:
        res = stepdump.diff(run, resumed)
        assert res.identical and res.complete and res.rng == [] and res.notes == [], res.summary()
        assert res.coverage.rng_steps == MAX_STEPS + 1, res.summary()


def test_step_zero_and_missing_setup(original: dict[str, Any], tmp_path: Path) -> None:
    with stepdump.open(original["run"]) as run:
        ckpt = torch.load(run.export(0, tmp_path / "z.ckpt", format="lightning"), weights_only=True)
    assert ckpt["global_step"] == 0 and "loops" not in ckpt  # a fit from the start
    from helpers import record_run

    from stepdump.export import export_checkpoint

    with stepdump.open(record_run(tmp_path / "plain", steps=3)) as plain:
        with pytest.raises(stepdump.ConfigError, match="num_training_batches"):
            plain.export(2, tmp_path / "p.ckpt", format="lightning")
        assert not (tmp_path / "p.ckpt").exists()
        out = export_checkpoint(plain, 2, tmp_path / "p.ckpt", format="lightning",
                                trainer={"num_training_batches": 4})
        ckpt = torch.load(out, weights_only=True)
        assert ckpt["global_step"] == 2
        assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 2
