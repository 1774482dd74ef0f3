"""Issue 25: Python calls per lean step, per thread, on the tiny workloads (a deterministic measure).

    .venv/bin/python benchmarks/profile_lean_calls.py                 # every tiny workload, 50 steps
    .venv/bin/python benchmarks/profile_lean_calls.py --workloads rl --steps 100 --top 25

Wall timings on a shared, loaded machine are noise; the number of Python function calls the
recorder makes per step is not (it is what a small model's step pays for: each call is
interpreter work on the training thread, or GIL time taken from it by a background thread).
For each workload (benchmarks/workloads_tiny.py) this runs the same steps twice, without a
recording and with a lean one (``every=None, stats_every=1``, ``profile=True``: what
benchmarks/leave_on_tiny.py runs), after a few warm-up steps, with a profile function on every
thread (``sys.setprofile`` / ``threading.setprofile``), and prints per step:

* **train +py / +c**: Python calls / calls of builtins (C functions: a torch op, a lock's
  ``acquire``) on the training thread, the recorded run minus the plain one;
* the same on each of the recorder's threads (writer, appender, stats worker), all theirs;
* the top functions by calls per step on each thread (training thread: the difference).

Counts may move by a few between runs where a thread polls (a queue ``get`` with a timeout).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from workloads_tiny import TINY  # noqa: E402

ARM: dict[str, Any] = {"every": None, "stats_every": 1, "profile": True}


class Calls:
    """Counts ``call`` / ``c_call`` profile events by thread role and function while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (role, "py"|"c", function)
        self._main = threading.main_thread().ident

    def _role(self) -> str:
        th = threading.current_thread()
        if th.ident == self._main:
            return "train"
        return "stats worker" if th.name.startswith("stepdump-stats") else type(th).__name__.lower()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            code = frame.f_code
            where = code.co_filename.rsplit("/src/", 1)[-1].rsplit("site-packages/", 1)[-1]
            self.counts[(self._role(), "py", f"{where}:{code.co_firstlineno} {code.co_name}")] += 1
        elif event == "c_call":
            name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
            mod = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
            self.counts[(self._role(), "c", f"{mod}.{name}")] += 1


def measure(name: str, recorded: bool, steps: int, warm: int) -> Counter[tuple[str, str, str]]:
    """Profile events of ``steps`` steps of workload ``name`` (after ``warm`` unprofiled ones)."""
    calls = Calls()
    sys.setprofile(calls)
    threading.setprofile(calls)  # the recorder's threads start after this (and pick it up)
    out = Path(tempfile.mkdtemp(prefix="stepdump-calls-"))
    rec = None
    try:
        w = TINY[name]()
        if recorded:
            import stepdump

            rec = stepdump.Recorder(out / "run", w.model, w.optimizer, **ARM)
        for _ in range(warm):
            w.step(None)
        calls.on = True
        for _ in range(steps):
            w.step(None)
        calls.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        if rec is not None:
            rec.close()
        shutil.rmtree(out, ignore_errors=True)
    return calls.counts


def report(name: str, steps: int, warm: int, top: int) -> dict[str, Any]:
    plain = measure(name, False, steps, warm)
    lean = measure(name, True, steps, warm)
    diff: Counter[tuple[str, str, str]] = Counter()
    for key in set(plain) | set(lean):
        d = lean.get(key, 0) - (plain.get(key, 0) if key[0] == "train" else 0)
        if d:
            diff[key] = d
    roles = sorted({k[0] for k in diff}, key=lambda r: (r != "train", r))
    summary: dict[str, Any] = {}
    print(f"\n== {name}: {steps} steps after {warm} warm-up, lean (every=None, stats_every=1), per step")
    for role in roles:
        py = sum(v for k, v in diff.items() if k[0] == role and k[1] == "py") / steps
        c = sum(v for k, v in diff.items() if k[0] == role and k[1] == "c") / steps
        summary[role] = {"py": py, "c": c}
        label = "train (recorded - plain)" if role == "train" else role
        print(f"  {label:28s} +py {py:8.1f}   +c {c:8.1f}")
    for role in roles:
        print(f"  -- top on {role}")
        rows = sorted(((v, k) for k, v in diff.items() if k[0] == role), reverse=True)[:top]
        for v, k in rows:
            print(f"     {v / steps:7.1f}  {k[1]:2s} {k[2]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(TINY))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    got = {n: report(n, args.steps, args.warm, args.top) for n in args.workloads.split(",")}
    print("\nsummary (calls per step: Python / builtin)")
    for n, roles in got.items():
        print(f"  {n:13s} " + "; ".join(f"{r} {v['py']:.0f} / {v['c']:.0f}" for r, v in roles.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
