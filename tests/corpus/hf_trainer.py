"""The tiny GPT-2 under a real Hugging Face ``Trainer`` with ``StepdumpTrainerCallback``.

The model, data and ``TrainingArguments`` are tests/test_integrations_transformers.py's
(``tiny_gpt2``, ``token_dataset``, ``_args``: accumulation 2, linear schedule with warmup,
``max_grad_norm``, ``logging_steps=1``), run for more steps so the rules have a trajectory.
Upstream: huggingface/transformers ``src/transformers/trainer.py`` (``Trainer._inner_training_loop``).
"""

from __future__ import annotations

from pathlib import Path

from corpus import MODES

STEPS = 24
FAULTS: dict[str, int] = {}


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    from test_integrations_transformers import _args
    from tiny_gpt2 import tiny_gpt2, token_dataset
    from transformers import Trainer

    from stepdump.integrations.transformers import StepdumpTrainerCallback

    args = _args(path.parent / f"{path.name}-out", max_steps=STEPS, warmup_steps=4, max_grad_norm=1.0,
                 learning_rate=3e-3)
    cb = StepdumpTrainerCallback(path, **MODES[mode])
    Trainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset(), callbacks=[cb]).train()
    return {"": path}
