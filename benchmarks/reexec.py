"""Issue 24: what re-executing one recorded step costs, and what the op tracer adds.

    .venv/bin/python benchmarks/reexec.py                        # make bench: writes its section of RESULTS.md
    .venv/bin/python benchmarks/reexec.py --out /tmp/R.md        # elsewhere (results.json beside it)
    .venv/bin/python benchmarks/reexec.py --quick --out ''       # few rounds, prints only

The workload is nanoGPT tiny (benchmarks/workloads_tiny.py: 2 layers, n_embd 64, block 64, batch
8, accumulation 2, AdamW, clipping), recorded for a few steps in full (``every=1``) and with a
gradient log (``gradient_log=4``), each micro-batch given to ``log_batch``. Then, in one process,
one torch thread, the arms run interleaved in rounds (each round rotates their order), and each
round's arm time is divided by that round's training step:

* ``train step``: one training iteration, no recording (the denominator);
* ``re-execute``: :func:`stepdump.reexec.engine.execute` from a prepared state (load the state,
  run the iteration, fingerprint every grad, param and optimizer tensor) plus reading the record's
  fingerprints and comparing: what each of ``repeat=N`` costs. Goal: ≤ 3× a training step;
* ``restore (full)`` / ``restore (gradient log)``: :func:`stepdump.reexec.engine.prepare`, reaching
  the step's state from the run (paid once per ``reexecute``, not per repeat), reported apart;
* ``reexecute(repeat=1)``: the whole public call (open run kept), restore included;
* ``step under the tracer``: the training iteration inside ``OpTracer().tracing(model)`` (every
  ATen op fingerprinted, with the user's source line; and without source lines).

Every re-execution is checked to reproduce (a benchmark of a wrong answer would be worthless).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from workloads_tiny import nanogpt_tiny  # noqa: E402

import stepdump  # noqa: E402
from stepdump.core.optrace import OpTracer  # noqa: E402
from stepdump.reexec.engine import differing, execute, prepare, recorded, stored_batch  # noqa: E402

MARKER = "\n## Re-execution (issue 24)"
GOAL = 3.0  # re-execution of one step vs one training step, restore apart
STEP = 3  # the step re-executed (recorded steps 0..STEPS-1; STEP+1 recorded too)
STEPS = 5
VOCAB, ACCUM = 65, 2


def factory() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., float]]:
    """nanoGPT tiny's model and optimizer, freshly built (seed 0), and its iteration as a train_step."""
    w = nanogpt_tiny()

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list) -> float:
        total = 0.0
        for x, y in micro:
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)) / ACCUM
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return w.model, w.optimizer, train_step


def batches(n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, VOCAB, (n, ACCUM, 8, 65), generator=g)
    return [[(toks[i, m, :, :-1], toks[i, m, :, 1:]) for m in range(ACCUM)] for i in range(n)]


def record(path: Path, **mode: Any) -> Path:
    model, opt, train_step = factory()
    with stepdump.Recorder(path, model, opt, **mode) as rec:
        for micro in batches(STEPS):
            for b in micro:
                rec.log_batch(b)
            rec.log(loss=train_step(model, opt, micro))
    return path


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def bench(work: Path, rounds: int) -> dict[str, Any]:
    runs = {"full": stepdump.open(record(work / "full", every=1)),
            "gradient log": stepdump.open(record(work / "gradlog", gradient_log=4))}
    model, opt, train_step = factory()
    run = runs["full"]
    prep = prepare(run, STEP, model, opt, train_step)
    batch = stored_batch(run, STEP, run.step_state(STEP))

    def reexec_once() -> None:
        ex = execute(prep, batch, model, opt, train_step)
        bad = differing(ex.fps, recorded(run, STEP, "loss"))
        if bad:
            raise SystemExit(f"re-execution of step {STEP} did not reproduce: {bad[:3]}")

    def whole() -> None:
        res = stepdump.reexecute(run, STEP, model, opt, train_step, repeat=1)
        if not res.reproduces:
            raise SystemExit(res.summary())

    def traced(source: bool) -> Callable[[], None]:
        def go() -> None:
            with OpTracer(source=source).tracing(model):
                train_step(model, opt, batch)
        return go

    arms: dict[str, Callable[[], Any]] = {
        "train step": lambda: train_step(model, opt, batch),
        "re-execute": reexec_once,
        "restore (full)": lambda: prepare(runs["full"], STEP, model, opt, train_step),
        "restore (gradient log)": lambda: prepare(runs["gradient log"], STEP, model, opt, train_step),
        "reexecute(repeat=1)": whole,
        "step under the tracer": traced(True),
        "step under the tracer, no source lines": traced(False),
    }
    for fn in arms.values():  # warm-up, and every re-execution path checked once
        fn()
    ms: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(rounds):
        for a in names[r % len(names):] + names[:r % len(names)]:
            ms[a].append(timed(arms[a]))
    tracer = OpTracer(source=False)
    with tracer.tracing(model):
        train_step(model, opt, batch)
    n_ops = len(tracer.records)
    params = sum(p.numel() for p in model.parameters())
    return {"ms": ms, "ops_per_step": n_ops, "params": params,
            "ratios": {a: [x / t for x, t in zip(ms[a], ms["train step"])] for a in arms if a != "train step"}}


def summary(res: dict[str, Any], rounds: int, date: str) -> dict[str, Any]:
    """What results.json holds: medians per arm, ratios to the training step, the goal's verdict."""
    med = statistics.median
    arms = {a: {"ms": med(v), "ratio": med(res["ratios"][a]) if a in res["ratios"] else 1.0,
                "spread": [min(res["ratios"][a]), max(res["ratios"][a])] if a in res["ratios"] else None}
            for a, v in res["ms"].items()}
    ratio = arms["re-execute"]["ratio"]
    return {"date": date, "rounds": rounds, "step": STEP, "params": res["params"], "ops_per_step": res["ops_per_step"],
            "train_ms": arms["train step"]["ms"], "reexec_ms": arms["re-execute"]["ms"], "reexec_ratio": ratio,
            "restore_full_ms": arms["restore (full)"]["ms"], "restore_gradlog_ms": arms["restore (gradient log)"]["ms"],
            "reexecute_call_ms": arms["reexecute(repeat=1)"]["ms"],
            "tracer_ratio": arms["step under the tracer"]["ratio"],
            "tracer_nosource_ratio": arms["step under the tracer, no source lines"]["ratio"],
            "goal": GOAL, "pass": ratio <= GOAL, "arms": arms, "raw_ms": res["ms"]}


def section(s: dict[str, Any], load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    L = ["", MARKER.strip(), "",
         (f"`benchmarks/reexec.py`, {s['date']}, {os.cpu_count()} cores, {platform.machine()}, torch threads 1, "
          f"{s['rounds']} interleaved rounds (arm order rotated each round), medians; each arm's ratio is to the "
          f"training step of its round. Load average before / after: {' '.join(f'{v:.2f}' for v in load[0])} / "
          f"{' '.join(f'{v:.2f}' for v in load[1])}. nanoGPT tiny ({s['params'] / 1e3:.0f} k params, accumulation 2, "
          f"AdamW, clipping; {s['ops_per_step']} ATen ops per step), step {s['step']} of a full and of a "
          "gradient-log run; every re-execution reproduced, bit for bit."),
         "", "| arm | ms | × train step | spread |", "|---|---:|---:|---|"]
    for a, v in s["arms"].items():
        spread = "–" if v["spread"] is None else f"{v['spread'][0]:.2f}–{v['spread'][1]:.2f}"
        L.append(f"| {a} | {v['ms']:.2f} | {v['ratio']:.2f}× | {spread} |")
    L += ["", f"Re-executing one step (state loaded from memory, iteration, every grad / param / optimizer tensor "
              f"fingerprinted and compared with the record): **{s['reexec_ratio']:.2f}×** a training step, goal ≤ "
              f"{GOAL:g}× plus the restore: **{'pass' if s['pass'] else 'FAIL'}**. The restore is paid once per "
              f"`reexecute` call ({s['restore_full_ms']:.1f} ms stored in full, {s['restore_gradlog_ms']:.1f} ms "
              f"rebuilt from a gradient log), each further repeat costs one re-execution. The op tracer "
              f"(`stepdump.core.optrace`, every op's inputs and outputs fingerprinted) makes a step "
              f"{s['tracer_ratio']:.1f}× slower with source lines, {s['tracer_nosource_ratio']:.1f}× without; it runs "
              "only under `--trace`, `--find-nan`, op-level `localize`, or after re-executions disagree.", ""]
    return "\n".join(L)


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="RESULTS.md to update ('' for none); "
                    "results.json beside it")
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    work = Path(tempfile.mkdtemp(prefix="stepdump-reexec-bench-"))
    try:
        s = summary(bench(work, rounds), rounds, date)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for a, v in s["arms"].items():
        print(f"  {a:40s} {v['ms']:8.2f} ms  {v['ratio']:6.2f}x train step", flush=True)
    print(f"re-execute / train step: {s['reexec_ratio']:.2f}x (goal <= {GOAL:g}x): {'pass' if s['pass'] else 'FAIL'}")
    if args.out:
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        out = Path(args.out)
        write_section(out, section(s, (load_before, os.getloadavg())))
        update("reexec", s, out.with_name("results.json"))
        print(f"wrote {out} and {out.with_name('results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
