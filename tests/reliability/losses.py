"""What a SIGKILL loses, per recording mode and durability: the crash promise of docs/reliability.md, measured.

A child (procs.train_child, forked by the zygote) records a fresh run in one mode
(procs.MODES: ``full``, ``lean``, ``gradient_log``) with ``durability="flush"`` or
``"fsync"``, and is killed at a random moment. The child's side file says which
``optimizer.step()`` calls had returned (a line for step t is written after step t-1
returned, fsynced, with its monotonic time); the run says which steps were committed.
A step is *lost* when its ``step()`` returned before the kill and the run does not hold it.

The promise checked (:func:`check`):

* ``fsync``: at most ``queue_depth`` (2) steps lost, whatever the mode: each step's
  ``step()`` returns once no more than ``queue_depth`` records are uncommitted;
* ``flush``: as many as returned within ``2 * COMMIT_WINDOW`` (0.2 s) of the kill,
  plus ``queue_depth``: the group commit may hold the steps of the last two windows.
  A scheduler that does not run the writer for a while widens that window in time
  (the bound is then checked with ``slack_s`` added: a loaded machine).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from reliability.procs import Zygote, alive, read_side

#: Records that may be uncommitted when ``step()`` returns (Recorder ``queue_depth``'s default).
QUEUE_DEPTH = 2
#: How long a step below full may wait for its commit with ``durability="flush"`` (two COMMIT_WINDOWs).
HOLD_S = 0.2


@dataclass(frozen=True)
class Kill:
    """One kill: the last step whose ``step()`` had returned, the run's last step, what was lost."""

    mode: str
    durability: str
    returned: int  # the last step whose optimizer.step() returned before the kill (-1: none)
    committed: int  # the last step the run holds (-1: none)
    lost: int  # returned - committed, at least 0
    lost_recent: int  # of the lost, how many returned within HOLD_S + slack of the kill

    def __str__(self) -> str:
        return f"{self.mode}/{self.durability}: lost {self.lost} (returned {self.returned}, committed {self.committed})"


def kill_once(z: Zygote, work: Path, mode: str, durability: str, rng: random.Random, *,
              min_steps: int = 20, max_delay: float = 0.5, slack_s: float = 1.0) -> Kill:
    """Start a child recording a new run in ``work``, let it train ``min_steps`` steps and then up
    to ``max_delay`` seconds more, SIGKILL it, and count what the run lost."""
    import stepdump

    work.mkdir(parents=True, exist_ok=True)
    side, log, run_dir = work / "side.jsonl", work / "child.log", work / "run"
    pid = z.spawn("train", log, run_dir=str(run_dir), side=str(side), durability=durability, mode=mode)
    deadline = time.monotonic() + 120
    while len([x for x in read_side(side) if "step" in x and "h" in x]) < min_steps:
        if not alive(pid) or time.monotonic() > deadline:
            raise AssertionError(f"the {mode}/{durability} child did not reach step {min_steps}:\n"
                                 f"{log.read_text()[-3000:] if log.exists() else ''}")
        time.sleep(0.01)
    time.sleep(rng.uniform(0, max_delay))
    z.kill(pid)
    killed_at = time.monotonic()
    lines = [x for x in read_side(side) if "step" in x and "h" in x]
    returned = lines[-1]["step"] - 1  # a line for step t is written once step t-1 returned
    at = {x["step"] - 1: x["at"] for x in lines}  # when step t's step() had returned (at the latest)
    with stepdump.open(run_dir) as run:
        steps = run.all_steps
        # What was committed is whole: every stat chunk checks and decodes, and every step with
        # stats has a row for each param (a chunk commits with its steps or not at all).
        _, problems = run.catalog.check_stat_chunks()
        assert not problems, (mode, durability, problems)
        per_step = run.stats(kind="params").groupby("step").size()
        assert per_step.nunique() <= 1 and set(per_step.index) == set(run.stats_steps), (mode, durability, per_step)
    committed = steps[-1] if steps else -1
    lost_steps = range(committed + 1, returned + 1)
    recent = sum(1 for t in lost_steps if killed_at - at[t] <= HOLD_S + slack_s)
    return Kill(mode, durability, returned, committed, max(0, returned - committed), recent)


def check(k: Kill) -> None:
    """The documented promise (module docstring); AssertionError naming what was lost beyond it."""
    if k.durability == "fsync":
        assert k.lost <= QUEUE_DEPTH, (f"{k}: with durability='fsync' at most queue_depth={QUEUE_DEPTH} steps may "
                                        "be lost at a kill")
    else:
        assert k.lost - k.lost_recent <= QUEUE_DEPTH, (
            f"{k}: {k.lost - k.lost_recent} of them had returned more than {HOLD_S} s (+ slack) before the kill")


def soak(z: Zygote, work: Path, kills: int, seed: int, modes: tuple[str, ...] = ("full", "lean", "gradient_log"),
         durabilities: tuple[str, ...] = ("flush", "fsync"), **kw: float) -> list[Kill]:
    """``kills`` kills for each (mode, durability), each checked; returns them all."""
    rng = random.Random(seed)
    out: list[Kill] = []
    for mode in modes:
        for durability in durabilities:
            for i in range(kills):
                k = kill_once(z, work / f"{mode}-{durability}-{i}", mode, durability, rng, **kw)
                out.append(k)
                check(k)
    return out


def summary(kills: list[Kill]) -> str:
    """Per (mode, durability): kills and the most steps lost at one."""
    groups: dict[tuple[str, str], list[int]] = {}
    for k in kills:
        groups.setdefault((k.mode, k.durability), []).append(k.lost)
    return "; ".join(f"{m}/{d}: {len(v)} kills, lost max {max(v)} mean {sum(v) / len(v):.1f}"
                     for (m, d), v in groups.items())
