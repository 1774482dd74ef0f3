"""Extra state (issue 28 item 2): EMA / averaged models and any object with state_dict /
load_state_dict, recorded with ``Recorder(extra_state={...})`` and restored by ``restore``.

One loop, three objects updated right after ``optimizer.step()`` as their docs say:
``ema`` (AveragedModel, get_ema_multi_avg_fn, use_buffers: BatchNorm stats averaged too),
``swa`` (AveragedModel with its default average, updated every other step) and ``shadow``
(a torch-ema-style shadow of the params, a class of this test). Every mode (full, every=3,
keyframes, gradient log) must hold each object's state bitwise as it was when each update
began; restore + continue from several steps must end bitwise where the uninterrupted run
ended, the objects included. A gradient log rebuilds the AveragedModels between keyframes
(verified) and refuses the shadow, whose update rule it does not know.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, optimizer_state_clone, regression_batch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import stepdump

N = 8


class Shadow:
    """torch-ema's ExponentialMovingAverage in miniature: shadow params, a decay and a counter."""

    def __init__(self, params: Any, decay: float = 0.8) -> None:
        self.decay = decay
        self.num_updates = 0
        self.shadow_params = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: Any) -> None:
        self.num_updates += 1
        decay = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        for s, p in zip(self.shadow_params, params, strict=True):
            s.sub_((1 - decay) * (s - p))

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow_params": self.shadow_params}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.decay, self.num_updates = sd["decay"], sd["num_updates"]
        for s, v in zip(self.shadow_params, sd["shadow_params"], strict=True):
            s.copy_(v)


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    extra = {"ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
             "swa": AveragedModel(model), "shadow": Shadow(model.parameters())}
    return {"model": model, "optimizer": opt, "scheduler": sched, "extra_state": extra}


def iteration(t: int, o: dict[str, Any], before_step: Any = None) -> None:
    model, opt = o["model"], o["optimizer"]
    x, y = regression_batch(t, n=16, d_in=8, d_out=4)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    loss.backward()
    if before_step is not None:
        before_step()
    opt.step()
    o["scheduler"].step()
    o["extra_state"]["ema"].update_parameters(model)
    if t % 2 == 1:
        o["extra_state"]["swa"].update_parameters(model)
    o["extra_state"]["shadow"].update(model.parameters())


def state_of(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return {k: v.detach().clone() for k, v in obj.state_dict().items()}
    return {"decay": obj.decay, "num_updates": obj.num_updates, "shadow_params": [p.clone() for p in obj.shadow_params]}


def everything(o: dict[str, Any]) -> dict[str, Any]:
    return {"model": state_of(o["model"]), "optimizer": optimizer_state_clone(o["optimizer"]),
            "scheduler": o["scheduler"].state_dict(),
            "extra": {n: state_of(obj) for n, obj in o["extra_state"].items()}}


MODES = {"full": {}, "every3": {"every": 3}, "keyframes3": {"keyframe_every": 3}, "gradlog3": {"gradient_log": 3}}
# Steps restored per mode (N is the final record); gradlog3's 4 and 5 lie between keyframes.
RESTORE_AT = {"full": [0, 5, N], "every3": [3, 6, N], "keyframes3": [3, N], "gradlog3": [4, 5, N]}


def record(path: Any, mode: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Record N iterations; return each object's state at each pre-step moment (+ the final) and
    everything at the end."""
    o = build(0)
    snaps: list[dict[str, Any]] = []
    with stepdump.Recorder(path, o["model"], o["optimizer"], o["scheduler"], extra_state=o["extra_state"],
                           on_error="raise", **MODES[mode]):
        for t in range(N):
            iteration(t, o, lambda: snaps.append({n: state_of(x) for n, x in o["extra_state"].items()}))
    snaps.append({n: state_of(x) for n, x in o["extra_state"].items()})
    return snaps, everything(o)


@pytest.mark.parametrize("mode", list(MODES))
def test_extra_state_is_recorded_bitwise(tmp_path, mode):
    snaps, _ = record(tmp_path / "run", mode)
    run = stepdump.open(tmp_path / "run")
    assert set(run.meta["extra_state"]) == {"ema", "swa", "shadow"}
    log = run.gradient_log
    readable = sorted(set(run.steps) | (set(log.readable_steps()) if log is not None else set()))
    assert N in readable and (mode != "gradlog3" or len(readable) == N + 1)
    for s in readable:
        between = log is not None and s not in log.keyframes()
        for name in ("ema", "swa", "shadow"):
            if between and name == "shadow":
                with pytest.raises(stepdump.StepdumpError, match="knows no update rule"):
                    run.extra_state_dict(s, name)
                continue
            assert_same_tree(run.extra_state_dict(s, name), snaps[s][name], f"step {s} {name}")


@pytest.mark.parametrize("mode", list(MODES))
def test_restore_and_continue_with_extra_state_is_bitwise(tmp_path, mode):
    _, want = record(tmp_path / "run", mode)
    run = stepdump.open(tmp_path / "run")
    for k in RESTORE_AT[mode]:
        o = build(100 + k)  # fresh objects that match nothing by accident
        given = dict(o["extra_state"])
        if run.gradient_log is not None and k not in run.gradient_log.keyframes():
            given.pop("shadow")  # not rebuilt between keyframes (its update rule is unknown)
        run.restore(k, o["model"], o["optimizer"], o["scheduler"], extra_state=given)
        for t in range(k, N):
            iteration(t, o)
        got = everything(o)
        if "shadow" not in given:
            got["extra"].pop("shadow")
            assert_same_tree(got, {**want, "extra": {n: v for n, v in want["extra"].items() if n != "shadow"}},
                             f"restore({k}) + continue")
        else:
            assert_same_tree(got, want, f"restore({k}) + continue")


def test_restore_says_what_was_not_given_and_refuses_what_the_run_does_not_hold(tmp_path, caplog):
    record(tmp_path / "run", "full")
    run = stepdump.open(tmp_path / "run")
    o = build(5)
    before = everything(o)
    with pytest.raises(stepdump.RestoreMismatchError, match="'teacher'"):
        run.restore(2, o["model"], o["optimizer"], o["scheduler"], extra_state={**o["extra_state"], "teacher": nn.Linear(2, 2)})
    assert_same_tree(everything(o), before, "after the refused restore")
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        run.restore(2, o["model"], o["optimizer"], o["scheduler"], extra_state={"ema": o["extra_state"]["ema"]})
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'swa', 'shadow'" in said and "not given" in said, said
    assert_same(o["extra_state"]["ema"].n_averaged, torch.tensor(2), "ema restored")
    assert o["extra_state"]["shadow"].num_updates == 0, "shadow left as it is"


def test_gradient_log_refuses_an_ema_it_cannot_reproduce(tmp_path):
    """An AveragedModel updated twice an iteration: the rebuild (one update per step) does not give the
    recorded fingerprints, so it is refused, naming the tensor; keyframes still read."""
    o = build(0)
    with stepdump.Recorder(tmp_path / "run", o["model"], o["optimizer"], o["scheduler"], extra_state=o["extra_state"],
                           on_error="raise", gradient_log=4):
        for t in range(6):
            iteration(t, o)
            o["extra_state"]["ema"].update_parameters(o["model"])
    run = stepdump.open(tmp_path / "run")
    with pytest.raises(stepdump.RebuildError, match="differs from its recorded fingerprint") as err:
        run.extra_state_dict(2, "ema")
    assert err.value.kind == "extra" and err.value.step == 1
    assert_same_tree(run.extra_state_dict(4, "ema")["n_averaged"], torch.tensor(8))


@pytest.mark.parametrize("mode", list(MODES))
def test_training_with_extra_state_recorded_is_unchanged(tmp_path, mode):
    """Do no harm: the same loop without a Recorder ends bitwise where the recorded one did."""
    _, recorded = record(tmp_path / "run", mode)
    o = build(0)
    for t in range(N):
        iteration(t, o)
    assert_same_tree(everything(o), recorded, "training with extra_state recorded")
