"""The noise-aware diff on recorded runs whose noise is the same size in every run.

A small transformer block whose forward adds fresh noise at every step, from a generator seeded
differently in each run (as OS-seeded noise, made reproducible), all runs at the same size. B that
is just another such run must read "no difference beyond the noise" (the rule "3x the largest
difference among A and its repeats" flagged it at step 0: about 4% of quantities exceed it with two
repeats, and there are dozens per step); a B whose lr is doubled at step 8, whose one layer is
initialised otherwise, or whose data order changes at step 8 must be named at its step with its
cause. The verdicts keep a wide margin (scores against the critical value), so they do not hang on
this CPU's last bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stepdump
from stepdump.cli.main import main

STEPS, CHANGE_AT, EPS = 16, 8, 1e-4


class Noisy(nn.Module):
    """Adds ``eps * N(0, 1)`` noise, drawn from its own generator (one seed per run)."""

    def __init__(self, eps: float, seed: int) -> None:
        super().__init__()
        self.eps = eps
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.eps * torch.randn(x.shape, generator=self.gen)


class Block(nn.Module):
    def __init__(self, noise_seed: int) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.noise = Noisy(EPS, noise_seed)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.noise(self.emb(x))).mean(1))


def record(path: Path, noise_seed: int, change: str | None = None) -> Path:
    torch.manual_seed(0)
    model = Block(noise_seed)
    if change == "init":
        with torch.no_grad():  # one layer initialised from another seed
            model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(7)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    order = list(range(STEPS))
    if change == "order":  # from step CHANGE_AT on, the batches come in another order
        order[CHANGE_AT:] = reversed(order[CHANGE_AT:])
    with stepdump.Recorder(path, model, opt) as rec:
        for t in range(STEPS):
            if change == "lr" and t == CHANGE_AT:
                opt.param_groups[0]["lr"] = 2e-2
            g = torch.Generator().manual_seed(1000 + order[t])
            x, y = torch.randn(8, 5, 6, generator=g), torch.randn(8, 2, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("noiseruns")
    spec = {"a": (1, None), "a2": (2, None), "a3": (3, None), "b": (4, None),
            "lr": (5, "lr"), "init": (6, "init"), "order": (8, "order")}
    return {k: record(root / k, seed, change) for k, (seed, change) in spec.items()}


def _diff(runs: dict[str, Path], b: str, repeats: tuple[str, ...] = ("a2", "a3"), **kw: Any) -> stepdump.types.DiffResult:
    a, rb = stepdump.open(runs["a"]), stepdump.open(runs[b])
    return stepdump.diff(a, rb, noise=[stepdump.open(runs[r]) for r in repeats], **kw)


def test_another_repeat_is_no_difference(runs: dict[str, Path]) -> None:
    """B is a repeat like A2 and A3: the 3x-spread rule said "diverge at step 0"."""
    plain = stepdump.diff(stepdump.open(runs["a"]), stepdump.open(runs["b"]))
    assert plain.first_step == 0  # the noise is there from step 0
    res = _diff(runs, "b")
    assert res.first_step is None, res.summary()
    assert res.identical and "no difference beyond the noise" in res.headline(), res.headline()
    assert res.noise is not None and res.noise.alpha == 0.01 and res.noise.tests > 500
    assert not res.noise.exceeded
    assert "1%" in " ".join(res.notes)


def test_lr_doubled_is_named_at_its_step(runs: dict[str, Path]) -> None:
    res = _diff(runs, "lr")
    assert res.first_step == CHANGE_AT and res.cause is not None and res.cause.what == "lr", res.summary()
    # Without the recorded hyperparameters the change shows in the params the doubled update made.
    res = _diff(runs, "lr", ignore="hyperparameters")
    assert res.first_step == CHANGE_AT + 1, res.summary()
    assert res.cause is not None and res.cause.what.startswith("params "), res.summary()
    assert res.noise is not None
    rows = [r for r in res.noise.exceeded if r.step == CHANGE_AT + 1]
    assert max(r.score for r in rows) > 10 * res.noise.critical


def test_one_layer_initialised_otherwise_is_named_at_step_0(runs: dict[str, Path]) -> None:
    res = _diff(runs, "init")
    assert res.first_step == 0 and res.cause is not None, res.summary()
    assert res.cause.what == "params head.weight", res.summary()


def test_data_order_change_is_named_at_its_step(runs: dict[str, Path]) -> None:
    res = _diff(runs, "order")
    assert res.first_step == CHANGE_AT, res.summary()
    assert res.cause is not None and (res.cause.what == "loss" or res.cause.what.startswith("grads ")), res.summary()
    assert res.noise is not None
    assert max(r.score for r in res.noise.exceeded) > 10 * res.noise.critical


@pytest.mark.parametrize(("b", "code", "words"), [("b", 0, "no difference beyond the noise"),
                                                  ("lr", 1, f"diverge at step {CHANGE_AT}")])
def test_cli(runs: dict[str, Path], capsys: pytest.CaptureFixture[str], b: str, code: int, words: str) -> None:
    args = ["diff", str(runs["a"]), str(runs[b]), "--noise", str(runs["a2"]), str(runs["a3"])]
    assert main(args) == code
    out = capsys.readouterr().out
    assert words in out and "1%" in out, out


def test_one_repeat_says_what_it_can_see(runs: dict[str, Path]) -> None:
    """One repeat still holds the rate, at the price of a huge critical value, and says so."""
    res = _diff(runs, "b", repeats=("a2",))
    assert res.first_step is None and res.noise is not None and res.noise.critical is not None
    assert res.noise.critical > 1e4
    assert any("only changes beyond about" in n and "repeats would see" in n for n in res.notes), res.notes
    assert _diff(runs, "lr", repeats=("a2",)).first_step == CHANGE_AT  # the lr, compared exactly


def test_bad_false_alarm_rate_is_refused(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(stepdump.ConfigError, match="false-alarm rate"):
        _diff(runs, "b", noise_alpha=0.0)
    assert main(["diff", str(runs["a"]), str(runs["b"]), "--noise", str(runs["a2"]), "--noise-alpha", "1.5"]) == 2
    assert "false-alarm rate" in capsys.readouterr().err
