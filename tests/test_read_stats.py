"""run.stats(): the one-series fast path gives exactly the rows and dtypes of the general query."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import MLP, train_recorded

import stepdump


def test_one_series_stats_equal_the_filtered_general_query(tmp_path):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_recorded(tmp_path / "run", model, opt, 10, every=3)
    with stepdump.open(tmp_path / "run") as run:
        everything = run.stats()
        for kind, name, steps in [("grads", "fc1.weight", None), ("params", "fc2.bias", range(2, 9, 3)),
                                  ("optimizer", "fc1.weight.exp_avg", [3, 6, 9])]:  # stored steps: every
                                  # optimizer row (stats-only steps have them every 10th step)
            want = everything[(everything.kind == kind) & (everything.name == name)]
            if steps is not None:
                want = want[want.step.isin(list(steps))]
            got = run.stats(kind=kind, name=name, steps=steps)
            pd.testing.assert_frame_equal(got, want.reset_index(drop=True))
            assert len(got) == (10 if steps is None else len(list(steps)))
            assert got["stored"].tolist() == [s % 3 == 0 for s in got["step"]]
        # a glob matching several series takes the general query, same rows
        several = run.stats(kind="grads", name="fc1.*")
        assert set(several.name) == {"fc1.weight", "fc1.bias"} and len(several) == 20
        # steps as a generator: read once, whichever query runs
        gen = run.stats(kind="grads", name="fc1.*", steps=(s for s in (2, 4)))
        assert sorted(gen.step.tolist()) == [2, 2, 4, 4]
        assert run.stats(kind="grads", name="fc1.weight", steps=(s for s in (2, 4))).step.tolist() == [2, 4]
        with pytest.raises(stepdump.StepdumpError):  # a bad steps= is an error even when no tensor matches
            run.stats(kind="grads", name="no.such.tensor", steps="x")
        none = run.stats(kind="grads", name="no.such.tensor")
        assert none.empty and list(none.columns) == list(everything.columns)
