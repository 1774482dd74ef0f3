"""Load: many steps with flat memory (`make soak` runs 10,000 steps of each, and holds the
catalog queries to a time limit; this unit test makes no timing claims).

The concurrent reader in another process is in tests/test_reliability_crash.py
(it shares that file's fork server).
"""

from __future__ import annotations

import pytest
from reliability.load import check_complete, run_load

pytestmark = pytest.mark.timeout(120)

# A smaller twin of the load soak: `make soak` runs run_load for 10,000 steps three ways and
# asserts check_complete and flat memory on each (tests/reliability/soak.py).
STEPS = 400


def test_stats_only_steps_keep_memory_flat_and_queries_complete(tmp_path):
    """400 steps of a tiny MLP with every=None (stats and fingerprints only), while a reader
    in this process stays open on the growing run and queries it at checkpoints."""
    r = run_load(tmp_path / "run", steps=STEPS, every=None, checkpoints=4)
    print(f"\n{r.summary()}")
    assert r.rss_growth_mb < 30, r.rss
    assert [q["step"] for q in r.queries] == [99, 199, 299, 399]  # the reader queried the growing run
    check_complete(tmp_path / "run", STEPS)  # what those queries read covers every step
