"""Load: many steps with flat memory (`make soak` runs 10,000 steps of each, and holds the
catalog queries to a time limit; this unit test makes no timing claims).

The concurrent reader in another process is in tests/test_reliability_crash.py
(it shares that file's fork server).
"""

from __future__ import annotations

import pytest
from reliability.load import run_load

import stepdump

pytestmark = pytest.mark.timeout(120)

STEPS = 2000


def test_two_thousand_stats_only_steps_keep_memory_flat_and_queries_complete(tmp_path):
    """2,000 steps of a tiny MLP with every=None (stats and fingerprints only), while a reader
    in this process stays open on the growing run and queries it at checkpoints."""
    r = run_load(tmp_path / "run", steps=STEPS, every=None, checkpoints=4)
    print(f"\n{r.summary()}")
    assert r.rss_growth_mb < 30, r.rss
    assert [q["step"] for q in r.queries] == [499, 999, 1499, 1999]  # the reader queried the growing run
    with stepdump.open(tmp_path / "run") as run:  # what those queries read covers every step
        # stats-only steps, then close()'s final record STEPS, the one step stored in full
        assert run.stats_steps == list(range(STEPS + 1)) and run.steps == [STEPS] == [run.meta["final_step"]]
        assert set(run.stats(steps=STEPS)["kind"]) >= {"params"} and run.tensors(STEPS, "grads") == {}
        one = run.stats(name="0.weight", steps=range(STEPS))  # its params and grads rows
        assert sorted(set(one["kind"])) == ["grads", "params"] and len(one) == 2 * STEPS
        assert set(one["step"]) == set(range(STEPS))
        assert len(run.scalars()) == STEPS + 1  # a row per step, the final record's too
        last = run.stats(kind="grads", steps=range(STEPS - 100, STEPS))
        assert len(last) == 100 * 4 and set(last["step"]) == set(range(STEPS - 100, STEPS))
