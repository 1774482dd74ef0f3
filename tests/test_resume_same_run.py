"""Resuming into the same run (issue 15): after a clean close the run goes on at its final record's
step and reads as one uninterrupted run; ``start_step=k`` drops steps k.. and notes it in
``meta.history``; a SIGKILL'd recording resumes into its own directory; verify passes after."""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import assert_run_matches, catalog_sql, sigkill_child_when, snapshot, tiny_batch, tiny_model
from torch import nn

import stepdump


def _objects():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _train(rec, model, opt, sched, steps, salt: float = 0.0, snaps=None):
    for t in steps:
        x, y = tiny_batch(t)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x + salt), y)
        loss.backward()
        if snaps is not None:
            snaps[t] = snapshot(model, opt)
        opt.step()
        sched.step()
        rec.log(loss=loss)


def _fingerprints(run) -> dict[int, dict[tuple[str, str], int]]:
    out: dict[int, dict[tuple[str, str], int]] = {}
    for step, kind, name, fp in run.stats()[["step", "kind", "name", "fingerprint"]].itertuples(index=False):
        out.setdefault(int(step), {})[(kind, name)] = int(fp)
    return out


def _orphan_blobs(run_dir) -> int:
    return catalog_sql(run_dir, "SELECT count(*) FROM blobs WHERE id NOT IN (SELECT blob FROM tensors WHERE blob "
                                "IS NOT NULL) AND id NOT IN (SELECT base FROM blobs WHERE base IS NOT NULL)")[0][0]


@pytest.mark.parametrize("schedule", [{}, {"every": None, "stats_every": 1}, {"gradient_log": 3}])
def test_resume_after_a_clean_close_reads_as_one_uninterrupted_run(tmp_path, schedule):
    model, opt, sched = _objects()
    with stepdump.Recorder(tmp_path / "whole", model, opt, sched, **schedule) as rec:
        _train(rec, model, opt, sched, range(8))

    model, opt, sched = _objects()
    with stepdump.Recorder(tmp_path / "split", model, opt, sched, **schedule) as rec:
        _train(rec, model, opt, sched, range(4))
    with stepdump.open(tmp_path / "split") as run:
        assert run.all_steps[-1] == 4 and run.meta["final_step"] == 4
    with stepdump.Recorder(tmp_path / "split", model, opt, sched, resume=True, **schedule) as rec:
        assert rec.step == 4  # the step after the last update: the final record 4 is replaced
        _train(rec, model, opt, sched, range(4, 8))

    with stepdump.open(tmp_path / "whole") as whole, stepdump.open(tmp_path / "split") as split:
        assert split.all_steps == whole.all_steps == list(range(9)) and split.steps == whole.steps
        assert split.meta["final_step"] == 8
        assert [(h["resumed_at"], h["dropped"]) for h in split.meta["history"]] == [(4, [4, 4])]
        assert _fingerprints(split) == _fingerprints(whole)
        assert any(kind == "grads" for kind, _ in _fingerprints(split)[4])  # step 4 has its grads again
        assert split.scalars()["loss"].equals(whole.scalars()["loss"])
        assert stepdump.diff(whole, split).identical
        report = stepdump.verify(split)
        assert report.ok, report.problems
    assert _orphan_blobs(tmp_path / "split") == 0  # the final record's blob rows went with it


def test_start_step_drops_the_steps_from_there_and_notes_it_in_the_history(tmp_path):
    run_dir = tmp_path / "run"
    model, opt, sched = _objects()
    with stepdump.Recorder(run_dir, model, opt, sched, codec="delta-lz4") as rec:  # delta chains across the cut
        _train(rec, model, opt, sched, range(8))
    with stepdump.open(run_dir) as run:
        before = _fingerprints(run)
        seg_bytes = sum(p.stat().st_size for p in (run_dir / "segments").iterdir())
        model, opt, sched = _objects()
        run.restore(5, model, opt, scheduler=sched)

    snaps: dict[int, dict] = {}
    with stepdump.Recorder(run_dir, model, opt, sched, resume=True, start_step=5, codec="delta-lz4") as rec:
        assert rec.step == 5
        _train(rec, model, opt, sched, range(5, 7), salt=0.5, snaps=snaps)  # another history from step 5

    with stepdump.open(run_dir) as run:
        assert run.all_steps == run.steps == list(range(8)) and run.meta["final_step"] == 7
        [entry] = run.meta["history"]
        assert entry["resumed_at"] == 5 and entry["dropped"] == [5, 8] and entry["time"] > 0
        after = _fingerprints(run)
        assert all(after[t] == before[t] for t in range(5))  # the steps before k are untouched
        assert after[6] != before[6]  # the new history, not the old one
        for t, snap in snaps.items():
            assert_run_matches(run, t, snap)
        assert list(run.scalars()["loss"].dropna().index) == list(range(7))  # the old loss of step 7 is gone
        report = stepdump.verify(run)
        assert report.ok, report.problems
    assert _orphan_blobs(run_dir) == 0
    # the store stays append-only: the dropped steps' bytes are still in their segment, unreferenced
    assert sum(p.stat().st_size for p in (run_dir / "segments").iterdir()) > seg_bytes


CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    import stepdump

    run_dir, flag = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = stepdump.Recorder(run_dir, model, opt)
    for t in range(100000):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        rec.log(loss=loss)
        if t == 12:
            open(flag, "w").close()
        time.sleep(0.01)
    """
)


def test_a_sigkilled_recording_resumes_into_its_own_directory(tmp_path):
    script, run_dir, flag = tmp_path / "child.py", tmp_path / "run", tmp_path / "flag"
    script.write_text(CHILD)
    sigkill_child_when(script, (run_dir, flag), tmp_path / "child.log", flag.exists)

    with stepdump.open(run_dir) as run:
        assert not run.live and "final_step" not in run.meta  # killed: no close(), no final record
        last = run.all_steps[-1]
        assert last >= 10
        before = _fingerprints(run)
        k = 6  # the trainer's last checkpoint: resume from there, as a framework would
        model = tiny_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        run.restore(k, model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)  # the child had none: a constant one
    snaps: dict[int, dict] = {}
    with stepdump.Recorder(run_dir, model, opt, resume=True, start_step=k) as rec:  # the stale LOCK: no block
        _train(rec, model, opt, sched, range(k, last + 3), snaps=snaps)

    with stepdump.open(run_dir) as run:
        assert run.all_steps == list(range(last + 4)) and run.meta["final_step"] == last + 3
        assert [(h["resumed_at"], h["dropped"]) for h in run.meta["history"]] == [(k, [k, last])]
        after = _fingerprints(run)
        assert all(after[t] == before[t] for t in range(last))  # the same training: the same records again
        for t, snap in snaps.items():
            assert_run_matches(run, t, snap)
        report = stepdump.verify(run)
        assert report.ok, report.problems


def test_resume_after_a_crash_without_start_step_goes_on_after_the_last_committed_step(tmp_path):
    """No final record (the process died): the step after the last one committed, nothing dropped."""
    run_dir = tmp_path / "run"
    model, opt, sched = _objects()
    rec = stepdump.Recorder(run_dir, model, opt, sched)
    _train(rec, model, opt, sched, range(3))
    rec._link.writer.queue.put(None)  # what a kill leaves: steps committed, no close(), no final record
    rec._link.writer.join()
    rec._lock.release()
    rec._finalizer.detach()
    with stepdump.Recorder(run_dir, model, opt, sched, resume=True) as rec2:
        assert rec2.step == 3
        _train(rec2, model, opt, sched, range(3, 5))
    with stepdump.open(run_dir) as run:
        assert run.all_steps == list(range(6)) and run.meta["final_step"] == 5
        assert [(h["resumed_at"], h["dropped"]) for h in run.meta["history"]] == [(3, None)]


def test_resumed_and_closed_without_an_update_keeps_a_final_record(tmp_path):
    """Resuming drops the final record at once; a Recorder closed before any update records the
    state it was given in its place, so the run still ends with the trained model."""
    model, opt, sched = _objects()
    with stepdump.Recorder(tmp_path / "run", model, opt, sched) as rec:
        _train(rec, model, opt, sched, range(3))
    stepdump.Recorder(tmp_path / "run", model, opt, sched, resume=True).close()
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == [0, 1, 2, 3] and run.meta["final_step"] == 3
        assert all(torch.equal(run.state_dict(3)[k], v) for k, v in model.state_dict().items())
