"""The GPU suite (``make test-gpu``): refuses to run, rather than skip, where there is no CUDA.

Collection needs no GPU, so ``tests/test_gpu_suite.py`` can check on CPU that this suite
still imports (``pytest --collect-only tests_gpu``) and cannot rot unseen. Running it
without CUDA is a usage error (exit non-zero, with the reason), never a pass of skips.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# tests/helpers.py (assert_same, snapshot) and this directory's cuda_workloads.py, whatever the
# import mode; tests_gpu is not a package, as tests/ is not.
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config: pytest.Config) -> None:
    if config.option.collectonly:
        return
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            "tests_gpu needs a CUDA device and torch.cuda.is_available() is False here: "
            "run `make test-gpu` on a machine with a GPU and a CUDA build of torch"
        )
    # Bitwise comparisons need deterministic kernels (index_add_ of sparse grads uses atomics
    # otherwise: two *unrecorded* runs then differ).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
