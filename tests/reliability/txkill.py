"""SIGKILL inside each write transaction of the catalog, then open, verify, read and resume.

The child (``txn_child``, forked by the zygote of procs.py) wraps ``sqlite3.connect`` so that
every connection stepdump opens carries a trace callback: SQLite calls it with each statement
(parameters filled in) right before running it. A :class:`Kill` names one transaction by a
statement it contains (``txn``; ``not_txn``: a statement it must not contain) and the
statement at which the process dies inside it (``at``: a later statement of it, or its
``COMMIT``). The callback SIGKILLs the process right there, from whichever thread runs it (the
writer thread, the training thread, the Recorder's constructor).

With a one-page cache on every connection, SQLite writes a transaction's changed pages before
its ``COMMIT`` (a cache spill): into the catalog itself after saving the old pages in
``catalog.sqlite-journal`` (rollback-journal mode, what a cleanly closed run is in), or as
uncommitted frames at the end of ``catalog.sqlite-wal`` (WAL mode, while recording). A kill then
leaves a catalog SQLite must roll back (a hot journal) or frames it must ignore, not an
untouched file.

The checks (``check_after_kill``) compare every step stored in full with hashes of a reference
training computed without stepdump (``reference``): the model is deterministic and restore +
redo is exact, so record *t* of every run in every row must hold exactly the reference's
tensors of step *t*.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reliability.procs import SideFile, iteration, make_model_opt, step_hashes, tensor_hash

BASE_STEPS = 6  # the closed base run: records 0..5 and the final record 6


@dataclass(frozen=True)
class Kill:
    txn: str  # regex: a statement of the transaction
    at: str = "COMMIT"  # regex: the statement (at or after the txn one) before which the process dies
    not_txn: str | None = None  # regex: a statement the transaction must not hold


def install_kill(kill: dict[str, Any]) -> None:
    """In this (child) process, every SQLite connection dies as ``kill`` says (see the module doc)."""
    import sqlite3

    real = sqlite3.connect
    txn, at = re.compile(kill["txn"]), re.compile(kill["at"])
    not_txn = re.compile(kill["not_txn"]) if kill.get("not_txn") else None

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        con = real(*args, **kwargs)
        con.execute("PRAGMA cache_size=1")  # spill: changed pages reach the files before COMMIT
        state = {"in": False, "bad": False}

        def trace(sql: str) -> None:
            s = sql.strip()
            if s.upper().startswith("BEGIN"):
                state["in"] = state["bad"] = False
                return
            if not_txn is not None and not_txn.search(s):
                state["bad"] = True
            if txn.search(s):
                state["in"] = True
            if state["in"] and not state["bad"] and at.match(s):
                os.kill(os.getpid(), signal.SIGKILL)

        con.set_trace_callback(trace)
        return con

    sqlite3.connect = connect  # type: ignore[assignment]


def resume_point(run_dir: str | Path, model: Any, opt: Any, redo: bool = False, at: int | None = None) -> int | None:
    """Put ``model``/``opt`` in the state a resumed Recorder starts from; its ``start_step``.

    Default: restore the last step stored in full *F* (or step ``at``) and record it again
    (``start_step=F`` drops *F..last*: the one resume that works from every state a kill leaves).
    ``redo``: restore the last step *L*, redo iteration *L* and resume after it
    (``start_step=None``: no step is dropped, the resume transaction only notes the history).
    None: no run yet, start at 0.
    """
    import stepdump

    if not (Path(run_dir) / "catalog.sqlite").exists():
        return None
    with stepdump.open(run_dir) as run:
        last = run.steps[-1] if at is None else at
        run.restore(last, model, opt)
        closed = run.meta.get("final_step") == last
    if redo:
        assert not closed, "redo resumes a run that was not closed"
        iteration(model, opt, last)
        opt.step()
        return None
    return last


def txn_child(run_dir: str, side: str, kill: dict[str, Any], steps: int = 3, redo: bool = False,
              at: int | None = None, every: int = 1, fail_at: int | None = None) -> None:
    """Resume ``run_dir`` (or start it), record ``steps`` steps and close, dying as ``kill`` says."""
    import torch

    import stepdump

    torch.set_num_threads(1)
    out = SideFile(side)
    model, opt = make_model_opt()
    start = resume_point(run_dir, model, opt, redo, at)
    if fail_at is not None:  # a failure inside the recorder at step fail_at: it marks the run stopped
        from stepdump.capture import staging

        real_stage = staging.Stager.stage
        current = [0]

        def stage(self: Any, *a: Any, **k: Any) -> Any:
            if current[0] >= fail_at:
                raise RuntimeError("planted failure")
            return real_stage(self, *a, **k)

        staging.Stager.stage = stage  # type: ignore[method-assign]
    install_kill(kill)
    out.emit({"event": "armed"})
    rec = stepdump.Recorder(run_dir, model, opt, resume=True, start_step=start, every=every, stats_every=1)
    first = rec.step
    out.emit({"event": "ready", "step": first})
    for t in range(first, first + steps):
        if fail_at is not None:
            current[0] = t
        loss = iteration(model, opt, t)
        opt.step()
        rec.log(loss=loss)
    rec.close()
    out.emit({"event": "closed", "next": first + steps})


# -- the parent's side ---------------------------------------------------------------------------


def reference(steps: int) -> dict[int, dict[str, list[Any]]]:
    """Hashes of what record t holds, for t in 0..steps, from a training without stepdump."""
    import torch

    torch.set_num_threads(1)
    model, opt = make_model_opt()
    out = {}
    for t in range(steps + 1):
        loss = iteration(model, opt, t)
        out[t] = step_hashes(model, opt)
        out[t]["loss"] = [loss.item()]
        opt.step()
    return out


def record_base(run_dir: Path, steps: int = BASE_STEPS) -> None:
    """The closed run every row starts from (or from a crashed copy of it): 0..steps-1 and final ``steps``."""
    import stepdump

    model, opt = make_model_opt()
    with stepdump.Recorder(run_dir, model, opt) as rec:
        for t in range(steps):
            loss = iteration(model, opt, t)
            opt.step()
            rec.log(loss=loss)


def check_steps(run: Any, want: dict[int, dict[str, list[Any]]], full: list[int], final: int | None,
                since: int = 0) -> None:
    """Every step stored in full (from ``since`` on) reads back as the reference's step, bit for
    bit (the final record: without grads); and the scalars logged are the reference's losses."""
    assert run.steps == full, f"steps stored in full: {run.steps}, expected {full}"
    assert run.meta.get("final_step") == final, f"final_step {run.meta.get('final_step')}, expected {final}"
    for t in (s for s in full if s >= since):
        ref = {k: v for k, v in want[t].items() if k != "loss" and not (t == final and k.startswith("grads\t"))}
        keys = {f"{k}\t{n}" for k, n in run.fingerprints(t)}
        assert keys == set(ref), f"step {t} holds {sorted(keys ^ set(ref))} unexpectedly"
        for key, h in ref.items():
            kind, name = key.split("\t")
            got = tensor_hash(run.tensor(name, t, kind=kind))
            assert got == h, f"{kind} {name} at step {t} reads back as {got}, expected {h}"
    df = run.scalars()
    if "loss" in df.columns:
        for t, v in df["loss"].dropna().items():
            assert [v] == want[int(t)]["loss"], f"loss at step {t}"


def resume_and_finish(run_dir: Path, want: dict[int, dict[str, list[Any]]], steps: int = 1) -> None:
    """A Recorder resumes the run (restore the last full step, record it again), records
    ``steps`` steps and closes; the run then verifies, and what it recorded reads back as the
    reference (the steps before were read back by the caller)."""
    import stepdump

    model, opt = make_model_opt()
    start = resume_point(run_dir, model, opt)
    with stepdump.Recorder(run_dir, model, opt, resume=True, start_step=start) as rec:
        first = rec.step
        assert first == (start or 0), (first, start)
        for t in range(first, first + steps):
            loss = iteration(model, opt, t)
            opt.step()
            rec.log(loss=loss)
    with stepdump.open(run_dir) as run:
        assert stepdump.verify(run).ok
        end = first + steps
        assert run.all_steps[-steps - 1:] == list(range(first, end + 1))
        check_steps(run, want, run.steps, end, since=first)


# -- the rows: every write transaction of the catalog --------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    base: str  # "empty" (no run yet), "closed" (the base run), "crashed" (closed, resumed, killed)
    kill: Kill
    child: dict[str, Any]  # txn_child's arguments
    full: list[int] | None  # the steps stored in full after the kill (None: no run)
    final: int | None = None  # meta.final_step after the kill
    history: int = 1  # entries of meta.history after the kill
    all_steps: list[int] | None = None  # every step's row, when other than ``full``
    left: str | None = None  # "journal" / "wal": the side file the kill must leave for SQLite to handle
    first: str = "open"  # who touches the run first after the kill: "open", "cli" (stepdump verify),
    #                      "resume" (a Recorder), "follower" (a Run opened before the child ran)


B = BASE_STEPS
CLOSED = list(range(B + 1))  # 0..5 and the final record 6
CRASHED = list(range(B + 2))  # the closed run resumed at 6, 6 and 7 committed, killed in 8's transaction
DROP = r"DELETE FROM tensors WHERE step >= "
STEP = r"INSERT OR REPLACE INTO steps\(step, level, skipped, time, state\) VALUES \("

ROWS = [
    # creating the run (built as catalog.sqlite.partial, renamed once complete)
    Row("create/mid", "empty", Kill(r"INSERT INTO meta", at=r"INSERT INTO meta"), {}, None),
    Row("create/commit", "empty", Kill(r"INSERT INTO meta"), {}, None),
    # the resume transaction: drop start_step..last and note meta.history (rollback journal after a close)
    Row("resume-drop/mid", "closed", Kill(DROP + "3", at=r"DELETE FROM steps"), {"at": 3}, CLOSED, B, 0,
        left="journal"),
    Row("resume-drop/commit", "closed", Kill(DROP + "3"), {"at": 3}, CLOSED, B, 0, left="journal", first="cli"),
    Row("resume-drop/commit-resume", "closed", Kill(DROP + "3"), {"at": 3}, CLOSED, B, 0, left="journal",
        first="resume"),
    Row("resume-drop/commit-follower", "closed", Kill(DROP + "3"), {"at": 3}, CLOSED, B, 0, left="journal",
        first="follower"),
    Row("resume-drop-final/commit", "closed", Kill(DROP + str(B)), {}, CLOSED, B, 0, left="journal"),
    Row("resume-drop-wal/commit", "crashed", Kill(DROP + "3"), {"at": 3}, CRASHED, None, 1),
    Row("resume-history/commit", "crashed", Kill(r"INSERT OR REPLACE INTO meta\(key, value\) VALUES \('history'",
                                                 not_txn=r"DELETE FROM"), {"redo": True}, CRASHED, None, 1),
    # the writer's connection switching the catalog to WAL (right after it)
    Row("writer-open/after-wal-switch", "closed", Kill(r"PRAGMA journal_mode=WAL", at=r"PRAGMA synchronous"), {},
        CLOSED[:-1]),
    # a step stored in full, a stats-only step
    Row("step-full/mid", "closed", Kill(STEP + "8, 2", at=r"INSERT OR REPLACE INTO steps"), {}, CRASHED),
    Row("step-full/commit", "closed", Kill(STEP + "8, 2"), {}, CRASHED, first="follower"),
    Row("step-stats/commit", "closed", Kill(STEP + "9, 1"), {"steps": 4, "every": 2}, [*CLOSED, 8],
        all_steps=list(range(9))),
    # close(): the final record, the last iteration's scalars alone, the switch back to a rollback journal
    Row("final-record/commit", "closed", Kill(r"VALUES \('final_step'"), {"steps": 2}, CRASHED),
    Row("scalars-only/commit", "closed", Kill(r"INSERT OR REPLACE INTO scalars", not_txn=r"INTO steps"),
        {"steps": 2}, list(range(9)), final=8),
    Row("close/journal-switch", "closed", Kill(r"PRAGMA busy_timeout=0", at=r"PRAGMA journal_mode=DELETE"),
        {"steps": 2}, list(range(9)), final=8, left="wal"),
    # a failure inside the recorder: marking the run recording_stopped
    Row("recording-stopped/commit", "closed", Kill(r"'recording_stopped'"), {"steps": 4, "fail_at": 8}, CRASHED),
]
