"""LoRA fine-tuning over a frozen base, the peft way.

Imitates huggingface/peft ``src/peft/tuners/lora/layer.py`` (``LoraLayer.update_layer`` and
``reset_lora_parameters``: ``lora_A`` kaiming-uniform, ``lora_B`` exactly zero, output scaled by
``lora_alpha / r``) and its example loop ``examples/sequence_classification/LoRA.ipynb``: the base
frozen with ``requires_grad_(False)`` yet handed to ``AdamW`` along with the adapters (frozen params
inside the optimizer), the embedding frozen and left out of it, and transformers'
``get_linear_schedule_with_warmup`` (a LambdaLR from lr 0 up, then linearly down to 0). At
``UNFREEZE`` the classifier head is unfrozen and joins the optimizer as a new param group
(``optimizer.add_param_group``), as a two-stage fine-tune does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import stepdump
from corpus import MODES

STEPS, WARMUP, UNFREEZE = 30, 5, 12
VOCAB, CLASSES = 48, 4
FAULTS = {"lr_x1000": 17}


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = alpha / r
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(ids).mean(1)))


def linear_schedule_with_warmup(opt: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers.get_linear_schedule_with_warmup."""
    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    model = Classifier()
    model.requires_grad_(False)  # the frozen base
    for i in (0, 2):  # get_peft_model(model, LoraConfig(target_modules=[...]))
        model.layers[i] = LoraLinear(model.layers[i])  # adapters are created trainable
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith(("embed", "head"))], lr=1e-2)
    sched = linear_schedule_with_warmup(opt, WARMUP, STEPS)
    gen = torch.Generator().manual_seed(1)
    with stepdump.Recorder(path, model, opt, sched, **MODES[mode]) as rec:
        for t in range(STEPS):
            if t == UNFREEZE:
                model.head.requires_grad_(True)
                opt.add_param_group({"params": list(model.head.parameters()), "lr": 1e-3, "initial_lr": 1e-3})
                sched.base_lrs.append(1e-3)  # the schedule must know the new group: a constant lr for it
                sched.lr_lambdas.append(lambda step: 1.0)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            ids = (y[:, None] * (VOCAB // CLASSES) + torch.randint(0, VOCAB // CLASSES, (16, 6), generator=gen))
            loss = nn.functional.cross_entropy(model(ids), y)
            loss.backward()
            if fault == "lr_x1000" and t == FAULTS["lr_x1000"]:
                for g in opt.param_groups:
                    g["lr"] *= 1000
            opt.step()
            if fault == "lr_x1000" and t == FAULTS["lr_x1000"]:
                for g in opt.param_groups:
                    g["lr"] /= 1000
            sched.step()
            opt.zero_grad()
            rec.log(loss=loss.item())
    return {"": path}
