"""Re-execution from a Lightning recording without a train_step (issue 24 item 2, docs/reexecute.md):
the callback logs every micro-batch without a user line, and ``stepdump.reexecute(run, k, module)``
builds the iteration from the module (its ``training_step``, the Trainer's accumulation, loss
normalisation and clipping as the run's meta recorded them, ``configure_optimizers``), bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import one_batch_run, regression_loader
from torch import nn

import stepdump
from stepdump.errors import ConfigError
from stepdump.reexec.engine import recorded_inputs

L = pytest.importorskip("lightning.pytorch")
from stepdump.integrations.lightning import StepdumpCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
STEPS = 3


class Net(L.LightningModule):
    """A small MLP with a BatchNorm buffer; Adam + a per-step LR schedule; logs its loss."""

    def __init__(self, act: str = "tanh") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh() if act == "tanh" else nn.Softsign(),
                                 nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # a Trainer-only call: warns and does nothing in a re-execution
        return {"loss": loss}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CustomClip(Net):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def record(path: Path, module: L.LightningModule, **trainer_kw: Any) -> Path:
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, deterministic=True, max_steps=STEPS)
    L.Trainer(callbacks=[StepdumpCallback(path)], **{**opts, **trainer_kw}).fit(module, regression_loader())
    return path


# (Trainer settings): plain, accumulation 2 with norm clipping, value clipping
TRAINERS: list[dict[str, Any]] = [
    {},
    {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
]


@pytest.mark.parametrize("trainer_kw", TRAINERS, ids=["plain", "accum2-clipnorm", "clipvalue"])
def test_every_step_of_a_lightning_run_reexecutes_without_a_train_step(tmp_path: Path,
                                                                       trainer_kw: dict[str, Any]) -> None:
    run = stepdump.open(record(tmp_path / "run", Net(), **trainer_kw))
    micro = trainer_kw.get("accumulate_grad_batches", 1)
    for k in range(STEPS):
        # the callback logged every micro-batch of the step, without a user line
        assert len({n.split("#")[0] for n in recorded_inputs(run, k)}) == 2  # x and y
        assert len(recorded_inputs(run, k)) == 2 * micro
        r = stepdump.reexecute(run, k, Net())
        assert r.verdict == "reproduces", r.summary()
        assert r.compared > 10 and not any("loss" in n for n in r.notes), r.summary()


def test_a_changed_module_differs_from_the_record(tmp_path: Path) -> None:
    run = stepdump.open(record(tmp_path / "run", Net(), accumulate_grad_batches=2))
    r = stepdump.reexecute(run, 1, Net(act="softsign"))
    assert r.verdict == "differs from the record" and r.first is not None, r.summary()


@pytest.mark.parametrize(("what", "words"), [("plain-run", "train_step"), ("custom-clip", "configure_gradient_clipping"),
                                             ("no-optimizer", "optimizer")])
def test_refused_with_the_reason(tmp_path: Path, what: str, words: str) -> None:
    if what == "plain-run":
        with pytest.raises(ConfigError, match=words):
            stepdump.reexecute(stepdump.open(one_batch_run(tmp_path / "plain")), 0, nn.Linear(2, 1))
    elif what == "custom-clip":
        run = stepdump.open(record(tmp_path / "run", CustomClip(), gradient_clip_val=0.05))
        with pytest.raises(ConfigError, match=words):
            stepdump.reexecute(run, 0, CustomClip())
    else:
        run = stepdump.open(record(tmp_path / "run", Net()))
        with pytest.raises(ConfigError, match=words):
            stepdump.reexecute(run, 0, Net(), train_step=lambda m, o, b: None)


# -- the CLI: --entry may return the LightningModule alone ------------------------------------------------
def make_module() -> L.LightningModule:
    """``--entry test_reexec_lightning:make_module``."""
    return Net()


def make_plain() -> nn.Module:
    return nn.Linear(6, 1)


@pytest.mark.parametrize(("entry", "code", "words"), [
    ("make_module", 0, "step 1: reproduces"),
    ("make_plain", 5, "pass train_step="),
])
def test_cli_reexec_from_a_module_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, entry: str, code: int, words: str) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run = record(tmp_path / "run", Net(), accumulate_grad_batches=2, gradient_clip_val=0.05)
    assert main(["reexecute", str(run), "--step", "1", "--entry", f"test_reexec_lightning:{entry}"]) == code
    got = capsys.readouterr()
    assert words in (got.out if code == 0 else got.err), got
