"""Export a recorded step as a Hugging Face Trainer checkpoint and resume a real Trainer from it.

A tiny randomly initialised GPT-2 (dropout on, so the RNG matters) trains 6 optimizer steps
(4 per epoch, gradient accumulation 2) with the StepdumpTrainerCallback, while the Trainer
saves its own checkpoints at steps 2 and 4. The export of a step must hold what the Trainer's
own checkpoint of that step holds, and a fresh Trainer resumed from it must end bit for bit
where the original ended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same, assert_same_tree, param_clones
from safetensors.torch import load_file

import stepdump

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments

from tiny_gpt2 import tiny_gpt2, token_dataset  # noqa: E402

from stepdump.integrations.transformers import StepdumpTrainerCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

MAX_STEPS = 6


def _args(out: Path, **kw: Any) -> TrainingArguments:
    opts: dict[str, Any] = {
        "output_dir": str(out), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "max_steps": MAX_STEPS, "learning_rate": 1e-3, "lr_scheduler_type": "linear", "warmup_steps": 1,
        "max_grad_norm": 1.0, "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no",
        "seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0,
    }
    opts.update(kw)
    return TrainingArguments(**opts)


def _train(tmp: Path, **recorder_kwargs: Any) -> dict[str, Any]:
    """The original run: recorded, with the Trainer's own checkpoints at steps 2 and 4."""
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=_args(tmp / "out", save_strategy="steps", save_steps=2),
                      train_dataset=token_dataset(), callbacks=[StepdumpTrainerCallback(tmp / "run", **recorder_kwargs)])
    trainer.train()
    return {"run": tmp / "run", "out": tmp / "out", "final": param_clones(model)}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("hf"))


def _assert_same_checkpoint(exported: Path, saved: Path) -> None:
    """The exported folder holds what the Trainer's own checkpoint of the same step holds."""
    ours, theirs = load_file(exported / "model.safetensors"), load_file(saved / "model.safetensors")
    assert set(ours) == set(theirs)  # the tied lm_head.weight left out, as the Trainer does
    for k, v in theirs.items():
        assert_same(ours[k], v, f"model {k}")
    for name in ("optimizer.pt", "scheduler.pt"):
        assert_same_tree(torch.load(exported / name, weights_only=True), torch.load(saved / name, weights_only=True),
                         name)
    assert not (exported / "scaler.pt").exists() and not (saved / "scaler.pt").exists()
    mine = torch.load(exported / "rng_state.pth", weights_only=False)
    hf = torch.load(saved / "rng_state.pth", weights_only=False)
    assert set(mine) == set(hf)
    assert mine["python"] == hf["python"]
    assert mine["numpy"][0] == hf["numpy"][0] and mine["numpy"][2:] == hf["numpy"][2:]
    assert np.array_equal(mine["numpy"][1], hf["numpy"][1])
    assert torch.equal(mine["cpu"], hf["cpu"])
    state = json.loads((exported / "trainer_state.json").read_text())
    want = json.loads((saved / "trainer_state.json").read_text())
    for key in ("global_step", "epoch", "train_batch_size", "logging_steps", "save_steps", "eval_steps",
                "max_steps", "num_train_epochs"):
        assert state[key] == want[key], key
    # the recorded logs, step by step (the Trainer's log_history, less what the Recorder adds)
    assert [h["step"] for h in state["log_history"]] == [h["step"] for h in want["log_history"]]
    for a, b in zip(state["log_history"], want["log_history"], strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["epoch"] == b["epoch"]


@pytest.mark.parametrize("step", [2, 4], ids=["mid-epoch", "epoch-boundary"])
def test_export_holds_what_the_trainer_saves(original: dict[str, Any], tmp_path: Path, step: int) -> None:
    with stepdump.open(original["run"]) as run:
        out = run.export(step, tmp_path / f"checkpoint-{step}", format="hf-trainer")
    assert out == tmp_path / f"checkpoint-{step}"
    _assert_same_checkpoint(out, original["out"] / f"checkpoint-{step}")


@pytest.mark.parametrize("step", [2, 4], ids=["mid-epoch", "epoch-boundary"])
def test_trainer_resumed_from_export_ends_bit_identical(original: dict[str, Any], tmp_path: Path,
                                                        step: int) -> None:
    from stepdump.export import export_checkpoint

    with stepdump.open(original["run"]) as run:
        ckpt = export_checkpoint(run, step, tmp_path / "ckpt", format="hf-trainer")
    model = tiny_gpt2(seed=123)  # other initial weights: everything must come from the checkpoint
    trainer = Trainer(model=model, args=_args(tmp_path / "out2"), train_dataset=token_dataset(),
                      callbacks=[StepdumpTrainerCallback(tmp_path / "resumed")])
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == MAX_STEPS
    for n, p in model.named_parameters():
        assert_same(p.detach(), original["final"][n], n)
    # and every resumed step's record equals the original's (params, grads, optimizer state)
    with stepdump.open(tmp_path / "resumed") as resumed, stepdump.open(original["run"]) as run:
        assert resumed.all_steps[:MAX_STEPS - step] == list(range(step, MAX_STEPS))
        for t in range(step, MAX_STEPS):
            assert resumed.fingerprints(t, ["params", "grads", "optimizer"]) == \
                run.fingerprints(t, ["params", "grads", "optimizer"]), t
        assert_resumed_records_equal(run, resumed, step)


def assert_resumed_records_equal(run: stepdump.types.Run, resumed: stepdump.types.Run, step: int) -> None:
    """``diff(original, resumed)`` is identical over the resumed steps, RNG included: the first
    resumed record holds the RNG the trainer restored (issue 22, item 8), not the one before."""
    res = stepdump.diff(run, resumed)
    assert res.identical and res.steps_compared == MAX_STEPS - step + 1, res.summary()
    assert res.rng == [] and res.notes == [], res.summary()  # not even a note: every stream is equal
    assert res.coverage.rng_steps == MAX_STEPS - step + 1, res.summary()
    assert_same_tree(resumed.rng_state(step), run.rng_state(step), f"RNG of the first resumed record {step}")


@pytest.mark.parametrize("step", [2, 4], ids=["mid-epoch", "epoch-boundary"])
def test_trainer_resumed_from_its_own_checkpoint_records_what_the_original_did(original: dict[str, Any],
                                                                              tmp_path: Path, step: int) -> None:
    """The Trainer's own checkpoint (not an export): the RNG it restores is the one the original
    run had right after update ``step - 1``, and the resumed run's record ``step`` holds it."""
    model = tiny_gpt2(seed=123)
    trainer = Trainer(model=model, args=_args(tmp_path / "out2"), train_dataset=token_dataset(),
                      callbacks=[StepdumpTrainerCallback(tmp_path / "resumed")])
    trainer.train(resume_from_checkpoint=str(original["out"] / f"checkpoint-{step}"))
    for n, p in model.named_parameters():
        assert_same(p.detach(), original["final"][n], n)
    with stepdump.open(tmp_path / "resumed") as resumed, stepdump.open(original["run"]) as run:
        assert resumed.all_steps == list(range(step, MAX_STEPS + 1))
        assert_resumed_records_equal(run, resumed, step)


def test_export_without_grads_and_at_the_last_record(tmp_path: Path) -> None:
    """A run recorded without grads (as the final record after the last update has none) exports alike."""
    orig = _train(tmp_path, capture=("params", "optimizer"))
    with stepdump.open(orig["run"]) as run:
        assert run.names("grads") == []
        last = run.all_steps[-1]
        out = run.export(4, tmp_path / "ckpt4", format="hf-trainer")
        _assert_same_checkpoint(out, orig["out"] / "checkpoint-4")
        # the last record: resuming it trains the remaining steps, if any, to the same end
        end = run.export(last, tmp_path / "last", format="hf-trainer")
    model = tiny_gpt2(seed=123)
    Trainer(model=model, args=_args(tmp_path / "out2"), train_dataset=token_dataset()).train(
        resume_from_checkpoint=str(end))
    for n, p in model.named_parameters():
        assert_same(p.detach(), orig["final"][n], n)


def test_train_batch_size_is_needed_when_the_run_does_not_say(tmp_path: Path) -> None:
    from helpers import record_run

    run = stepdump.open(record_run(tmp_path / "run", steps=3))
    with pytest.raises(stepdump.ConfigError, match="train_batch_size"):
        run.export(2, tmp_path / "a", format="hf-trainer")
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()
    from stepdump.export import export_checkpoint

    out = export_checkpoint(run, 2, tmp_path / "b", format="hf-trainer", trainer={"train_batch_size": 8})
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["train_batch_size"] == 8
    for name, t in load_file(out / "model.safetensors").items():
        assert_same(t, run.state_dict(2)[name], name)
    with pytest.raises(stepdump.ConfigError, match="already exists"):
        export_checkpoint(run, 2, tmp_path / "b", format="hf-trainer", trainer={"train_batch_size": 8})
    with pytest.raises(stepdump.ConfigError, match="does not use"):
        export_checkpoint(run, 2, tmp_path / "c", format="hf-trainer", trainer={"batch": 8})
    run.close()
