"""benchmarks/lean_summaries.py (issue 26 item 3): the candidate per-step summaries compute what they
say, and the benchmark's deterministic columns (bytes stored, elements read) follow from the tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import lean_summaries as ls  # noqa: E402
from workloads_tiny import nanogpt_tiny  # noqa: E402


@pytest.mark.parametrize("values, bins", [
    ([0.0, -0.0], {0: 2}),  # zeros: the lowest bin
    ([1e-9, 2.0**-30], {0: 2}),  # below the range: clamped into the lowest bin
    ([1.0, -3.0, 1e6], {15: 3}),  # above: the top bin
    ([2.0**-10, -(2.0**-10) * 1.5], {15: 2}),  # 0.5 * 2**-9 and -0.75 * 2**-9: exponent -9, the top bin
    ([2.0**-21, 2.0**-20], {4: 1, 5: 1}),  # exponents -20 and -19
    ([0.25, float("nan")], None),  # NaN: counted somewhere, never lost
])
def test_loghist16_bins(values: list[float], bins: dict[int, int] | None) -> None:
    h = ls.loghist16(torch.tensor(values))
    assert h.shape == (16,) and int(h.sum()) == len(values)
    if bins is not None:
        for b, n in bins.items():
            assert int(h[b]) == n, (b, h)


@pytest.mark.parametrize("n", [10, 4096, 5000, 100_000])
def test_quantiles5_exact_below_4096_strided_above(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got = ls.quantiles5(x)
    sample = x if n <= ls.SMALL else x[:: -(-n // ls.SMALL)]
    assert sample.numel() <= ls.SMALL
    assert np.array_equal(got, torch.quantile(sample.double(), ls.PROBS).numpy())


def test_meanstd_only_above_4096() -> None:
    assert ls.meanstd(torch.ones(4096)) is None
    x = torch.zeros(5000)
    x[:1000] = 2.0
    mean, std, zero = ls.meanstd(x)  # type: ignore[misc]
    assert (mean, zero) == (0.4, 0.8) and std == pytest.approx(0.8, abs=0)  # sqrt(0.8 - 0.16) = 0.8 exactly


def test_measure_counts_bytes_and_elements_of_the_real_step() -> None:
    out = ls.measure("tiny", nanogpt_tiny, reps=1)
    w = nanogpt_tiny()
    numels = [p.numel() for _, p in w.model.named_parameters()] * 2  # params and their grads
    assert out["tensors"] == len(numels) and out["elements"] == sum(numels)
    assert out["lean_row_bytes_per_step"] == len(numels) * 88
    c = out["candidates"]
    assert c["loghist16"]["bytes_per_step"] == len(numels) * 16 * 8
    assert c["loghist16"]["elements_read_per_step"] == 2 * sum(numels)
    assert c["quantiles5"]["bytes_per_step"] == len(numels) * 5 * 8
    assert c["quantiles5"]["elements_read_per_step"] == sum(min(n, 4096) for n in numels)
    large = [n for n in numels if n > 4096]
    assert c["meanstd"]["bytes_per_step"] == len(large) * 3 * 8 and c["meanstd"]["elements_read_per_step"] == 2 * sum(large)
    assert all(v["ms"] > 0 for v in c.values()) and out["ms"]["lean rows (params+grads)"] > 0
