"""A tiny randomly initialised GPT-2 built from a config (no download) and a token dataset,
for the tests that drive a real Hugging Face ``Trainer``. Import it after
``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def token_dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 12 tokens, the same for every call; labels are the inputs."""
    ids = torch.randint(0, 100, (n, 12), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]
