"""Load: many steps with flat memory and fast queries (`make soak` runs 10,000 steps of each).

The concurrent reader in another process is in tests/test_reliability_crash.py
(it shares that file's fork server).
"""

from __future__ import annotations

import pytest
from reliability.load import run_load

pytestmark = pytest.mark.timeout(120)


def test_two_thousand_stats_only_steps_keep_memory_flat_and_queries_fast(tmp_path):
    """2,000 steps of a tiny MLP with every=None (stats and fingerprints only), while a reader
    in this process stays open on the growing run and queries it at checkpoints."""
    r = run_load(tmp_path / "run", steps=2000, every=None, checkpoints=4)
    print(f"\n{r.summary()}")
    assert r.rss_growth_mb < 30, r.rss
    assert r.worst("stats(name=one tensor)") < 1.0
    assert r.worst("scalars()") < 1.0
    assert r.worst("stats(kind, steps=last 100)") < 1.0
