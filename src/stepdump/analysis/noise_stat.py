"""The decision behind the noise-aware diff: is B another repeat of A, with a stated error rate?

Pure functions over arrays (numpy), so that the false-alarm rate can be simulated without runs.

The data: for each of S steps and Q quantities (a scalar, a tensor's norm), the value in run A,
in each of its k repeats, and in run B. The null hypothesis is "B is another repeat": then A, the
repeats and B are draws of the same run-to-run noise.

Why not ranks alone. Under the null the k + 2 runs are exchangeable, so B's rank among them is
uniform, but only the *runs* are exchangeable units: the quantities of one run are not independent
of each other (a run whose noise happened to be large is far out in every tensor it touches), nor
are its steps. A test that uses exchangeability alone therefore cannot tell B apart from the other
runs with a false-alarm rate below ``1 / (k + 2)`` for the whole run, whatever it combines: a 1%
rate would need 98 repeats.

So each quantity is modelled as normal across runs (its own mean and spread, any correlation
between quantities and steps): B's deviation from the mean of A and its repeats, divided by their
standard deviation and by ``sqrt(1 + 1/(k+1))``, is then Student's t with k degrees of freedom,
exactly, whatever k is. Every quantity at every step is one test; with M tests in the run, a
quantity counts where its two-sided p-value is below ``alpha / M`` (Bonferroni, valid under any
dependence between the tests), so the probability that B, another repeat, is flagged anywhere in
the run is at most ``alpha``. The first step with a flag is the reported divergence; a flag
before a real change is a false alarm, so that too happens with probability at most ``alpha``.

The price is the critical value (:func:`critical_value`): how many standard deviations of the
repeats B must be away to count. With ``alpha = 0.01`` and M = 10,000 tests it is 1,000 with k = 2
repeats, 130 with 3, 28.5 with 5, 13.3 with 8 and 7.6 with 16; ten times more tests raise it by
about ``10 ** (1 / k)``. Few repeats see only changes far beyond the noise.

A norm or value rounded to float32 cannot show a spread below its own resolution, so the standard
deviation used is at least ``resolution`` (where the repeats coincide after rounding, B one unit
off is not a difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stepdump.errors import ConfigError

#: The default run-level false-alarm rate.
ALPHA = 0.01


def t_tail(t: float, df: int) -> float:
    """``P(|T| > t)`` for Student's t with ``df`` degrees of freedom (precise for tiny tails).

    Args:
        t: A value >= 0.
        df: Degrees of freedom, >= 1.
    """
    if t <= 0:
        return 1.0
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta ``I_x(a, b)``, by its continued fraction (Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


@lru_cache(maxsize=256)
def critical_value(alpha: float, tests: int, df: int) -> float:
    """The ``|t|`` above which a quantity counts: ``t_tail(c, df) = alpha / tests``.

    Args:
        alpha: Run-level false-alarm rate, in (0, 1).
        tests: How many quantity-step tests the run makes (>= 1).
        df: Degrees of freedom: the number of repeats of A.
    """
    p = alpha / max(tests, 1)
    lo, hi = 0.0, 1.0
    while t_tail(hi, df) > p:
        hi *= 2.0
    for _ in range(200):  # bisection in log space: the tail spans hundreds of decades
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
        if t_tail(mid, df) > p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


@dataclass(frozen=True)
class NoiseTest:
    """The decision over a whole run: which quantities at which steps are beyond the noise.

    Arrays are ``(steps, quantities)``; ``score`` and ``sd`` are NaN where nothing was tested.
    ``score`` is ``|B - mean(A, repeats)| / (sd * sqrt(1 + 1/(k+1)))``, Student's t with k
    degrees of freedom under "B is another repeat"; a quantity counts where it exceeds
    ``critical``.
    """

    alpha: float
    repeats: int
    tests: int
    critical: float
    mean: np.ndarray
    sd: np.ndarray
    score: np.ndarray
    exceeded: np.ndarray

    @property
    def first_step(self) -> int | None:
        """Index of the first step with a quantity beyond the noise, or None."""
        hit = np.flatnonzero(self.exceeded.any(axis=1))
        return int(hit[0]) if hit.size else None


def check_alpha(alpha: float) -> None:
    """Refuse a false-alarm rate outside (0, 1)."""
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"the noise diff's false-alarm rate must be between 0 and 1 (got {alpha}); 0.01 is the default")


def noise_test(a: np.ndarray, repeats: np.ndarray, b: np.ndarray, *, alpha: float = ALPHA,
               resolution: np.ndarray | float = 0.0, tested: np.ndarray | None = None) -> NoiseTest:
    """Test every quantity at every step: does B stand out from A and its repeats?

    Args:
        a: A's values, shape ``(steps, quantities)``.
        repeats: The repeats' values, shape ``(k, steps, quantities)``, k >= 1.
        b: B's values, shape ``(steps, quantities)``.
        alpha: The run-level false-alarm rate: if B is another repeat (the same normal noise),
            the probability that any quantity at any step counts is at most ``alpha``.
        resolution: The least standard deviation a quantity can show (its rounding), broadcast
            to ``(steps, quantities)``.
        tested: Which entries are tests (default: where A and every repeat are finite). B not
            finite at a tested entry counts.

    Returns:
        A :class:`NoiseTest`.
    """
    check_alpha(alpha)
    a, b, reps = np.asarray(a, np.float64), np.asarray(b, np.float64), np.asarray(repeats, np.float64)
    if reps.ndim != 3 or reps.shape[0] < 1 or reps.shape[1:] != a.shape or b.shape != a.shape:
        raise ConfigError("noise_test needs A and B of shape (steps, quantities) and repeats of shape "
                          "(k >= 1, steps, quantities)")
    k = reps.shape[0]
    xs = np.concatenate([a[None], reps])
    if tested is None:
        tested = np.isfinite(xs).all(axis=0)
    n_tests = int(tested.sum())
    crit = critical_value(alpha, n_tests, k)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = xs.mean(axis=0)
        sd = np.maximum(xs.std(axis=0, ddof=1), np.broadcast_to(np.asarray(resolution, np.float64), a.shape))
        dev = np.abs(b - mean)
        score = np.where(dev == 0, 0.0, dev / (sd * math.sqrt(1.0 + 1.0 / (k + 1))))
    score = np.where(np.isfinite(b), score, np.inf)
    score = np.where(tested, score, np.nan)
    sd = np.where(tested, sd, np.nan)
    exceeded = tested & (score > crit)
    return NoiseTest(alpha, k, n_tests, crit, mean, sd, score, exceeded)
