"""StepdumpTrainerCallback on a real Hugging Face Trainer: a tiny randomly initialised
GPT-2 built from a config (no download), a few steps on CPU, records checked against
the live tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, assert_seen_records, training_scalars

import stepdump

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tiny_gpt2 import tiny_gpt2, token_dataset  # noqa: E402

from stepdump.integrations.transformers import StepdumpTrainerCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

MAX_GRAD_NORM = 0.05


def _args(out, **kw) -> TrainingArguments:
    opts = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=MAX_GRAD_NORM,
                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    opts.update(kw)
    return TrainingArguments(**opts)


def _inner(opt):
    return getattr(opt, "optimizer", opt)


class Probe(TrainerCallback):
    """Clones the live state right before optimizer.step(): what each record must equal."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        opt = _inner(optimizer)
        sched = getattr(lr_scheduler, "scheduler", lr_scheduler)
        self.seen.append({
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "opt": {(n, k): v.clone() for n, p in model.named_parameters()
                    for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)},
            "sched": sched.state_dict(),
            "lr": opt.param_groups[0]["lr"],
        })


def _check(run: stepdump.types.Run, seen: list[dict], first: int = 0) -> None:
    assert_seen_records(run, seen, first)
    for i, s in enumerate(seen):
        assert run.scheduler_state_dict(first + i) == s["sched"]
        assert run.scalars().loc[first + i, "lr"] == s["lr"]


def _assert_rng_is_the_checkpoints(recorded: dict, ckpt) -> None:
    import numpy as np

    saved = torch.load(ckpt / "rng_state.pth", weights_only=False)
    assert_same(recorded["torch"], saved["cpu"], "torch RNG")
    assert recorded["numpy"]["pos"] == saved["numpy"][2]
    assert np.array_equal(recorded["numpy"]["keys"].numpy(), saved["numpy"][1])
    assert tuple(recorded["python"]["state"].tolist()) == saved["python"][1]


def test_a_resume_found_no_trainer_takes_the_rng_at_the_first_step(tmp_path, monkeypatch, caplog):
    """The fallback when the callback cannot reach the Trainer's RNG restore: on_step_begin of the
    first step, which is exact mid-epoch (the Trainer restores the RNG after skipping batches)."""
    import stepdump.integrations.transformers as hf

    out, run_dir = tmp_path / "out", tmp_path / "run"
    Trainer(model=tiny_gpt2(), args=_args(out, max_steps=2, save_strategy="steps", save_steps=2),
            train_dataset=token_dataset(), callbacks=[StepdumpTrainerCallback(run_dir)]).train()
    monkeypatch.setattr(hf, "_calling_trainer", lambda depth=8: None)
    with caplog.at_level("WARNING", logger="stepdump.integrations.transformers"):
        Trainer(model=tiny_gpt2(), args=_args(out, max_steps=4), train_dataset=token_dataset(),
                callbacks=[StepdumpTrainerCallback(tmp_path / "resumed")]).train(
            resume_from_checkpoint=str(out / "checkpoint-2"))
    assert "no Trainer with _load_rng_state" in caplog.text
    with stepdump.open(tmp_path / "resumed") as run:
        _assert_rng_is_the_checkpoints(run.rng_state(2), out / "checkpoint-2")


def test_trainer_records_equal_live_tensors(tmp_path):
    model, probe = tiny_gpt2(), Probe()
    cb = StepdumpTrainerCallback(tmp_path / "run")
    trainer = Trainer(model=model, args=_args(tmp_path / "out"), train_dataset=token_dataset(), callbacks=[probe, cb])
    trainer.train()
    assert trainer.state.global_step == 3 and len(probe.seen) == 3
    with pytest.raises(stepdump.ConfigError):
        cb.recorder  # noqa: B018 - closed at the end of training

    logs = [h for h in trainer.state.log_history if "loss" in h]
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == [0, 1, 2, 3] and run.meta["final_step"] == 3  # 3: close()'s final record
        assert run.meta["optimizer_class"] == "AdamW"
        assert run.meta["scheduler_class"] == "LambdaLR"
        _check(run, probe.seen)
        sc = training_scalars(run)
        assert list(sc["loss"]) == [h["loss"] for h in logs]
        assert list(sc["grad_norm"]) == [h["grad_norm"] for h in logs]
        assert list(sc["learning_rate"]) == [h["learning_rate"] for h in logs]
        assert list(sc["learning_rate"]) == list(sc["lr"])  # the Trainer reads it before the scheduler steps
        for t in run.all_steps[:-1]:
            # The Trainer clips before optimizer.step(): recorded grads are the clipped ones
            # (total norm at max_grad_norm), while the logged grad_norm is from before clipping.
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in run.tensors(t, "grads").values()]))
            assert sc.loc[t, "grad_norm"] > MAX_GRAD_NORM
            assert float(norm) == pytest.approx(MAX_GRAD_NORM, rel=1e-3)
        # tied embedding: one parameter, both state_dict keys come back
        sd = run.state_dict(2)
        assert_same(sd["lm_head.weight"], sd["transformer.wte.weight"])
        # the last record plus its update give the trained model: redo update 2 with AdamW
        restored = tiny_gpt2()
        named = dict(restored.named_parameters())  # the Trainer's two groups (decay / no decay)
        opt = torch.optim.AdamW([{"params": [named[n] for n in g]} for g in run.meta["layout"]["groups"]])
        run.restore(2, restored, opt, rng=False)
        for n, p in restored.named_parameters():
            p.grad = run.tensor(n, 2, "grads")
        opt.step()
        for (n, p), q in zip(restored.named_parameters(), model.parameters(), strict=True):
            assert_same(p.detach(), q.detach(), n)
            assert_same(run.tensor(n, 3), q.detach(), f"final record {n}")  # which the final record holds


def test_resume_from_checkpoint_appends(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    t1 = Trainer(model=tiny_gpt2(), args=_args(out, max_steps=2, save_strategy="steps", save_steps=2),
                 train_dataset=token_dataset(), callbacks=[StepdumpTrainerCallback(run_dir)])
    t1.train()
    ckpt = out / "checkpoint-2"
    assert ckpt.is_dir()
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")

    probe = Probe()
    t2 = Trainer(model=tiny_gpt2(), args=_args(out, max_steps=4), train_dataset=token_dataset(),
                 callbacks=[probe, StepdumpTrainerCallback(run_dir)])
    t2.train(resume_from_checkpoint=str(ckpt))
    with stepdump.open(run_dir) as run:
        assert run.all_steps == [0, 1, 2, 3, 4]  # 4: the final record (the trained model)
        assert [h["dropped"] for h in run.meta["history"]] == [[2, 2]]  # t1's final record 2, replaced
        sd = run.state_dict(2)  # before update 2 == what checkpoint-2 saved
        for k, v in saved.items():
            assert_same(sd[k], v, k)
        _check(run, probe.seen, first=2)
        # and its RNG is the one the Trainer restored from checkpoint-2, not the one from before
        _assert_rng_is_the_checkpoints(run.rng_state(2), ckpt)

    # resuming checkpoint-2 again records steps 2 and 3 again into the same run: 2..4 are dropped first
    t3 = Trainer(model=tiny_gpt2(), args=_args(out, max_steps=4), train_dataset=token_dataset(),
                 callbacks=[StepdumpTrainerCallback(run_dir)])
    t3.train(resume_from_checkpoint=str(ckpt))
    with stepdump.open(run_dir) as run:
        assert run.all_steps == [0, 1, 2, 3, 4] and run.meta["final_step"] == 4
        assert [(h["resumed_at"], h["dropped"]) for h in run.meta["history"]] == [(2, [2, 2]), (2, [2, 4])]
        sd = run.state_dict(2)
        for k, v in saved.items():
            assert_same(sd[k], v, k)
        assert stepdump.verify(run).ok
