"""Issue 14, gradlog piece: the gradient log's bytes, time and read on workload A.

``gradient_log=100`` over one whole keyframe period (100 steps, so its bytes and
time per step are the steady state), against torch.save and no recording,
repeated and interleaved; then ``stepdump.open(run).state_dict(K - 1)`` on a
fresh Run against K x the optimizer step alone. Used by ``leave_on.py``
(``--only gradlog``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import workloads
from baselines import TorchSave
from measure import dir_size, settle

MB = 1e6


# -- gradient log ------------------------------------------------------------------------------
def _opt_step_timer(opt: torch.optim.Optimizer) -> tuple[list[float], Callable[[], None]]:
    """Wall ms of each ``optimizer.step()`` (pre- to post-hook); returns the list and a remover."""
    times: list[float] = []
    t0 = [0.0]

    def pre(*_: Any) -> None:
        t0[0] = time.perf_counter()

    def post(*_: Any) -> None:
        times.append((time.perf_counter() - t0[0]) * 1e3)

    h1, h2 = opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)

    def remove() -> None:
        h1.remove()
        h2.remove()

    return times, remove


def bench_gradlog(args: argparse.Namespace) -> dict[str, Any]:
    """gradient_log=K on workload A against torch.save and no recording; then the read at step K - 1."""
    K, steps = args.gl_every, args.gl_steps
    spelling = {"every": 1, "stats_every": 1} if args.gl_standin else {"gradient_log": K}
    spelled = ", ".join(f"{k}={v}" for k, v in spelling.items())
    work = args.work / "gradlog"
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"K": K, "steps": steps, "spelling": spelled, "standin": args.gl_standin,
                           "none_ms": [], "opt_ms": [], "torch_save_ms": [], "torch_save_bytes": [],
                           "gl_ms": [], "gl_bytes": []}
    print(f"\n== gradient log, workload A: Recorder({spelled}), {steps} steps per run, {args.gl_repeats} repeats "
          f"interleaved with no recording and torch.save ({args.gl_ref_steps} steps each)", flush=True)
    # The farthest step from its keyframe: K - 1 (or the last step of a shorter --quick run).
    read_step = min(K, steps) - 1
    kept: Path | None = None
    snapshot: dict[str, torch.Tensor] | None = None
    for rep in range(args.gl_repeats):
        order = ["none", "torch.save", "gl"] if rep % 2 == 0 else ["gl", "torch.save", "none"]
        for what in order:
            w = workloads.mlp()
            for _ in range(2):
                w.step(None)
            d = work / f"{what}-{rep}"
            settle()
            if what == "none":
                times, remove = _opt_step_timer(w.optimizer)
                t0 = time.perf_counter()
                for _ in range(args.gl_ref_steps):
                    w.step(None)
                out["none_ms"].append((time.perf_counter() - t0) / args.gl_ref_steps * 1e3)
                remove()
                out["opt_ms"].extend(times)
                print(f"  no recording {out['none_ms'][-1]:7.1f} ms/step; optimizer.step() alone median "
                      f"{statistics.median(times):.1f} ms", flush=True)
            elif what == "torch.save":
                saver = TorchSave(w, d)
                t0 = time.perf_counter()
                for _ in range(args.gl_ref_steps):
                    w.step(saver.hook)
                saver.close()
                out["torch_save_ms"].append((time.perf_counter() - t0) / args.gl_ref_steps * 1e3)
                out["torch_save_bytes"].append(dir_size(d) / args.gl_ref_steps)
                shutil.rmtree(d, ignore_errors=True)
                print(f"  torch.save   {out['torch_save_ms'][-1]:7.1f} ms/step "
                      f"{out['torch_save_bytes'][-1] / MB:7.1f} MB/step", flush=True)
            else:
                import stepdump

                last = rep == args.gl_repeats - 1
                try:
                    rec = stepdump.Recorder(d / "run", w.model, w.optimizer, **spelling)
                except Exception as e:  # noqa: BLE001 - the capture side may not take the keyword yet
                    out["error"] = f"Recorder({spelled}) not available yet: {type(e).__name__}: {e}"
                    print(f"  {out['error']}", flush=True)
                    break
                t0 = time.perf_counter()
                for i in range(steps):
                    if last and i == read_step:  # the reference for the read check: params at the start of it
                        snapshot = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
                    w.step(None)
                rec.close()
                out["gl_ms"].append((time.perf_counter() - t0) / steps * 1e3)
                out["gl_bytes"].append(dir_size(d) / steps)
                print(f"  {spelled:12s} {out['gl_ms'][-1]:7.1f} ms/step {out['gl_bytes'][-1] / MB:7.1f} MB/step",
                      flush=True)
                if last:
                    kept = d / "run"
                else:
                    shutil.rmtree(d, ignore_errors=True)
            del w
        if out.get("error"):
            break
    if kept is not None:
        out["read"] = gradlog_read(kept, read_step, snapshot)
        r = out["read"]
        print("  read: " + (r.get("error") or f"open + state_dict({read_step}) {r['state_dict_ms']:.0f} ms, "
                                              f"open + tensor(..., {read_step}) {r['tensor_ms']:.0f} ms, "
                                              f"bitwise equal: {r.get('equal')}"), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    settle()
    return out


def gradlog_read(path: Path, step: int, snapshot: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Time reading params at ``step`` (K - 1: the farthest from its keyframe) on fresh Runs."""
    import stepdump

    res: dict[str, Any] = {"step": step}
    try:
        run = stepdump.open(path)
        try:
            # Did the capture store grads at a step that is not a keyframe? (every=100 alone does not.)
            g = run.names("grads")
            res["grads_every_step"] = bool(g) and _has(run, g[0], 1, "grads")
            res["full_steps"] = len(getattr(run, "full_steps", []) or [])
        finally:
            run.close()
        t0 = time.perf_counter()
        run = stepdump.open(path)
        sd = run.state_dict(step)
        res["state_dict_ms"] = (time.perf_counter() - t0) * 1e3
        name = run.names("params")[0]
        run.close()
        t0 = time.perf_counter()
        run = stepdump.open(path)
        run.tensor(name, step)
        res["tensor_ms"] = (time.perf_counter() - t0) * 1e3
        run.close()
        if snapshot is not None:
            res["equal"] = sd.keys() == snapshot.keys() and all(torch.equal(sd[k], snapshot[k]) for k in sd)
    except Exception as e:  # noqa: BLE001 - the read side is being written: say so, do not crash
        res["error"] = f"not available yet: {type(e).__name__}: {e}".splitlines()[0][:300]
    return res


def _has(run: Any, name: str, step: int, kind: str) -> bool:
    try:
        run.tensor(name, step, kind)
        return True
    except Exception:  # noqa: BLE001 - stats-only step: no bytes stored
        return False
