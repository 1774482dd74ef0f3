"""The CUDA paths, checked on a real GPU (not part of `make test`: CI has no GPU).

Run on a machine with CUDA: ``python benchmarks/cuda_check.py`` (the same checks as pytest
tests: ``make test-gpu``, which also runs the device-lean contract of docs/cuda.md). The
checks live once, in ``tests_gpu/cuda_workloads.py``. It checks, and exits non-zero if any
check fails:

* staging: pinned host buffers, filled by non_blocking copies on a side stream;
* recorded tensors equal the live CUDA tensors bitwise, at every step, for
  AdamW (foreach and fused), Adam(capturable=True), SGD with sparse embedding
  grads, LBFGS with a closure, and fp16 autocast + GradScaler with a skipped step;
* recording does not change the training (bitwise equal to an unrecorded run);
* restore into fresh CUDA objects continues bit-identically;
* device-side stats agree with the CPU stats of the same tensors;
* overhead of stats-only and full recording on a ~50M-parameter model.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests_gpu"))
sys.path.insert(0, str(ROOT / "src"))

from cuda_workloads import KINDS, fidelity, overhead  # noqa: E402

FAILED: list[str] = []


def check(name: str, fn) -> None:  # noqa: ANN001
    try:
        fn()
        print(f"ok    {name}")
    except Exception as e:  # noqa: BLE001 - report every check
        FAILED.append(name)
        print(f"FAIL  {name}: {type(e).__name__}: {e}")


def _print_overhead(root: Path) -> None:
    rows = overhead(root)
    base = rows[0][1]
    print(f"overhead, ~50M params (12 x Linear(2048)), AdamW fused, {torch.cuda.get_device_name()}:")
    for label, ms in rows:
        print(f"  {label:28s} {ms:8.2f} ms/step  {ms / base:5.2f}x")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    # Bitwise comparisons need deterministic kernels (index_add_ of sparse grads uses atomics otherwise).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for kind in KINDS:
            check(f"fidelity {kind}", lambda k=kind: fidelity(k, root))
        check("overhead", lambda: _print_overhead(root))
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all CUDA checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
