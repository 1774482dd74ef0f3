"""The ring writes one episode per trigger condition, not one per step while it lasts (issue 22, item 9).

An episode is the ring (the ``size`` steps before), the trigger step and ``after`` more steps.
While the condition lasts after that, steps are only held (stats still written every step);
the trigger re-arms at the first step where it is false. A new trigger step inside the ``after``
window starts the count again. Each row trains a tiny model for ``STEPS`` steps with the
condition on at the steps given, and compares the set of steps stored in full (the level of
every step in the catalog) with the set worked out by hand for the row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import catalog_sql
from torch import nn

import stepdump
from stepdump.capture.triggers import TriggerInfo, loss_spike
from stepdump.store.format import LEVEL_FULL, LEVEL_STATS

STEPS = 30


@dataclass(frozen=True)
class Row:
    id: str
    bad: frozenset[int]  # steps at which the condition holds
    how: str  # "weights": params set to NaN before the forward of the first bad step, never repaired;
    #           "grads": one grad NaN at each bad step, params repaired after the update;
    #           "spike": the logged loss is 1000 at each bad iteration (seen by the trigger a step later);
    #           "callable": a user trigger that is true at each bad step
    full: frozenset[int]  # steps expected in full (the final record STEPS included)
    persists: int  # "condition persists" log lines expected (one per episode that outlasts `after`)
    size: int = 3
    after: int = 2


def _r(a: int, b: int) -> set[int]:
    return set(range(a, b + 1))


ROWS = [
    # NaN from step 10 to the end, as in nanoGPT when training goes on: one episode, 7..12.
    Row("persistent-nan", frozenset(_r(10, STEPS - 1)), "weights", frozenset(_r(7, 12) | {STEPS}), 1),
    Row("persistent-nan-after-0", frozenset(_r(10, STEPS - 1)), "weights", frozenset(_r(7, 10) | {STEPS}), 1,
        after=0),
    # NaN at 10..14, healthy 15..19, NaN again 20..22: two episodes, both written in full;
    # the second ring (17..19) holds steps held while the first condition lasted or after it.
    Row("nan-twice", frozenset(_r(10, 14) | _r(20, 22)), "grads",
        frozenset(_r(7, 12) | _r(17, 22) | {STEPS}), 1),
    # Flapping inside the after window: 11 is healthy (re-arms), 12 fires again and restarts `after`.
    Row("nan-flapping", frozenset({10, 12}), "grads", frozenset(_r(7, 14) | {STEPS}), 0),
    # A loss that jumps at iteration 12 and stays up: loss_spike fires from step 13 on, one episode.
    Row("persistent-loss-spike", frozenset(_r(12, STEPS - 1)), "spike", frozenset(_r(10, 15) | {STEPS}), 1),
    Row("loss-spike-twice", frozenset({12, 20}), "spike", frozenset(_r(10, 15) | _r(18, 23) | {STEPS}), 0),
    # A user callable: 5..8 (one episode outlasting after), 15, and 25..26 (inside after).
    Row("callable", frozenset(_r(5, 8) | {15} | _r(25, 26)), "callable",
        frozenset(_r(2, 7) | _r(12, 17) | _r(22, 27) | {STEPS}), 1),
    Row("callable-every-step", frozenset(_r(0, STEPS - 1)), "callable", frozenset(_r(0, 2) | {STEPS}), 1),
]


def _trigger(row: Row) -> Callable[[TriggerInfo], bool] | str:
    if row.how == "spike":
        return loss_spike()
    if row.how == "callable":
        return lambda info: info.step in row.bad
    return "nan_inf"


def _train(path: Any, row: Row) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(path, model, opt, ring=row.size, after=row.after, trigger=_trigger(row)) as rec:
        for s in range(STEPS):
            if row.how == "weights" and s == min(row.bad):
                with torch.no_grad():
                    model.weight.fill_(float("nan"))
            opt.zero_grad()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            if row.how == "grads" and s in row.bad:
                model.weight.grad[0, 0] = float("nan")
            opt.step()
            if row.how == "spike":
                rec.log(loss=1000.0 if s in row.bad else 1.0 + 0.01 * (s % 3))
            elif row.how != "grads":  # a NaN loss would keep nan_inf on a step longer than the grads
                rec.log(loss=loss)
            if row.how == "grads" and s in row.bad:
                with torch.no_grad():
                    model.weight.nan_to_num_(0.0)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_one_episode_per_condition(tmp_path, caplog, row):
    with caplog.at_level(logging.INFO, logger="stepdump"):
        _train(tmp_path / "r", row)
    levels = dict(catalog_sql(tmp_path / "r", "SELECT step, level FROM steps ORDER BY step"))
    assert sorted(levels) == list(range(STEPS + 1))  # every step has its row (stats go on)
    assert all(lv >= LEVEL_STATS for lv in levels.values())
    full = {s for s, lv in levels.items() if lv == LEVEL_FULL}
    assert full == set(row.full), f"extra {sorted(full - row.full)}, missing {sorted(row.full - full)}"
    persists = [r for r in caplog.records if "persists" in r.getMessage()]
    assert len(persists) == row.persists, [r.getMessage() for r in persists]
    with stepdump.open(tmp_path / "r") as run:
        assert run.steps == sorted(row.full)
        first = min(row.full)
        assert set(run.state_dict(first)) == {"weight", "bias"}  # a ring step reads back in full


def test_persistent_condition_is_named_once_with_its_step(tmp_path, caplog):
    row = ROWS[0]
    with caplog.at_level(logging.INFO, logger="stepdump"):
        _train(tmp_path / "r", row)
    (msg,) = [r.getMessage() for r in caplog.records if "persists" in r.getMessage()]
    assert "step 10" in msg and "healthy" in msg  # since when, and when it writes again
