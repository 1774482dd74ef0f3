# Two commands on a fresh machine: `make demo` and `make test`.
# torch is pinned to the CPU wheel that lies on this machine's disk so that no
# multi-GB CUDA build is downloaded; pyproject's floor is this version, the one the suite runs on.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: demo test test-gpu bench soak install install-test clean

# The venv with pip and torch (idempotent: a second run only checks them).
define VENV_BASE
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
endef

$(VENV)/.installed: pyproject.toml
	$(VENV_BASE)
	$(PIP) install -q -e .
	touch $@

# Not on top of .installed: `-e ".[test]"` installs all that `-e .` does, and each editable
# install builds stepdump's wheel anew (an isolated build env with setuptools fetched into it),
# so `make test` on a fresh clone builds it once, not twice; it then counts as installed too.
$(VENV)/.installed-test: pyproject.toml
	$(VENV_BASE)
	$(PIP) install -q -e ".[test]"
	# the report's browser test drives Debian's chromium (never `playwright install`)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/stepdump demo --out demo-run --steps 200

test: $(VENV)/.installed-test
	$(PY) -m mypy
	$(PY) -m pytest -q tests

bench: $(VENV)/.installed-test
	$(PY) benchmarks/run.py
	$(PY) benchmarks/keyframes.py
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/leave_on.py
	$(PY) benchmarks/leave_on_tiny.py
	$(PY) benchmarks/report_scale.py   # the report of a 500-tensor x 100,000-step lean run (issue 26's size, ~10 GB of temporary catalog): build, RSS, page, first view
	$(PY) benchmarks/lean_summaries.py --results   # what a per-step distribution summary would cost (docs/report.md)
	$(PY) benchmarks/gradlog_read.py   # gradient-log reads vs the optimizer steps they re-apply (K = 16, 32, 100)
	$(PY) benchmarks/reexec.py         # re-executing one step vs a training step, the op tracer's overhead
	$(PY) benchmarks/ranks_scale.py    # info, check, diff, cross-rank, report, export-stats on 8 / 64 / 256 rank stores
	$(PY) benchmarks/docs_numbers.py   # marked numbers of docs/performance.md, README from results.json

# Not part of `make test`: the CUDA paths and the device-side lean path's contract on a real GPU
# (tests_gpu/, docs/cuda.md). Refuses, exit 1, where torch sees no CUDA device: never a run of skips.
test-gpu: $(VENV)/.installed-test
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch.cuda.is_available() is False (torch ' + torch.__version__ + ', CUDA build: ' + str(torch.version.cuda) + '): run it on a machine with a GPU and a CUDA build of torch')"
	$(PY) -m pytest -q tests_gpu

# Not part of `make test`: 54 SIGKILLs of a recording process (each followed by
# open / verify / bit-exact reads / resume) and 10,000-step load runs (~5 min).
# See docs/reliability.md; options: $(PY) tests/reliability/soak.py --help
soak: $(VENV)/.installed-test
	$(PY) tests/reliability/soak.py

clean:
	rm -rf $(VENV) demo-run report.html .pytest_cache
