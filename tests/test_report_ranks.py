"""The report of a multi-rank run: the ranks summary and the outlier ranks (issue 26 item 5).

A real 2-rank DDP job over gloo (two processes forked from the test's, each running ``_worker``) records two runs: one
whose replicas agree, one where rank 1 edits a parameter after step DESYNC (what ``cross_rank``
finds). The report's ranks section lists each rank's steps, last loss and grad norm (checked
against what each rank logged and the stats it recorded) and names rank 1 as the outlier of the
second run only; a run of one store has no ranks section.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from gloo_fork import run_ranks

WORLD, STEPS, DESYNC = 2, 5, 2


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stepdump

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    losses: dict[str, list[float]] = {}
    for name in ("agree", "desync"):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        with stepdump.Recorder(out / name, model, opt) as rec:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                if name == "desync" and step == DESYNC and rank == 1:
                    with torch.no_grad():
                        model.module[0].weight.add_(1e-3)  # rank-dependent edit: replicas part
                rec.log(loss=loss)
                losses[name].append(float(loss))
    (out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(lambda rank: _worker(out), WORLD, out.with_name(out.name + "-logs"))  # ranks forked from this process
    return out


def _data(path: Path, findings: Any = None) -> dict[str, Any]:
    import stepdump
    from stepdump.analysis.report import build_report_data

    with stepdump.open(path) as run:
        return build_report_data(run, findings)


@pytest.mark.parametrize("name, outliers", [("agree", []), ("desync", [1])])
def test_ranks_summary_rows_and_outliers(job: Path, name: str, outliers: list[int]) -> None:
    import stepdump

    ranks = _data(job / name)["ranks"]
    assert ranks is not None and [r["rank"] for r in ranks["rows"]] == [0, 1]
    assert ranks["outliers"] == outliers
    assert [r["outlier"] for r in ranks["rows"]] == [r in outliers for r in (0, 1)]
    assert ranks["split"] == (DESYNC + 1 if outliers else None)  # the edit shows in the next step's params
    with stepdump.open(job / name) as run:
        for row in ranks["rows"]:
            store = run.rank(row["rank"])
            logged = json.loads((job / f"losses_rank{row['rank']}.json").read_text())[name]
            assert row["steps"] == len(store.all_steps) and row["last_step"] == store.all_steps[-1]
            assert row["loss_last"] == logged[-1]
            grads = store.stats(kind="grads")
            last = grads[grads["step"] == grads["step"].max()]
            assert row["grad_norm_last"] == math.sqrt(sum(float(n) ** 2 for n in last["norm"]))
    if outliers:
        why = ranks["rows"][1]["why"]
        assert len(why) == 1 and why[0].startswith("cross_rank:") and f"step {DESYNC + 1}" in why[0]
    # DDP averages the gradients: every rank's total grad norm is the same, no deviation
    assert [r["grad_dev"] for r in ranks["rows"]] == [0.0, 0.0] and ranks["grad_spread"] == 0.0


def test_rank_findings_of_some_ranks_mark_them(job: Path) -> None:
    """A finding that check raised on one rank only (multirank's 'rank r:' prefix) marks that rank."""
    from stepdump.analysis.findings import Finding, Severity

    given = [Finding("loss_spike", Severity.WARNING, 3, None, "loss", 9.0, 3.0, "rank 0: loss spiked"),
             Finding("nan_inf", Severity.ERROR, 1, "grads", "w", 1.0, 0.0, "ranks 0, 1: NaN")]
    ranks = _data(job / "agree", given)["ranks"]
    assert ranks["outliers"] == [0] and ranks["rows"][0]["why"] == ["loss_spike at step 3"]


def test_ranks_section_on_the_page(job: Path, tmp_path: Path) -> None:
    from stepdump.render.html import render_report

    html = render_report(_data(job / "desync"))
    assert '<section id="ranks">' in html and 'data-outliers="1"' in html
    assert '<tr class="outlier" data-rank="1">' in html and '<tr class="ok" data-rank="0">' in html
    with __import__("stepdump").open(job / "desync" / "rank00000") as one:
        from stepdump.analysis.report import build_report_data

        single = render_report(build_report_data(one, []))
    assert '<section id="ranks" hidden>' in single and 'data-outliers' not in single


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
