"""exploding_gradient sees through gradient clipping: a real Hugging Face Trainer (tiny GPT-2,
max_grad_norm), a plain loop calling clip_grad_norm_, a real Lightning fit (gradient_clip_val).

Clipped grads are recorded clipped (their global norm sits at the clip value), so a blow-up
must be judged by the norm before clipping: the logged ``grad_norm``, or the recorded grads
themselves where the framework records before it clips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checks import of, serious, train
from torch import nn

import stepdump
from stepdump.checks import ExplodingGradient, Severity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _global_norms(run: stepdump.types.Run) -> dict[int, float]:
    g = run.stats("grads")
    return {int(s): float((rows["norm"] ** 2).sum() ** 0.5) for s, rows in g.groupby("step")}


def test_hf_trainer_lr_blow_up_under_max_grad_norm_is_one_exploding_gradient_finding(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from stepdump.integrations.transformers import StepdumpTrainerCallback

    transformers.logging.set_verbosity_error()
    k = 12  # the lr goes from 0.1 to 50 here and stays

    class Blow(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            if state.global_step >= k:
                for group in optimizer.param_groups:
                    group["lr"] = 50.0

    torch.manual_seed(0)
    # n_embd=48: the MLP weights (48x192) are over 4096 elements, so lean steps leave their
    # mean/std/zero_frac NULL (every=5, stats_every=1: the way to leave stepdump on).
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=48, n_layer=2, n_head=2, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 100, (64, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=20, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    cb = StepdumpTrainerCallback(tmp_path / "run", every=5, stats_every=1)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Blow(), cb]).train()

    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["user"]["grad_clip"] == {"max_norm": 1.0, "grads": "clipped", "norm_scalar": "grad_norm"}
        sc = run.scalars()
        recorded = _global_norms(run)
        # What hid the blow-up: every recorded step's grads are clipped to 1, while HF's pre-clip
        # grad_norm goes from ~1.2 to 17 right after the lr jump.
        assert all(n == pytest.approx(1.0, rel=1e-4) for n in recorded.values())
        assert sc.loc[k + 1, "grad_norm"] > 10 * sc.loc[:k, "grad_norm"].median()
        findings = stepdump.check(run)
        exploding = of(findings, "exploding_gradient")
        assert len(exploding) == 1
        f = exploding[0]
        assert (f.step, f.kind, f.severity) == (k + 1, "grads", Severity.ERROR)  # the loss went up 190x
        assert f.value == sc.loc[k + 1, "grad_norm"]  # the pre-clip norm, not the recorded 1.0
        assert "before clipping, from the logged 'grad_norm'" in f.message and "lr jump at step 12" in f.message
        # One finding per cause: no rule says the same thing once per weight.
        per_rule = Counter(x.rule for x in serious(findings))
        assert per_rule["lr_jump"] == 1 and set(per_rule.values()) == {1}, per_rule
        grouped = of(findings, "update_ratio")[0]
        assert len(grouped.tensors) >= 8 and set(grouped.tensors) <= set(run.names("params"))
        # Told not to read the logged norm, the rule sees only clipped grads and says what to log.
        blind = stepdump.check(run, rules=[ExplodingGradient(norm_scalar=None)])
        assert [(x.severity, x.step) for x in blind] == [(Severity.INFO, 0)]
        assert "look clipped" in blind[0].message and "clip_grad_norm_" in blind[0].message


def _clipped_run(path: Path, *, log_norm: bool) -> stepdump.types.Run:
    """SGD on the MLP, grads clipped to 1 before every step, the lr x500 from step 15 on."""
    k, norms = 15, {}

    def clip(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        norms[t] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (500 if t >= k else 1)

    def log(t: int, loss: torch.Tensor) -> dict[str, Any]:
        return {"loss": loss, **({"grad_norm": norms[t]} if log_norm else {})}

    return train(path, steps=25, opt="sgd", lr=1e-2, before_step=clip, log=log)


def test_plain_loop_clipping_hides_the_blow_up_until_the_pre_clip_norm_is_logged(tmp_path: Path) -> None:
    blind = _clipped_run(tmp_path / "blind", log_norm=False)
    recorded = _global_norms(blind)
    assert max(recorded.values()) == pytest.approx(1.0, rel=1e-4)  # clipped at (almost) every step
    hidden = of(stepdump.check(blind), "exploding_gradient")
    assert [(f.severity, f.threshold) for f in hidden] == [(Severity.INFO, pytest.approx(1.0, rel=1e-4))]
    assert "rec.log(grad_norm=torch.nn.utils.clip_grad_norm_(" in hidden[0].message
    # Logging what clip_grad_norm_ returns (the norm before clipping) is all it takes.
    seen = _clipped_run(tmp_path / "seen", log_norm=True)
    found = of(stepdump.check(seen), "exploding_gradient")
    assert len(found) == 1 and found[0].severity >= Severity.WARNING
    assert found[0].step in (15, 16) and found[0].value == seen.scalars().loc[found[0].step, "grad_norm"]
    assert found[0].value > 10 * 1.0


def test_lightning_gradient_clip_val_is_recorded_and_the_unclipped_grads_are_judged(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from stepdump.integrations.lightning import StepdumpCallback

    k = 10

    class Reg(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step >= k:  # the lr blow-up
                for g in self.optimizers().optimizer.param_groups:
                    g["lr"] = 20.0
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=16, gradient_clip_val=0.5,
                        callbacks=[StepdumpCallback(tmp_path / "run")])
    trainer.fit(Reg(), data)
    with stepdump.open(tmp_path / "run") as run:
        assert run.meta["user"]["grad_clip"] == {"grads": "unclipped", "algorithm": "norm", "max_norm": 0.5}
        recorded = _global_norms(run)
        assert max(recorded.values()) > 10 * 0.5  # recorded before Lightning clips
        found = of(stepdump.check(run), "exploding_gradient")
        assert len(found) == 1 and found[0].step > k
        assert found[0].value == pytest.approx(recorded[found[0].step])
        assert "before clipping at 0.5" in found[0].message
