"""Crash soak: SIGKILL a recording training process at random moments, check, resume, repeat.

One *chain* is one run directory. Each trial forks a child that resumes the run
(or starts it), trains and records until the parent kills it after a random
delay (which lands anywhere: while restoring, while the Recorder is created,
while staging, encoding, appending or committing a step). After every kill:

* the store opens and ``stepdump.verify`` finds nothing wrong;
* the visible steps are a contiguous prefix 0..L and no step visible before
  the kill has disappeared;
* no Recorder holds the run (the dead process's ``flock`` went with it);
* every visible step reads back bit-exact: each tensor's dtype, shape and
  xxh3 hash equal what the child reported through its fsynced side file before
  that ``optimizer.step()``; and the set of tensors is exactly the reported one;
* the next child resumes from L+1 (it checks that ``Recorder(resume=True)``
  starts there, and the hashes it reports for steps a killed child had already
  reported must be identical: restore + redo reproduces the run bit-exactly).

Logged scalars are committed with the next step's transaction, so the loss of
the last step visible at a kill is the only scalar a kill may lose.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliability.procs import Zygote, alive, read_side, tensor_hash

CODECS = ("raw", "zstd", "blosc-lz4", "delta-lz4", "delta-lz4")  # delta: chains must survive kills too


class SoakFailure(AssertionError):
    pass


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SoakFailure(msg)


@dataclass
class ChainResult:
    trials: int = 0
    steps: int = 0
    phases: Counter = field(default_factory=Counter)  # where the kills landed
    seconds: float = 0.0
    lost_scalars: int = 0  # losses missing from the final run (each a step that was last visible at a kill)


class Chain:
    """One run directory killed and resumed ``trials`` times."""

    def __init__(self, zygote: Zygote, work: Path, seed: int, max_delay: float = 0.6) -> None:
        self.z = zygote
        self.work = work
        self.run_dir = work / "run"
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.reported: dict[int, dict[str, Any]] = {}  # step -> first report
        self.final: dict[str, Any] | None = None  # what the closing child's final record must hold
        self.visible: list[int] = []
        self.may_lose_loss: set[int] = set()
        self.checked_upto = 0  # steps below this were read back already
        self.result = ChainResult()

    # -- one trial ------------------------------------------------------------------------
    def trial(self, i: int) -> None:
        side = self.work / f"side{i:03d}.jsonl"
        log = self.work / f"child{i:03d}.log"
        codec = self.rng.choice(CODECS)
        durability = "fsync" if self.rng.random() < 0.25 else "flush"
        delay = self.rng.uniform(0, self.max_delay)
        pid = self.z.spawn("train", log, run_dir=str(self.run_dir), side=str(side), codec=codec,
                           durability=durability)
        time.sleep(delay)
        _check(alive(pid), f"trial {i}: the child died on its own:\n{_tail(log)}")
        self.z.kill(pid)
        self._after_kill(i, side, log)

    def finish(self, steps: int = 15) -> None:
        """A last child that records ``steps`` more steps and closes normally."""
        i = self.result.trials
        side, log = self.work / f"side{i:03d}.jsonl", self.work / f"child{i:03d}.log"
        pid = self.z.spawn("train", log, run_dir=str(self.run_dir), side=str(side), stop_after=steps)
        deadline = time.monotonic() + 120
        while alive(pid):
            _check(time.monotonic() < deadline, "the final child did not finish")
            time.sleep(0.01)
        lines = read_side(side)
        _check(bool(lines) and lines[-1].get("event") == "closed", f"final child failed:\n{_tail(log)}")
        self._absorb(i, lines)
        _check(self.final is not None and self.final["step"] == lines[-1]["next"],
               f"final child did not report its final record:\n{_tail(log)}")
        self._check_store(i, final=True)

    # -- checks ---------------------------------------------------------------------------------
    def _after_kill(self, i: int, side: Path, log: Path) -> None:
        lines = read_side(side)
        ready = next((x for x in lines if x.get("event") == "ready"), None)
        self._absorb(i, lines)
        if not (self.run_dir / "catalog.sqlite").exists():
            _check(ready is None and not self.visible, f"trial {i}: the catalog vanished")
            self.result.phases["before the catalog existed"] += 1
            self.result.trials += 1
            return
        before = len(self.visible)
        self._check_store(i)
        new = len(self.visible) - before
        if ready is None:
            phase = "restoring / creating the Recorder"
        elif new == 0:
            phase = "recording, no new step committed yet"
        else:
            phase = "recording, after new steps committed"
        self.result.phases[phase] += 1
        # The loss of the last visible step is committed with the next step: a kill may lose it.
        if self.visible:
            self.may_lose_loss.add(self.visible[-1])
        self.result.trials += 1

    def _absorb(self, i: int, lines: list[dict[str, Any]]) -> None:
        for x in lines:
            if x.get("event") == "ready":
                want = self.visible[-1] if self.visible else None
                _check(x["resumed_from"] == want,
                       f"trial {i}: the child resumed after step {x['resumed_from']}, the run's last is {want}")
                _check(x["step"] == (0 if want is None else want + 1),
                       f"trial {i}: Recorder(resume=True) starts at {x['step']}")
            if x.get("event") == "final":  # the record close() writes: no grads, no loss
                self.final = x
            elif "step" in x and "h" in x:
                t = x["step"]
                old = self.reported.get(t)
                if old is None:
                    self.reported[t] = x
                else:  # a killed child had got this far already: the redo must be identical
                    _check(old["h"] == x["h"] and old["loss"] == x["loss"],
                           f"trial {i}: step {t} computed after resuming differs from the first time")

    def _check_store(self, i: int, final: bool = False) -> None:
        import stepdump

        with stepdump.open(self.run_dir) as run:
            _check(not run.live, f"trial {i}: the run still looks locked after its writer died")
            report = stepdump.verify(run)
            _check(report.ok, f"trial {i}: verify found {report.problems[:3]}")
            steps = run.steps
            _check(steps == list(range(len(steps))), f"trial {i}: visible steps are not a prefix: {steps[-5:]}")
            _check(run.all_steps == steps, f"trial {i}: steps without data: {sorted(set(run.all_steps) - set(steps))}")
            # Only a clean close writes a final record; it is then the run's last step.
            want_final = self.final["step"] if final and self.final is not None else None
            _check(run.meta.get("final_step") == want_final,
                   f"trial {i}: meta final_step is {run.meta.get('final_step')}, expected {want_final}")
            if want_final is not None:
                _check(steps[-1] == want_final, f"trial {i}: the final record {want_final} is not the last step")
            _check(len(steps) >= len(self.visible), f"trial {i}: steps disappeared: {len(self.visible)} -> {len(steps)}")
            # Re-read the newest steps every time, and everything at the end.
            start = 0 if final else max(0, min(self.checked_upto, len(self.visible)) - 2)
            for t in steps[start:]:
                self._check_step(run, t, i)
            self.checked_upto = len(steps)
            self.visible = steps
            self._check_scalars(run, i, final)
        self.result.steps = len(self.visible)

    def _check_step(self, run: Any, t: int, i: int) -> None:
        rep = self.final if self.final is not None and t == self.final["step"] else self.reported.get(t)
        _check(rep is not None, f"trial {i}: step {t} is visible but was never reported by a child")
        keys = {f"{k}\t{n}" for k, n in run.fingerprints(t)}
        _check(keys == set(rep["h"]), f"trial {i}: step {t} holds {sorted(keys ^ set(rep['h']))} unexpectedly")
        for key, want in rep["h"].items():
            kind, name = key.split("\t")
            got = tensor_hash(run.tensor(name, t, kind=kind))
            _check(got == want, f"trial {i}: {kind} {name} at step {t} reads back as {got}, child had {want}")

    def _check_scalars(self, run: Any, i: int, final: bool) -> None:
        df = run.scalars()
        have = {} if "loss" not in df.columns else df["loss"].dropna().to_dict()
        # The final record is no training step: nothing is logged at it.
        trained = [t for t in self.visible if self.final is None or t != self.final["step"]]
        if self.final is not None:
            _check(self.final["step"] not in have, f"trial {i}: a loss at the final record {self.final['step']}")
        if final:
            self.result.lost_scalars = sum(t not in have for t in trained)
        for t in trained:
            if t in have:
                _check(have[t] == self.reported[t]["loss"], f"trial {i}: loss at step {t} differs")
            elif t not in self.may_lose_loss and (final or t != trained[-1]):
                raise SoakFailure(f"trial {i}: the loss of step {t} is missing")


def run_chain(zygote: Zygote, work: Path, trials: int, seed: int, max_delay: float = 0.6) -> ChainResult:
    work.mkdir(parents=True, exist_ok=True)
    chain = Chain(zygote, work, seed, max_delay)
    started = time.monotonic()
    for i in range(trials):
        chain.trial(i)
    chain.finish()
    chain.result.seconds = time.monotonic() - started
    return chain.result


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text()[-n:]
    except FileNotFoundError:
        return "(no log)"
