"""Re-execution across ranks (issue 24 item 2, docs/reexecute.md): a 2-rank gloo DDP recording,
each rank re-executing its own step inside the process group, compared with every rank's recorded
fingerprints of the reduced grads; one bit flipped in rank 1's reduced grad at one step is named
on rank 1 only, and every rank's verdict says which ranks agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import reexec_dist_worker
import torch
from gloo_fork import run_ranks
from torch import nn

import stepdump
from stepdump.errors import ConfigError

WORLD = 2
FLIPPED = "module.0.weight"



@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank job of tests/reexec_dist_worker.py, its ranks forked from this process (gloo_fork)."""
    out = tmp_path_factory.mktemp("reexec_ranks")
    run_ranks(lambda rank: reexec_dist_worker.main(out), WORLD, out / "logs")
    return out


def got(job: Path, rank: int, step: int) -> dict[str, Any]:
    return json.loads((job / f"rank{rank}.json").read_text())[str(step)]


# (rank re-executing, step, verdict, cause, first, ranks that agree, ranks that differ: first grad)
ROWS = [
    (0, 1, "reproduces", "", None, [0, 1], {}),
    (1, 1, "reproduces", "", None, [0, 1], {}),
    (0, 2, "reproduces", "", None, [0], {"1": ["grads", FLIPPED]}),
    (1, 2, "differs from the record", "suspected corruption at record time", ["grads", FLIPPED], [0],
     {"1": ["grads", FLIPPED]}),
]


@pytest.mark.parametrize(("rank", "step", "verdict", "cause", "first", "agree", "differ"), ROWS,
                         ids=["r0-clean", "r1-clean", "r0-flipped-on-r1", "r1-flipped-on-r1"])
def test_each_rank_reexecutes_its_step_and_names_the_ranks_that_agree(job: Path, rank: int, step: int, verdict: str,
                                                                      cause: str, first: list | None,
                                                                      agree: list[int], differ: dict) -> None:
    r = got(job, rank, step)
    assert (r["verdict"], r["cause"], r["first"]) == (verdict, cause, first), r["summary"]
    assert (r["rank"], r["ranks_agree"], r["ranks_differ"]) == (rank, agree, differ), r["summary"]
    line = f"across ranks (step {step}'s reduced grads, re-executed on rank {rank}): "
    assert line in r["summary"]
    if differ:
        assert f"rank 1 differs, first at grads '{FLIPPED}'" in r["summary"]
    assert f"rank{'s' if len(agree) > 1 else ''} {', '.join(map(str, agree))} agree" in r["summary"]


def test_the_flip_is_in_rank_1s_record_only(job: Path) -> None:
    """The fixture is what the rows say it is: the two ranks' recorded grads differ at step 2 in
    that tensor only, by one bit, and agree at step 1."""
    run = stepdump.open(job / "run")
    for step, names in ((1, []), (2, [FLIPPED])):
        a, b = (run.rank(r).tensors(step, "grads") for r in range(WORLD))
        assert sorted(n for n in a if not torch.equal(a[n], b[n])) == names
    x, y = (run.rank(r).tensor(FLIPPED, 2, "grads").view(-1)[:1].view(torch.int32) for r in range(WORLD))
    assert int(x ^ y) == 1


def test_a_multi_rank_run_outside_its_process_group_is_refused(job: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ConfigError, match="inside a process group of 2 ranks"):
        stepdump.reexecute(stepdump.open(job / "run"), 1, model, opt, lambda m, o, b: None)
