#!/bin/sh
# The GPU suite on a lent machine that reaches no network (docs/cuda.md, "Running the GPU suite"):
# torch, triton, pytest, pandas, xxhash from the machine's image; numcodecs and zstandard, which it
# lacks, as wheels in .whl/ (downloaded beforehand with pip download --python-version 3.12 ...).
# Usage, from the repository root: OUT=dir sh tests_gpu/device_run.sh [pytest args]
OUT=${OUT:-/tmp/stepdump-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "none"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", tv, torch.cuda.get_device_name())
PY
timeout "${PYTEST_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider tests_gpu --timeout 150 "$@" 2>&1 | tee "$OUT/pytest.log"
if [ -f benchmarks/device_lean_bench.py ]; then
    timeout "${BENCH_LIMIT:-90}" python3 benchmarks/device_lean_bench.py 2>&1 | tee "$OUT/bench.log"
fi
