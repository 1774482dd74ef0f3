"""Shared pytest setup for the stepdump tests."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch

# Let test files import tests/helpers.py whatever the import mode.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed_and_no_leaked_writers(request):
    """Seed every core test, and fail one that leaves a Recorder's writer thread running."""
    if not request.node.path.name.startswith("test_core_"):
        yield
        return
    # Tiny models on a 2-core machine that also runs the writer thread: one intra-op
    # thread is faster, and keeps numerics independent of the core count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 5
    while True:
        alive = [t for t in threading.enumerate() if t.name == "stepdump-writer" and t.is_alive()]
        if not alive:
            return
        gc.collect()  # an unreferenced Recorder closes itself through its finalizer
        if time.monotonic() > deadline:
            pytest.fail(f"{len(alive)} stepdump writer thread(s) still running after the test: close your Recorders")
        time.sleep(0.05)
