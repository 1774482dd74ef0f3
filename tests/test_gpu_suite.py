"""The GPU suite (tests_gpu/, ``make test-gpu``) cannot rot unseen on machines without a GPU.

``make test`` never runs tests_gpu (it needs CUDA; docs/cuda.md), so this checks on CPU what
can be checked there: it still collects (every module imports, every parametrization builds),
``pytest tests`` never collects it, ``make test-gpu`` exists and refuses clearly where torch sees
no CUDA device (and lets the suite run where it does), and the CUDA checks exist once
(benchmarks/cuda_check.py calls tests_gpu/cuda_workloads.py, no copy of its own).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests_gpu"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_gpu_suite_collects_without_cuda() -> None:
    res = _run("-m", "pytest", "--collect-only", "-q", "tests_gpu", "-p", "no:cacheprovider")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    files = {i.split("::")[0] for i in ids}
    assert files == {"tests_gpu/test_cuda_paths.py", "tests_gpu/test_device_lean_contract.py",
                     "tests_gpu/test_device_lean_triton.py"}, files
    for name in ("test_cuda_fidelity[adamw-fused]", "test_cuda_fidelity[amp]", "test_device_fingerprint_is_dmix64",
                 "test_stats_step_copies_a_few_numbers", "test_diff_across_kinds_is_never_identical",
                 "test_lean_overhead_on_gpt2_small"):
        assert any(name in i for i in ids), f"{name} not collected from tests_gpu"


def test_running_the_gpu_suite_without_cuda_is_refused() -> None:
    """Running it, rather than collecting it, is a usage error without CUDA: never skips."""
    spec = importlib.util.spec_from_file_location("tests_gpu_conftest", GPU / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    conftest.pytest_configure(SimpleNamespace(option=SimpleNamespace(collectonly=True)))  # collecting: fine
    if not torch.cuda.is_available():  # (with CUDA, configuring would switch this process to deterministic kernels)
        with pytest.raises(pytest.UsageError, match="tests_gpu needs a CUDA device"):
            conftest.pytest_configure(SimpleNamespace(option=SimpleNamespace(collectonly=False)))


def test_pytest_tests_never_collects_the_gpu_suite() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert conf["testpaths"] == ["tests"]
    assert GPU.is_dir() and GPU.parent == ROOT  # beside tests/, not in it
    make = (ROOT / "Makefile").read_text()
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", make, re.M)
    assert test_recipe and "tests_gpu" not in test_recipe.group(1)


def test_make_test_gpu_refuses_without_cuda() -> None:
    make = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", make, re.M)
    assert phony and "test-gpu" in phony.group(1).split()
    target = re.search(r"^test-gpu:.*\n((?:\t.*\n)+)", make, re.M)
    assert target, "no test-gpu target in the Makefile"
    lines = [ln.strip().lstrip("@") for ln in target.group(1).splitlines()]
    assert lines[-1] == "$(PY) -m pytest -q tests_gpu", lines
    guard = lines[0]
    assert guard.startswith("$(PY) -c "), guard
    code = guard[len("$(PY) -c "):].strip('"')
    # The guard as make runs it (`python -c CODE`), in this process: sys.exit(message) is exit 1
    # with the message on stderr; sys.exit(0) lets the suite run.
    with pytest.raises(SystemExit) as done:
        exec(code, {})
    if torch.cuda.is_available():
        assert done.value.code == 0
    else:
        assert isinstance(done.value.code, str), done.value.code
        assert done.value.code.startswith("make test-gpu: torch.cuda.is_available() is False"), done.value.code


def test_cuda_checks_exist_once() -> None:
    script = (ROOT / "benchmarks" / "cuda_check.py").read_text()
    assert "from cuda_workloads import" in script
    for fn in ("def fidelity", "def overhead", "def build", "def train", "class Net"):
        assert fn in (GPU / "cuda_workloads.py").read_text(), fn
        assert fn not in script, f"benchmarks/cuda_check.py has its own {fn}"


def test_the_recorder_internals_the_gpu_suite_reads_exist(tmp_path: Path) -> None:
    """tests_gpu/cuda_workloads.py checks that CUDA params are staged in pinned buffers by reading
    the staging pool's slots (``rec._pool._slots``, each slot's ``buffers`` by (kind, name)). That
    read rotted unseen once (the pool's free list became a SimpleQueue, found only when a GPU was
    lent): here, on the CPU, the same read of a recording's slots finds the params' buffers."""
    import stepdump

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "run", model, opt, on_error="raise") as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        names = {n for n, _ in model.named_parameters()}
        staged = {name for slot in rec._pool._slots for (k, name), b in slot.buffers.items()
                  if k == "params" and isinstance(b, torch.Tensor)}
        assert staged == names, staged
