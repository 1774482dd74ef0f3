"""The run's meta names the CPU kernels it was recorded with (``cpu_capability``, ``blas``).

A gradient-log rebuild or a replay that does not reproduce on another host can then say why
(FORMAT.md, meta; docs/reliability.md, "One suite on every CPU"). Every expected value here is
torch's own answer in the same process, or a fixed string parsed from a fixed text: nothing
depends on this host's CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

import stepdump
from stepdump.core.host import blas, cpu_capability, kernel_difference, kernels_meta, parse_blas


def _record(path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(path, model, opt) as rec:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        rec.log(loss=1.0)


def test_meta_names_this_process_kernels(tmp_path):
    _record(tmp_path / "run")
    meta = stepdump.open(tmp_path / "run").meta
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert meta["blas"] == blas() == parse_blas(torch.__config__.show())
    assert meta["blas"] not in ("", "unknown")  # every torch since 2.2 prints BLAS_INFO


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX512", "SVE256"])
def test_meta_is_torchs_answer_when_the_run_is_created(tmp_path, monkeypatch, capability):
    """Whatever torch answers (ATEN_CPU_CAPABILITY=default gives "DEFAULT": fresh-check runs the
    test above under it) is what the run records, at creation, not a value cached at import."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    _record(tmp_path / "run")
    assert stepdump.open(tmp_path / "run").meta["cpu_capability"] == capability


MKL = ("  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64\n"
       "  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, USE_MKL=ON")


@pytest.mark.parametrize("config,want", [
    (MKL, "mkl 2024.2"),
    ("Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release", "mkl"),  # no version line
    ("Build settings: BLAS_INFO=open, BUILD_TYPE=Release, LAPACK_INFO=open", "openblas"),
    ("Build settings: BLAS_INFO=accelerate, BUILD_TYPE=Release", "accelerate"),
    ("Build settings: BLAS_INFO=flexi, BUILD_TYPE=Release", "flexiblas"),
    ("Build settings: BLAS_INFO=eigen, BUILD_TYPE=Release", "eigen"),  # unknown names pass through
    ("Build settings: BLAS_INFO=, BUILD_TYPE=Release", "none"),
    ("Build settings: BUILD_TYPE=Release", "unknown"),
])
def test_parse_blas(config, want):
    assert parse_blas(config) == want


@pytest.mark.parametrize("recorded,want", [
    ({}, None),  # a run made before these keys: nothing to say
    ("here", None),
    ({"cpu_capability": "CPU-X"}, "CPU capability CPU-X when recorded, {cap} here"),
    ({"blas": "blas-x 1.0"}, "BLAS blas-x 1.0 when recorded, {blas} here"),
    ({"cpu_capability": "CPU-X", "blas": "blas-x"},
     "CPU capability CPU-X when recorded, {cap} here; BLAS blas-x when recorded, {blas} here"),
])
def test_kernel_difference(recorded, want):
    meta = kernels_meta() if recorded == "here" else recorded
    expect = None if want is None else want.format(cap=cpu_capability(), blas=blas())
    assert kernel_difference(meta) == expect


def test_info_shows_the_kernels(cli, tmp_path):
    _record(tmp_path / "run")
    data = json.loads(cli("info", tmp_path / "run", "--json").stdout)
    assert data["kernels"] == {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas()}
    assert f"{torch.backends.cpu.get_cpu_capability()}, BLAS {blas()}" in cli("info", tmp_path / "run").stdout
