"""The noise-aware diff's decision (analysis/noise_stat.py), simulated: its false-alarm rate over a
whole run, and what it finds.

Runs are simulated as arrays (steps x quantities), A, k repeats and B drawn from the same noise:
per quantity a scale spread over two orders of magnitude, a factor shared by all quantities of a run
at a step (a run whose noise is large is far out everywhere), and a random walk over steps (noise
grows as runs drift apart). "No difference beyond the noise" must hold in at least 99% of 300 seeded
trials for every noise size, quantity count and distribution below, where the rule it replaces (3x
the largest difference among A and its repeats, per quantity and step) fires in nearly every trial.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepdump.analysis.noise_stat import critical_value, noise_test, t_tail
from stepdump.errors import ConfigError

TRIALS = 300


def simulate(rng: np.random.Generator, runs: int, steps: int, quantities: int, sigma: float, dist: str = "normal",
             rho: float = 0.8, float32: bool = False, with_scale: bool = False) -> Any:
    """``runs`` runs of one noise: shape (runs, steps, quantities). A quantity's standard deviation at
    step t is ``scale[q] * sqrt((t + 1) / steps)`` (returned too, with ``with_scale``)."""
    def draw(shape: tuple[int, ...]) -> np.ndarray:
        if dist == "laplace":
            return rng.laplace(0.0, 1 / math.sqrt(2), shape).astype(np.float32)
        if dist == "uniform":
            return rng.uniform(-math.sqrt(3), math.sqrt(3), shape).astype(np.float32)
        return rng.standard_normal(shape, dtype=np.float32)
    scale = sigma * np.exp(rng.uniform(-2.3, 2.3, quantities))
    base = rng.uniform(0.5, 2.0, (steps, quantities))
    step_noise = rho * draw((runs, steps, 1)) + math.sqrt(1 - rho * rho) * draw((runs, steps, quantities))
    x = base + scale * np.cumsum(step_noise, axis=1, dtype=np.float64) / math.sqrt(steps)
    x = x.astype(np.float32).astype(np.float64) if float32 else x
    return (x, scale) if with_scale else x


def old_rule(a: np.ndarray, reps: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The replaced rule: |B - A| > 3x the largest difference among A and its repeats."""
    xs = np.concatenate([a[None], reps])
    return np.abs(b - a) > 3 * (xs.max(axis=0) - xs.min(axis=0))


def test_t_tail_matches_closed_forms() -> None:
    for t in (0.3, 2.0, 40.0, 1e5):
        assert t_tail(t, 1) == pytest.approx(2 * math.atan(1 / t) / math.pi, rel=1e-12)
        assert t_tail(t, 2) == pytest.approx(2 / (math.sqrt(2 + t * t) * (math.sqrt(2 + t * t) + t)), rel=1e-12)
    assert t_tail(4.0, 100_000) == pytest.approx(math.erfc(4 / math.sqrt(2)), rel=1e-3)  # the normal limit
    assert t_tail(0.0, 3) == 1.0 and t_tail(math.inf, 3) == 0.0


# The table in docs/cli.md: how many standard deviations B must be off to count, alpha 1%, 10,000 tests.
@pytest.mark.parametrize(("k", "c"), [(1, 636620), (2, 1000), (3, 130.2), (5, 28.5), (8, 13.26), (16, 7.64)])
def test_critical_values(k: int, c: float) -> None:
    got = critical_value(0.01, 10_000, k)
    assert got == pytest.approx(c, rel=2e-3)
    assert t_tail(got, k) == pytest.approx(0.01 / 10_000, rel=1e-6)


def test_refuses_bad_input() -> None:
    a = np.zeros((3, 2))
    with pytest.raises(ConfigError, match="between 0 and 1"):
        noise_test(a, a[None], a, alpha=0.0)
    with pytest.raises(ConfigError, match="k >= 1"):
        noise_test(a, np.zeros((0, 3, 2)), a)


def test_old_rule_fires_on_noise() -> None:
    """Per quantity: about 18%, 4%, 1% with 1, 2, 3 repeats (B exchangeable with them)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 200_000))
    for k, rate in ((1, 0.184), (2, 0.040), (3, 0.012)):
        got = old_rule(x[0], x[1:k + 1], x[4]).mean()
        assert got == pytest.approx(rate, abs=0.006), (k, got)


NULL = [  # (repeats, steps, quantities, noise size, distribution, float32 values, the old rule fires in at least)
    (2, 500, 20, 1e-3, "normal", False, 0.95),
    (3, 200, 100, 1.0, "normal", False, 0.95),
    (3, 20, 2000, 1e-5, "normal", False, 0.95),
    (2, 100, 300, 1e-7, "normal", True, 0.95),  # noise below float32's resolution: values coincide after rounding
    (4, 100, 100, 1e-3, "laplace", False, 0.9),  # heavier tails than the normal model
    (5, 100, 100, 1e-2, "uniform", False, 0.5),  # bounded: the old rule's 3x the range fires less
]
#: At most this many false alarms in 300 trials is consistent with a rate of 1% (P(10 or more) = 0.1%).
PER_CONFIG = 9


@pytest.fixture(scope="module")
def null_study() -> dict[int, tuple[int, int]]:
    """config index -> (false alarms of the new decision, runs where the old rule fired), over 300 trials."""
    out = {}
    for i, (k, steps, quantities, sigma, dist, f32, _) in enumerate(NULL):
        rng = np.random.default_rng(1000 + i)
        false_alarms = old_fires = 0
        for _ in range(TRIALS):
            x = simulate(rng, k + 2, steps, quantities, sigma, dist, float32=f32)
            res = noise_test(x[0], x[1:k + 1], x[k + 1], resolution=np.abs(x[0]) * 2.0 ** -23)
            assert res.tests == steps * quantities and res.alpha == 0.01
            false_alarms += res.first_step is not None
            old_fires += bool(old_rule(x[0], x[1:k + 1], x[k + 1]).any())
        out[i] = (false_alarms, old_fires)
    return out


@pytest.mark.parametrize("i", range(len(NULL)), ids=[f"k{c[0]}-{c[1]}x{c[2]}-{c[4]}{'-f32' if c[5] else ''}"
                                                    for c in NULL])
def test_another_repeat_is_no_difference(null_study: dict[int, tuple[int, int]], i: int) -> None:
    false_alarms, old_fires = null_study[i]
    assert false_alarms <= PER_CONFIG, false_alarms
    assert old_fires >= NULL[i][-1] * TRIALS, old_fires


def test_another_repeat_is_no_difference_in_99_percent_of_runs(null_study: dict[int, tuple[int, int]]) -> None:
    """Over all 1,800 simulated runs: "no difference beyond the noise" in at least 99%."""
    false_alarms = sum(f for f, _ in null_study.values())
    assert false_alarms <= 0.01 * TRIALS * len(NULL), null_study
    assert sum(o for _, o in null_study.values()) >= 0.85 * TRIALS * len(NULL)


@pytest.mark.parametrize(("k", "times", "power"), [(3, 4.0, 0.98), (8, 2.0, 0.98), (8, 1.5, 0.95)])
def test_a_change_is_named_at_its_step(k: int, times: float, power: float) -> None:
    """One quantity of B moves from step 60 on by ``times`` x the critical value x its noise's standard
    deviation there: named at step 60 in at least ``power`` of the trials; a step before it named no
    more often than the false-alarm rate allows."""
    steps, quantities, at = 100, 100, 60
    rng = np.random.default_rng(k)
    c = critical_value(0.01, steps * quantities, k)
    hits = early = 0
    for _ in range(TRIALS):
        x, scale = simulate(rng, k + 2, steps, quantities, 1e-3, with_scale=True)
        q = int(rng.integers(quantities))
        b = x[k + 1].copy()
        b[at:, q] += times * c * math.sqrt(1 + 1 / (k + 1)) * scale[q] * math.sqrt((at + 1) / steps)
        res = noise_test(x[0], x[1:k + 1], b, resolution=np.abs(x[0]) * 2.0 ** -23)
        hits += res.first_step == at and bool(res.exceeded[at, q])
        early += res.first_step is not None and res.first_step < at
    assert early <= PER_CONFIG, early
    assert hits >= power * TRIALS, hits


def test_docs_table_is_the_critical_values() -> None:
    """docs/cli.md's "How many repeats" table: c = critical value x sqrt(1 + 1/(k+1)), alpha 1%."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| tests (quantities x steps) |"))
    ks = [int(w.split()[0]) for w in lines[at].strip("|").split("|")[1:]]
    rows = [line for line in lines[at + 2:at + 6] if re.match(r"\| [\d,]+ \| ", line)]
    assert len(rows) == 4
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        tests = int(cells[0].replace(",", ""))
        for k, cell in zip(ks, cells[1:], strict=True):
            shown = float(cell.replace(",", "").replace("M", "e6"))
            want = critical_value(0.01, tests, k) * math.sqrt(1 + 1 / (k + 1))
            assert shown == pytest.approx(want, rel=0.04), (tests, k, shown, want)
