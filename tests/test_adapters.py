"""Adapters over a frozen base (issue 28 item 3): the trainable params (and their optimizer state)
are recorded every step, the frozen base once (``frozen="once"``, the default: a full step whose
frozen tensor has the bytes already stored names that blob, checked by fingerprint at every
full step) or never (``frozen="fingerprint"``: stats and fingerprints only). restore onto a
rebuilt base (the same base weights, fresh adapters) is bitwise and continues bitwise; a base
that differs from the recorded one is refused, naming the tensor, where the run holds it by
fingerprint only; a base changed mid-run is stored again (never silently wrong).

The LoRA layer is peft's in miniature: the base ``nn.Linear`` frozen, ``lora_A`` random,
``lora_B`` zero, the output ``base(x) + B(A(x)) * alpha / r``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, catalog_sql, optimizer_state_clone, regression_batch
from torch import nn

import stepdump

N = 8
D = 48  # the base's width: base bytes dominate, as in a real LoRA run


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale


def build(adapter_seed: int, base_seed: int = 0) -> dict[str, Any]:
    """The base from ``base_seed`` (as if loaded from the same pretrained weights), fresh adapters from
    ``adapter_seed``, AdamW over the trainable params only (peft's usual setup), a scheduler."""
    torch.manual_seed(base_seed)
    base = [nn.Linear(8, D), nn.Linear(D, D), nn.Linear(D, 4)]
    torch.manual_seed(adapter_seed)
    model = nn.Sequential(LoRALinear(base[0]), nn.GELU(), LoRALinear(base[1]), nn.Dropout(0.1), LoRALinear(base[2]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


def iteration(t: int, o: dict[str, Any], before_step: Any = None) -> None:
    x, y = regression_batch(t, n=16, d_in=8, d_out=4)
    o["optimizer"].zero_grad()
    nn.functional.mse_loss(o["model"](x), y).backward()
    if before_step is not None:
        before_step()
    o["optimizer"].step()
    o["scheduler"].step()


def state(o: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in o["model"].state_dict().items()},
            "optimizer": optimizer_state_clone(o["optimizer"]), "scheduler": o["scheduler"].state_dict()}


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


MODES = {"once-full": {}, "once-every2": {"every": 2}, "once-keyframes3": {"keyframe_every": 3},
         "once-gradlog3": {"gradient_log": 3}, "fingerprint-full": {"frozen": "fingerprint"},
         "fingerprint-every2": {"frozen": "fingerprint", "every": 2}}
RESTORE_AT = [0, 4, N]


def record(path: Any, mode: str, edit_at: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """N iterations; ``edit_at``: the frozen base is changed (halved) right before that iteration."""
    o = build(1)
    snaps: list[dict[str, Any]] = []
    with stepdump.Recorder(path, o["model"], o["optimizer"], o["scheduler"], on_error="raise", **MODES[mode]):
        for t in range(N):
            if t == edit_at:
                with torch.no_grad():
                    o["model"][2].base.weight.mul_(0.5)
            iteration(t, o, lambda: snaps.append(state(o)["model"]))
    snaps.append(state(o)["model"])
    return snaps, state(o)


def stored_bytes(path: Any, names: list[str]) -> tuple[int, int]:
    """(distinct stored bytes, bytes the rows name: what storing each full step's tensor again costs)
    of the params ``names``."""
    marks = ",".join("?" * len(names))
    where = f"FROM tensors t JOIN series s ON s.id = t.series JOIN blobs b ON b.id = t.blob " \
            f"WHERE s.kind = 'params' AND s.name IN ({marks})"
    distinct = catalog_sql(path, f"SELECT total(length) FROM blobs WHERE id IN (SELECT t.blob {where})", names)
    named = catalog_sql(path, f"SELECT total(b.raw_length) {where}", names)
    return int(distinct[0][0]), int(named[0][0])


@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_base_is_stored_once_and_every_step_reads_bitwise(tmp_path, mode):
    snaps, _ = record(tmp_path / "run", mode)
    run = stepdump.open(tmp_path / "run")
    frozen = frozen_names(build(1)["model"])
    base_bytes = sum(p.numel() * p.element_size() for n, p in build(1)["model"].named_parameters() if n in frozen)
    distinct, named = stored_bytes(tmp_path / "run", frozen)
    full_steps = [s for s in run.catalog.steps(2)]
    if mode.startswith("once"):
        assert distinct == base_bytes, f"the base is stored {distinct / base_bytes:.2f} times"
        assert named == base_bytes * len(full_steps), "every full step names the base"
        for s in run.steps:
            assert_same_tree(dict(run.state_dict(s)), snaps[s], f"state_dict({s})")
    else:
        assert distinct == 0 and named == 0, "frozen='fingerprint' stores no base bytes"
        for s in full_steps:  # the base by fingerprint at every full step, the adapters in full
            fps = run.fingerprints(s, ["params"])
            assert all(("params", n) in fps for n in frozen), f"step {s} lacks base fingerprints"
            for n in run.stored_names(s, "params"):
                assert n not in frozen
                assert_same(run.tensor(n, s), snaps[s][n], f"step {s} {n}")


@pytest.mark.parametrize("mode", list(MODES))
def test_restore_onto_a_rebuilt_base_continues_bitwise(tmp_path, mode):
    _, want = record(tmp_path / "run", mode)
    run = stepdump.open(tmp_path / "run")
    for k in RESTORE_AT:
        if k not in run.steps:
            continue
        o = build(adapter_seed=50 + k)  # the same base weights, fresh adapters
        run.restore(k, o["model"], o["optimizer"], o["scheduler"])
        for t in range(k, N):
            iteration(t, o)
        assert_same_tree(state(o), want, f"restore({k}) onto a rebuilt base + continue")


def test_a_different_base_is_refused_naming_the_tensor(tmp_path):
    record(tmp_path / "run", "fingerprint-full")
    run = stepdump.open(tmp_path / "run")
    o = build(adapter_seed=7, base_seed=3)  # other base weights
    before = state(o)
    with pytest.raises(stepdump.RestoreMismatchError, match=r"frozen '0\.base\.weight' differs"):
        run.restore(4, o["model"], o["optimizer"], o["scheduler"])
    assert_same_tree(state(o), before, "nothing changed")
    # One tensor off by one bit is found too, and named.
    o = build(adapter_seed=7)
    with torch.no_grad():
        w = o["model"][2].base.bias
        w.view(torch.int32)[5] ^= 1
    with pytest.raises(stepdump.RestoreMismatchError, match=r"frozen '2\.base\.bias' differs"):
        run.restore(4, o["model"], o["optimizer"], o["scheduler"])


def test_a_recorded_base_is_loaded_when_the_run_holds_it(tmp_path):
    """frozen='once': the run holds the base, so restore loads it whatever base it is given."""
    _, want = record(tmp_path / "run", "once-full")
    run = stepdump.open(tmp_path / "run")
    o = build(adapter_seed=7, base_seed=3)
    run.restore(4, o["model"], o["optimizer"], o["scheduler"])
    for t in range(4, N):
        iteration(t, o)
    assert_same_tree(state(o), want, "restore into another base + continue")


@pytest.mark.parametrize("mode", ["once-full", "once-every2", "once-gradlog3", "fingerprint-full"])
def test_a_base_changed_mid_run_is_never_read_as_the_old_one(tmp_path, mode):
    snaps, want = record(tmp_path / "run", mode, edit_at=3)
    run = stepdump.open(tmp_path / "run")
    name = "2.base.weight"
    before, after = run.fingerprints(0, ["params"])[("params", name)], run.fingerprints(N, ["params"])[("params", name)]
    assert before != after, "the changed base has its own fingerprint"
    if mode.startswith("once"):
        distinct = catalog_sql(tmp_path / "run", "SELECT count(DISTINCT t.blob) FROM tensors t JOIN series s ON "
                               "s.id = t.series WHERE s.kind = 'params' AND s.name = ?", (name,))[0][0]
        assert distinct == 2, f"the changed base is stored again: {distinct} blobs"
        for s in run.steps:
            assert_same(run.state_dict(s)[name], snaps[s][name], f"step {s}")
        return
    o = build(adapter_seed=9)  # the original base: differs from the record after the edit
    with pytest.raises(stepdump.RestoreMismatchError, match=r"frozen '2\.base\.weight' differs"):
        run.restore(5, o["model"], o["optimizer"], o["scheduler"])
    run.restore(2, o["model"], o["optimizer"], o["scheduler"])  # before the edit the original base matches
    o2 = build(adapter_seed=9)
    with torch.no_grad():
        o2["model"][2].base.weight.mul_(0.5)
    run.restore(5, o2["model"], o2["optimizer"], o2["scheduler"])
    for t in range(5, N):
        iteration(t, o2)
    assert_same_tree(state(o2), want, "restore(5) onto the edited base + continue")
