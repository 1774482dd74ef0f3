"""Comparison under nondeterminism (issue 24 item 6): ``diff(a, b, noise=[a2, a3])``.

Repeats of one configuration that differ from step 0 (here: a perturbation injected into one
activation, different in each repeat, as nondeterministic kernels would make it) are the noise; a
quantity counts only where B stands out from A and its repeats with a run-level false-alarm rate of
1% (analysis/noise_stat.py). The injected perturbations are chosen so the verdict does not hang on
this CPU's last bits: B's is half a repeat's, well inside the spread, while the lr change is exact
(spread 0), and the loud B is 1000x a repeat's. With identical repeats the noise-aware diff must give
the exact diff's verdict. (B drawn from the same noise as the repeats, and the old 3x-the-spread
rule's false alarms on it: tests/test_diff_noise_runs.py and tests/test_noise_stat.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import stepdump
from stepdump.cli.main import main

STEPS, LR_AT = 14, 10
EPS = 1e-3  # one repeat's perturbation


class Noisy(nn.Module):
    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c
        self.u = torch.randn(16, generator=torch.Generator().manual_seed(123))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c * self.u


def record(path: Path, c: float, lr_change: bool = False) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), Noisy(c), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with stepdump.Recorder(path, model, opt) as rec:
        for t in range(STEPS):
            if lr_change and t == LR_AT:
                opt.param_groups[0]["lr"] = 0.1
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("noise")
    spec = {"a": (0.0, False), "a2": (EPS, False), "a3": (-EPS, False),  # noisy repeats of A
            "same2": (0.0, False), "same3": (0.0, False),  # identical repeats of A
            "b_lr": (EPS / 2, True),  # within the noise, and the lr doubled at step 10
            "b_quiet": (EPS / 2, False),  # within the noise only
            "b_loud": (1000 * EPS, False),  # 1000x a repeat's perturbation: beyond the noise from step 0
            "exact_lr": (0.0, True)}  # no noise, the lr doubled at step 10
    return {k: record(root / k, c, lr) for k, (c, lr) in spec.items()}


# (B, repeats) -> the noise-aware verdict and the plain diff's; where the repeats are identical they agree.
CASES = [
    ("b_lr", ("a2", "a3"), LR_AT, 0, "lr"),
    ("b_quiet", ("a2", "a3"), None, 0, None),
    ("b_loud", ("a2", "a3"), 0, 0, None),
    ("exact_lr", ("same2", "same3"), LR_AT, LR_AT, "lr"),
    ("b_quiet", ("same2", "same3"), 0, 0, None),
    ("b_lr", ("a2",), LR_AT, 0, "lr"),
]


@pytest.mark.parametrize(("b", "repeats", "noisy_first", "plain_first", "what"), CASES)
def test_noise_aware_diff_names_what_exceeds_the_spread(runs: dict[str, Path], b: str, repeats: tuple[str, ...],
                                                        noisy_first: int | None, plain_first: int,
                                                        what: str | None) -> None:
    a, rb = stepdump.open(runs["a"]), stepdump.open(runs[b])
    plain = stepdump.diff(a, rb)
    assert plain.first_step == plain_first, plain.summary()
    res = stepdump.diff(a, rb, noise=[stepdump.open(runs[r]) for r in repeats])
    assert res.first_step == noisy_first, res.summary()
    assert res.noise is not None and res.noise.repeats == len(repeats) and res.noise.alpha == 0.01
    if noisy_first is None:
        assert res.identical and "within" in res.headline(), res.headline()
        assert not [r for r in res.noise.rows if r.exceeded]
        return
    if what is not None:
        assert res.cause is not None and res.cause.what == what, res.summary()
    exceeded = [r for r in res.noise.rows if r.exceeded]
    assert min(r.step for r in exceeded) == noisy_first
    crit = res.noise.critical
    assert all((crit is not None and r.score > crit) or (r.spread == 0 and r.measure in ("bytes", "value"))
               for r in exceeded), exceeded[:3]
    # Before the first step that counts, every quantity is within the critical value, and there are
    # some (the noise) when the repeats differ.
    before = [r for r in res.noise.rows if r.step < noisy_first]
    assert all(crit is not None and r.score <= crit for r in before)
    assert bool(before) == (repeats[0] == "a2" and noisy_first > 0)
    if repeats[0] == "same2":  # spread 0 everywhere: the exact diff's verdict and cause
        assert res.cause is not None and plain.cause is not None and res.cause.what == plain.cause.what
        assert res.first_step == plain.first_step


def test_noise_reading_says_the_spread(runs: dict[str, Path]) -> None:
    res = stepdump.diff(stepdump.open(runs["a"]), stepdump.open(runs["b_loud"]),
                        noise=[stepdump.open(runs["a2"]), stepdump.open(runs["a3"])])
    assert "standard deviations of the noise" in res.reading and "1% false alarms" in res.reading, res.reading
    assert res.noise is not None
    row = next(r for r in res.noise.rows if r.exceeded)
    assert res.noise.critical is not None and row.spread > 0
    assert row.step == 0 and row.score > res.noise.critical, row


def test_noise_refuses_tolerances(runs: dict[str, Path]) -> None:
    with pytest.raises(stepdump.ConfigError, match="noise"):
        stepdump.diff(stepdump.open(runs["a"]), stepdump.open(runs["b_lr"]), atol=1e-3,
                      noise=[stepdump.open(runs["a2"])])


@pytest.mark.parametrize(("noise", "code", "words"), [([], 1, "step 0"), (["a2", "a3"], 1, "step 10"),
                                                      (["same2"], 1, "step 10")])
def test_cli_diff_noise(runs: dict[str, Path], capsys: pytest.CaptureFixture[str], noise: list[str], code: int,
                        words: str) -> None:
    b = "b_lr" if noise != ["same2"] else "exact_lr"
    args = ["diff", str(runs["a"]), str(runs[b])] + (["--noise", *[str(runs[n]) for n in noise]] if noise else [])
    assert main(args) == code
    out = capsys.readouterr().out
    assert f"diverge at {words}" in out, out
    if noise:
        assert "repeat" in out


def test_cli_diff_noise_json(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["diff", str(runs["a"]), str(runs["b_loud"]), "--noise", str(runs["a2"]), str(runs["a3"]),
                 "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["first_step"] == 0 and got["noise"]["repeats"] == 2 and got["noise"]["alpha"] == 0.01
    assert got["noise"]["tests"] > 0 and got["noise"]["critical"] > 1
    assert any(r["exceeded"] and r["step"] == 0 for r in got["noise"]["rows"])
