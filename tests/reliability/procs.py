"""Child processes for the reliability tests: a fork server and what the children run.

Starting a Python that imports torch takes seconds on a small machine, and the
crash soak needs dozens of processes to kill. So a *zygote* (a fork server)
imports torch and stepdump once, runs no torch op (no intra-op threads exist
yet, which is what makes fork safe, as for DataLoader workers), and forks one
child per request. Each child is an ordinary, separate process: it opens its
own catalog connection, takes its own ``flock``, and dies by SIGKILL like any
training process would.

Children report through side files that they flush and fsync before acting,
so what the parent reads is what the child had done (or was about to do) when
it was killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent.parent


# -- the training run the crash children record ------------------------------------------------


def make_model_opt():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def iteration(model, opt, t: int):
    """Forward and backward of iteration ``t`` on its own deterministic batch (no optimizer step)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(1000 + t)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def tensor_hash(t) -> list[Any]:
    """[dtype, shape, xxh3-64 hex of the raw bytes]: independent of stepdump's own hashing code."""
    import torch
    import xxhash

    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), xxhash.xxh3_64_hexdigest(data)]


def step_hashes(model, opt) -> dict[str, list[Any]]:
    """What record t must hold, taken right before update t: params, grads, optimizer state."""
    import torch

    out: dict[str, list[Any]] = {}
    for name, p in model.named_parameters():
        out[f"params\t{name}"] = tensor_hash(p)
        if p.grad is not None:
            out[f"grads\t{name}"] = tensor_hash(p.grad)
        for key, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer\t{name}.{key}"] = tensor_hash(v)
    return out


class SideFile:
    """Append JSON lines, each flushed and fsynced before the child goes on."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._f = open(path, "a")  # noqa: SIM115 - lives as long as the child

    def emit(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())


def read_side(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete lines of a side file (a kill may cut the last one short)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


# -- what the children run -----------------------------------------------------------------------


#: Recorder options of each recording mode the kill tests train under (tests/reliability/losses.py).
MODES: dict[str, dict[str, Any]] = {
    "full": {},  # every step stored in full
    "lean": {"every": None, "stats_every": 1},  # stats-only steps (leave-it-on)
    "gradient_log": {"gradient_log": 8},  # grads every step, full state every 8 steps
}


def train_child(run_dir: str, side: str, codec: str = "raw", durability: str = "flush",
                stop_after: int | None = None, step_sleep: float = 0.0, mode: str = "full") -> None:
    """Record a training run into ``run_dir``, resuming it if it exists, until killed.

    Resuming means: restore the last committed step L, redo iteration L (its
    update is what produced the state of step L+1), then a Recorder with
    ``resume=True`` appends from L+1. The side file gets, before each
    ``optimizer.step()``, the hashes of what record t must hold and the monotonic
    time (``at``): a line for step t also says that ``optimizer.step()`` of t-1 returned.
    ``mode``: a key of :data:`MODES` (the crash chains record in full, where every
    step's tensors are checked).
    """
    import torch

    import stepdump

    torch.set_num_threads(1)
    out = SideFile(side)
    model, opt = make_model_opt()
    resumed_from = None
    closed = False  # the run ends with the final record of a clean close
    if (Path(run_dir) / "catalog.sqlite").exists():
        with stepdump.open(run_dir) as run:
            steps = run.steps
            if steps:
                resumed_from = steps[-1]
                closed = run.meta.get("final_step") == resumed_from
                run.restore(resumed_from, model, opt)
        if resumed_from is not None and not closed:
            iteration(model, opt, resumed_from)
            opt.step()
    # After a clean close the final record N holds the state before update N: resume there.
    start = 0 if resumed_from is None else resumed_from + (0 if closed else 1)
    rec = stepdump.Recorder(run_dir, model, opt, resume=True, codec=codec, durability=durability, **MODES[mode])
    out.emit({"event": "ready", "pid": os.getpid(), "step": rec.step, "resumed_from": resumed_from,
              "codec": codec, "durability": durability})
    if rec.step != start:
        raise RuntimeError(f"resumed Recorder starts at {rec.step}, expected {start}")
    t = start
    while stop_after is None or t < start + stop_after:
        loss = iteration(model, opt, t)
        out.emit({"step": t, "loss": loss.detach().item(), "h": step_hashes(model, opt), "at": time.monotonic()})
        opt.step()
        rec.log(loss=loss)
        t += 1
        if step_sleep:
            time.sleep(step_sleep)
    # close() writes the final record t: params and optimizer state after the last update, no grads.
    final = {k: v for k, v in step_hashes(model, opt).items() if not k.startswith("grads\t")}
    out.emit({"event": "final", "step": t, "h": final})
    rec.close()
    out.emit({"event": "closed", "next": t})


def hold_lock_child(run_dir: str, side: str, steps: int = 3) -> None:
    """Record ``steps`` steps, say so, then keep the Recorder (and its lock) open forever."""
    import torch

    import stepdump

    torch.set_num_threads(1)
    out = SideFile(side)
    model, opt = make_model_opt()
    rec = stepdump.Recorder(run_dir, model, opt)
    for t in range(steps):
        loss = iteration(model, opt, t)
        opt.step()
        rec.log(loss=loss)
    out.emit({"event": "holding", "pid": os.getpid(), "step": rec.step})
    while True:
        time.sleep(1)


def tail_child(run_dir: str, side: str, stop_file: str, poll: float = 0.002) -> None:
    """Tail a run that another process is writing; read every step as soon as it is visible.

    For each newly visible step, every tensor the catalog lists for it is read
    and hashed. Any exception is recorded (the parent fails the test on it).
    Stops after one last pass once ``stop_file`` exists.
    """
    import torch

    import stepdump

    torch.set_num_threads(1)
    out = SideFile(side)
    cat = Path(run_dir) / "catalog.sqlite"
    while not cat.exists():
        time.sleep(poll)
    seen: dict[int, dict[str, list[Any]]] = {}
    errors: list[str] = []
    views: list[int] = []  # how many steps each pass saw
    reads = 0
    run = stepdump.open(run_dir)
    out.emit({"event": "tailing", "pid": os.getpid()})
    while True:
        last_pass = os.path.exists(stop_file)
        try:
            steps = run.steps
            views.append(len(steps))
            if steps != list(range(len(steps))):
                errors.append(f"visible steps are not a prefix: {steps[:5]}...{steps[-5:]}")
            for t in steps:
                if t in seen:
                    continue
                got = {}
                for (kind, name), fp in run.fingerprints(t).items():
                    got[f"{kind}\t{name}"] = tensor_hash(run.tensor(name, t, kind=kind))
                    reads += 1
                seen[t] = got
        except Exception as e:  # noqa: BLE001 - the parent fails the test on any of these
            errors.append(f"{type(e).__name__}: {e}")
        if last_pass:
            break
        time.sleep(poll)
    run.close()
    out.emit({"event": "done", "seen": {str(k): v for k, v in seen.items()}, "errors": errors,
              "views": views, "reads": reads})


def txn_child(**kwargs: Any) -> None:
    """tests/reliability/txkill.py: die inside one transaction of the catalog."""
    from reliability.txkill import txn_child as child

    child(**kwargs)


FUNCS = {"train": train_child, "hold_lock": hold_lock_child, "tail": tail_child, "txn": txn_child}


# -- the fork server ---------------------------------------------------------------------------


def _warm_up() -> None:
    """Import everything the children use (torch imports torch._dynamo lazily, which
    takes seconds) by recording and reading two steps, with one intra-op thread so
    that no thread pool exists when we fork."""
    import shutil
    import tempfile

    import torch

    import stepdump

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="stepdump-zygote-")
    try:
        model, opt = make_model_opt()
        with stepdump.Recorder(Path(tmp) / "run", model, opt) as rec:
            for t in range(2):
                loss = iteration(model, opt, t)
                step_hashes(model, opt)
                opt.step()
                rec.log(loss=loss)
        with stepdump.open(Path(tmp) / "run") as run:
            run.restore(1, model, opt)
            tensor_hash(run.tensor("0.weight", 1))
            stepdump.verify(run)
            run.scalars()
            run.stats()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def zygote_main() -> None:
    """Read one JSON request per line from stdin, fork a child for it, answer its pid."""
    _warm_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                FUNCS[req["fn"]](**req["args"])
            except BaseException:  # noqa: BLE001 - report, then exit non-zero
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


class Zygote:
    """The parent's handle on the fork server."""

    def __init__(self) -> None:
        code = (f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); "
                "from reliability.procs import zygote_main; zygote_main()")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError("the fork server did not start")
        self.children: list[int] = []

    def spawn(self, fn: str, log: str | os.PathLike[str], **args: Any) -> int:
        self.proc.stdin.write(json.dumps({"fn": fn, "args": args, "log": str(log)}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        pid = int(json.loads(self.proc.stdout.readline())["pid"])  # type: ignore[union-attr]
        self.children.append(pid)
        return pid

    def kill(self, pid: int, timeout: float = 30.0) -> None:
        """SIGKILL a child and wait until the kernel has removed it."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone(pid, timeout)

    def close(self) -> None:
        for pid in self.children:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def alive(pid: int) -> bool:
    """True until the kernel has removed ``pid`` (a child of the zygote, which reaps it).

    A zombie leader does not count as gone: its other threads (the writer, maybe in
    the middle of an fsync) may still be exiting and holding its files and locks.
    """
    return os.path.exists(f"/proc/{pid}")


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} is still alive after {timeout} s")
        time.sleep(0.005)
