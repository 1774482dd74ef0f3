"""The fused lean kernel is optional: stepdump imports, and packs, without Triton or a GPU.

The kernel itself is tested by tests_gpu/test_device_lean_triton.py (on the GPU, or here under
Triton's interpreter: docs/cuda.md, "The fused kernel"); this holds, in ``make test``, what a
CPU-only machine relies on: the module imports whether or not Triton is there, ``fused_pack``
declines what it cannot run (None, never an error), and ``lean_pack`` then gives the reference's
bits.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_same

from stepdump.core import device_lean, device_lean_triton
from stepdump.core.stats import STATS_LEN


def test_imports_and_declines_without_triton() -> None:
    """With ``import triton`` failing (as on a machine without it), the module imports and
    fused_pack returns None: a fresh interpreter, so this process's modules are left alone."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # `import triton` raises ImportError from here on
        import torch
        from stepdump.core import device_lean, device_lean_triton as d
        assert d.triton is None and d.tl is None
        t = [torch.arange(10.0), torch.ones(3, dtype=torch.int64)]
        assert d.fused_pack(t) is None and d.fused_pack(t, _allow_cpu=True) is None
        assert torch.equal(device_lean.lean_pack(t), device_lean.reference_pack(t))
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


CPU_LISTS = {
    "fp32": [torch.randn(100, generator=torch.Generator().manual_seed(0))],
    "mixed dtypes": [torch.arange(7, dtype=torch.int64), torch.ones(5, dtype=torch.bfloat16), torch.zeros(0)],
    "with nonfinite": [torch.tensor([1.0, float("nan"), float("inf"), -0.0])],
}


@pytest.mark.parametrize("name", list(CPU_LISTS))
def test_cpu_tensors_are_declined_and_lean_pack_is_the_reference(name: str) -> None:
    """CPU tensors never take the kernel outside the interpreter (whether Triton is installed or
    not), so a CPU run's lean_pack is the torch-ops reference, bit for bit."""
    ts = CPU_LISTS[name]
    assert device_lean_triton.fused_pack(ts) is None
    assert_same(device_lean.lean_pack(ts), device_lean.reference_pack(ts), name)


def test_an_empty_list_is_an_empty_pack() -> None:
    """Nothing to launch: the same empty pack with or without Triton."""
    got = device_lean_triton.fused_pack([])
    assert got is not None and got.shape == (0, STATS_LEN + 1) and got.dtype == torch.int64
