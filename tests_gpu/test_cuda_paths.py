"""The CUDA paths that are built today, on a real GPU (``make test-gpu``; not part of ``make test``).

One case per optimizer configuration of ``benchmarks/cuda_check.py`` (the checks live once, in
cuda_workloads.py): AdamW foreach and fused, Adam(capturable=True), SGD with sparse embedding
grads and momentum, LBFGS with a closure, fp16 autocast + GradScaler with a skipped step. Each
asserts pinned staging, records bitwise equal to the live tensors at every step, training
unchanged, device stats against CPU stats, and restore continuing bitwise (see
:func:`cuda_workloads.fidelity`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_workloads import DEV, KINDS, fidelity

from stepdump.core.stats import STATS_LEN, compute_stats, device_stats


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_fidelity(kind: str, tmp_path: Path) -> None:
    fidelity(kind, tmp_path)


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CASES = [(d, c) for d in [*FLOATS, torch.int64] for c in ("normal", "nonfinite", "constant", "empty", "single")
         if not (c == "nonfinite" and d == torch.int64)]  # an integer has no NaN or Inf


@pytest.mark.parametrize(("dtype", "case"), CASES)
def test_device_stats_on_cuda_agree_with_cpu(dtype: torch.dtype, case: str) -> None:
    """device_stats on the GPU vs compute_stats on the CPU copy: counts exact, values to 1e-5."""
    g = torch.Generator().manual_seed(0)
    n = {"empty": 0, "single": 1}.get(case, 10_000)
    x = (torch.randn(n, generator=g) * 3).to(dtype) if dtype.is_floating_point else torch.randint(-50, 50, (n,), generator=g)
    if case == "constant":
        x = torch.full((n,), 2, dtype=dtype)
    if case == "nonfinite":
        x[::7] = float("nan")
        x[1::11] = float("inf")
        x[2::13] = float("-inf")
    got = device_stats(x.to(DEV)).cpu()
    assert got.shape == (STATS_LEN,) and got.dtype == torch.float64
    ref = compute_stats(x)
    assert [int(v) for v in got[:4]] == list(ref[:4]), (got[:4], ref[:4])
    for i in range(4, STATS_LEN):
        want = ref[i]
        if want is None:
            assert torch.isnan(got[i]), (i, got[i])
        else:
            assert abs(float(got[i]) - want) <= 1e-5 * max(1.0, abs(want)), (i, float(got[i]), want)


def test_peak_memory_is_max_memory_allocated_then_reset() -> None:
    """sys/peak_memory_mb on CUDA reads the allocator's nested statistics directly: the same number
    torch.cuda.max_memory_allocated gives, and the peak is reset after it."""
    from stepdump.capture.profiling import peak_memory_mb

    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    x = torch.empty(3 * 2**20, device=dev)
    del x
    want = torch.cuda.max_memory_allocated(dev)
    assert want >= 12 * 2**20
    assert peak_memory_mb(dev) == want / 2**20
    assert torch.cuda.max_memory_allocated(dev) == torch.cuda.memory_allocated(dev)
