"""Re-execution from a Hugging Face Trainer recording without a train_step (issue 24 items 1-2,
docs/reexecute.md): the callback logs every micro-batch the Trainer feeds (no user line, training
unchanged bit for bit), and ``stepdump.reexecute(run, k, trainer)`` runs the Trainer's own
``training_step`` (``compute_loss``, the accumulation's loss scaling), ``max_grad_norm`` clipping,
optimizer and scheduler for each recorded step, bitwise against the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, one_batch_run

import stepdump
from stepdump.errors import ConfigError
from stepdump.reexec.engine import batch_fingerprints, recorded_inputs

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from tiny_gpt2 import tiny_gpt2, token_dataset  # noqa: E402

from stepdump.integrations.transformers import StepdumpTrainerCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
STEPS = 6  # 4 steps an epoch with accumulation 2: the second epoch starts at step 4


def _args(out: Path, **kw: Any) -> TrainingArguments:
    opts: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=0.05, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    opts.update(kw)
    return TrainingArguments(**opts)


class Seen(Trainer):
    """Keeps every micro-batch its training_step is given: what the callback must have logged."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.fed: list[dict[str, torch.Tensor]] = []

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self.fed.append({k: v.clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)


def _trainer(out: Path, cls: type[Trainer] = Trainer, callbacks: list[Any] | None = None, model: Any = None,
             **kw: Any) -> Any:
    return cls(model=model if model is not None else tiny_gpt2(), args=_args(out, **kw),
               train_dataset=token_dataset(), callbacks=callbacks or [])


# (TrainingArguments overrides): accumulation 2 + norm clipping, no accumulation and no clipping,
# accumulation 2 + clipping with the loss logged over windows of 2 steps (not comparable per step)
ROWS: list[dict[str, Any]] = [{}, {"gradient_accumulation_steps": 1, "max_grad_norm": 0.0}, {"logging_steps": 2}]
IDS = ["accum2-clip", "plain", "log-every-2"]


@pytest.mark.parametrize("kw", ROWS[:2], ids=IDS[:2])
def test_the_callback_logs_every_micro_batch_and_training_is_unchanged(tmp_path: Path, kw: dict[str, Any]) -> None:
    bare = _trainer(tmp_path / "o1", **kw)
    bare.train()
    seen = _trainer(tmp_path / "o2", Seen, [StepdumpTrainerCallback(tmp_path / "run")], **kw)
    seen.train()
    for (n, p), q in zip(bare.model.named_parameters(), seen.model.parameters(), strict=True):
        assert_same(p.detach(), q.detach(), n)  # recording changed nothing, bit for bit
    micro = kw.get("gradient_accumulation_steps", 2)
    assert len(seen.fed) == STEPS * micro
    with stepdump.open(tmp_path / "run") as run:
        for k in range(STEPS):
            fed = seen.fed[k * micro:(k + 1) * micro]
            assert recorded_inputs(run, k) == batch_fingerprints(fed if micro > 1 else fed[0], micro)


@pytest.mark.parametrize("kw", ROWS, ids=IDS)
def test_every_step_of_an_hf_run_reexecutes_without_a_train_step(tmp_path: Path, kw: dict[str, Any]) -> None:
    _trainer(tmp_path / "o", callbacks=[StepdumpTrainerCallback(tmp_path / "run")], **kw).train()
    run = stepdump.open(tmp_path / "run")
    for k in range(STEPS):
        r = stepdump.reexecute(run, k, _trainer(tmp_path / "re", **kw))
        assert r.verdict == "reproduces", r.summary()
        assert r.compared > 50, r.summary()
        loss_notes = [n for n in r.notes if "loss" in n]
        if kw.get("logging_steps", 1) == 1:
            assert not loss_notes, r.summary()  # the loss was compared, bitwise
        else:
            assert any("logging_steps" in n for n in loss_notes), r.summary()


def test_a_changed_model_differs_from_the_record(tmp_path: Path) -> None:
    _trainer(tmp_path / "o", callbacks=[StepdumpTrainerCallback(tmp_path / "run")]).train()
    other = tiny_gpt2()
    other.config.activation_function = "gelu"  # the recorded run used gelu_new
    for block in other.transformer.h:
        block.mlp.act = transformers.activations.ACT2FN["gelu"]
    r = stepdump.reexecute(stepdump.open(tmp_path / "run"), 1, _trainer(tmp_path / "re", model=other))
    assert r.verdict == "differs from the record" and r.first is not None, r.summary()


@pytest.mark.parametrize(("what", "words"), [("bare-model", "Trainer"), ("plain-run", "train_step"),
                                             ("no-dataset", "train_dataset")])
def test_refused_with_the_reason(tmp_path: Path, what: str, words: str) -> None:
    if what in ("bare-model", "no-dataset"):
        _trainer(tmp_path / "o", callbacks=[StepdumpTrainerCallback(tmp_path / "run")]).train()
        # an epoch's first step needs the Trainer's data loader (its draw of the epoch's order)
        given = tiny_gpt2() if what == "bare-model" else Trainer(model=tiny_gpt2(), args=_args(tmp_path / "re"))
        with pytest.raises(ConfigError, match=words):
            stepdump.reexecute(stepdump.open(tmp_path / "run"), 0, given)
    else:
        with pytest.raises(ConfigError, match=words):
            stepdump.reexecute(stepdump.open(one_batch_run(tmp_path / "plain")), 0, _trainer(tmp_path / "re"))


def make_trainer() -> Trainer:
    """A --entry factory: the Trainer alone, built as the recorded run built it."""
    return Trainer(model=tiny_gpt2(), args=_args(Path("hf-reexec-out")), train_dataset=token_dataset())


def test_cli_reexec_from_a_trainer_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.chdir(tmp_path)
    _trainer(tmp_path / "o", callbacks=[StepdumpTrainerCallback(tmp_path / "run")]).train()
    assert main(["reexecute", str(tmp_path / "run"), "--step", "4", "--entry", "test_reexec_hf:make_trainer"]) == 0
    assert "step 4: reproduces" in capsys.readouterr().out


class Poisoned(Trainer):
    """Its loss is NaN at every micro-batch: the Trainer logs a substitute (logging_nan_inf_filter)."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch) * float("nan")


def test_a_nan_loss_the_trainer_filtered_is_not_compared(tmp_path: Path) -> None:
    _trainer(tmp_path / "o", Poisoned, [StepdumpTrainerCallback(tmp_path / "run")], max_grad_norm=0.0).train()
    r = stepdump.reexecute(stepdump.open(tmp_path / "run"), 1, _trainer(tmp_path / "re", Poisoned, max_grad_norm=0.0))
    assert r.verdict == "reproduces", r.summary()  # the grads and params (NaN) compared, bitwise
    assert any("logging_nan_inf_filter" in n for n in r.notes), r.summary()


def test_steps_recorded_after_a_checkpoint_resume_reexecute(tmp_path: Path) -> None:
    """A run the Trainer resumed from a checkpoint (its steps 2.. recorded by a second Trainer that
    restored model, optimizer, scheduler and RNG from checkpoint-2): each step on either side of
    the resume re-executes bit for bit."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    _trainer(out, callbacks=[StepdumpTrainerCallback(run_dir)], max_steps=2, save_strategy="steps",
             save_steps=2).train()
    _trainer(out, callbacks=[StepdumpTrainerCallback(run_dir)], max_steps=4).train(
        resume_from_checkpoint=str(out / "checkpoint-2"))
    with stepdump.open(run_dir) as run:
        assert run.all_steps == [0, 1, 2, 3, 4] and [h["resumed_at"] for h in run.meta["history"]] == [2]
        for k in range(4):
            r = stepdump.reexecute(run, k, _trainer(tmp_path / "re", max_steps=4))
            assert r.verdict == "reproduces", (k, r.summary())
            assert r.compared > 50, r.summary()
