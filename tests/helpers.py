"""Small models, deterministic data and bitwise comparisons shared by the core tests.

Everything here is written from the spec (DESIGN.md), not from stepdump's code:
the snapshots name tensors the way the spec says a run names them, so a test
comparing a run with a snapshot checks stepdump's naming too.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of the same width: equal bits <=> equal.

    Unlike ``torch.equal`` on floats this tells -0.0 from 0.0 and treats a NaN
    as equal to the very same NaN, which is what "recorded bit-exactly" means.
    """
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return t.view(_INT_VIEW[t.element_size()])


def python_calls(fn: Callable[[], object]) -> int:
    """Python-level calls (functions, and C functions called from Python code) made by ``fn()``:
    a deterministic measure of per-tensor Python where wall time on a loaded machine is noise.
    The garbage collector is off meanwhile: a collection would run other objects' finalizers
    inside the count."""
    import gc

    calls = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return calls


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor), f"{what}: got {type(a).__name__}, not a tensor"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def assert_same_tree(a: Any, b: Any, what: str = "") -> None:
    """Nested dicts/lists/tuples with tensors and plain values, compared exactly."""
    if isinstance(b, torch.Tensor):
        assert_same(a, b, what)
    elif isinstance(b, dict):
        assert isinstance(a, dict), f"{what}: {type(a).__name__} is not a dict"
        assert set(a) == set(b), f"{what}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in b:
            assert_same_tree(a[k], b[k], f"{what}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{what}/{i}")
    elif isinstance(b, float) and b != b:
        assert isinstance(a, float) and a != a, f"{what}: {a!r} is not nan"
    else:
        assert a == b and type(a) is type(b), f"{what}: {a!r} != {b!r}"


# -- snapshots the way the spec names things ---------------------------------------


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> recorded name: model names, else group{i}.param{j}."""
    names = {id(p): n for n, p in model.named_parameters()}
    for i, g in enumerate(optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            names.setdefault(id(p), f"group{i}.param{j}")
    return names


def all_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = param_names(model, optimizer)
    out = {n: p for n, p in model.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            out.setdefault(names[id(p)], p)
    return out


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Clones of params, grads and optimizer state tensors, named as a run names them."""
    params = all_params(model, optimizer)
    snap: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}, "optimizer": {}}
    with torch.no_grad():
        for n, p in params.items():
            snap["params"][n] = p.detach().clone()
            if p.grad is not None:
                snap["grads"][n] = p.grad.detach().clone()
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    snap["optimizer"][f"{n}.{k}"] = v.detach().clone()
    return snap


def assert_run_matches(run: Any, step: int, snap: dict[str, dict[str, torch.Tensor]],
                       kinds: Iterable[str] = ("params", "grads", "optimizer")) -> None:
    """Every kind of a recorded step holds exactly the snapshot's tensors, bit for bit."""
    for kind in kinds:
        got = run.tensors(step, kind)
        want = snap[kind]
        assert sorted(got) == sorted(want), f"step {step} {kind}: names {sorted(got)} != {sorted(want)}"
        for name, t in want.items():
            assert_same(got[name], t, f"step {step} {kind} {name}")
            # tensor() and tensors() must agree
            assert_same(run.tensor(name, step, kind=kind), t, f"step {step} {kind} {name} via tensor()")


def assert_final_record(run: Any, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                        step: int | None = None) -> int:
    """The run ends with the final record ``close()`` wrote (FORMAT.md ``final_step``): its last
    step, named by ``meta.final_step`` (``step`` when given), with no grads; given the live model
    and optimizer after training, it holds exactly their params and optimizer state. Returns it."""
    final = run.meta.get("final_step")
    assert isinstance(final, int), f"no final record: meta final_step is {final!r}"
    assert run.steps and run.steps[-1] == final, f"final_step {final} is not the last step of {run.steps[-5:]}"
    if step is not None:
        assert final == step, f"final_step {final} != {step}"
    assert run.tensors(final, "grads") == {}, "the final record has grads"
    if model is not None and optimizer is not None:
        assert_run_matches(run, final, snapshot(model, optimizer), kinds=("params", "optimizer"))
    return final


def training_scalars(run: Any, **kwargs: Any) -> Any:
    """``run.scalars(**kwargs)`` less the final record's row: asserts it is there (a row per
    step) and holds nothing (close() logs nothing; no update was skipped there)."""
    sc = run.scalars(**kwargs)
    final = run.meta.get("final_step")
    assert isinstance(final, int) and final in sc.index, f"no row for the final record {final!r}"
    row = sc.loc[final]
    assert not row["skipped"] and row.drop("skipped").isna().all(), f"the final record's row: {row.to_dict()}"
    return sc.drop(index=final)


def optimizer_state_clone(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of optimizer.state_dict() (tensors cloned)."""
    sd = optimizer.state_dict()
    return {
        "state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                  for i, s in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


# -- data and models ------------------------------------------------------------------


def gen(step: int, salt: int = 0) -> torch.Generator:
    """A generator seeded from the step index: data independent of the global RNG."""
    return torch.Generator().manual_seed(1_000_003 * salt + step)


def regression_batch(step: int, n: int = 8, d_in: int = 10, d_out: int = 1, salt: int = 0):
    g = gen(step, salt)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    return x, y


def classification_batch(step: int, n: int = 8, d_in: int = 784, classes: int = 10, salt: int = 0):
    g = gen(step, salt)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


# -- the recorded-run factory ----------------------------------------------------------

Hook = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def tiny_model(seed: int = 0, act: nn.Module | None = None) -> nn.Sequential:
    """The 8 -> 16 -> 4 MLP (names ``0.weight`` ... ``2.bias``) most recorded-run tests train; seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), act or nn.GELU(), nn.Linear(16, 4))


def tiny_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16 samples of 8 inputs and 4 targets, seeded by the step: the same data in every run."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def record_run(path: Any, *, steps: int = 5, start: int = 0, model: nn.Module | None = None,
               opt: torch.optim.Optimizer | None = None, scheduler: Any = None, scaler: Any = None,
               batch: Callable[[int], Any] = tiny_batch,
               loss_fn: Callable[[int, nn.Module, Any], torch.Tensor] | None = None,
               before_step: Hook | None = None, after_step: Hook | None = None,
               log: Callable[[int, torch.Tensor], dict[str, Any]] | None = None,
               **recorder_kwargs: Any) -> Any:
    """Train under a ``stepdump.Recorder(path, model, opt, ...)`` for iterations start..start+steps-1;
    return ``path``. Every test that needs a recorded run builds it here.

    Without ``model`` and ``opt``: ``tiny_model()`` with Adam (lr 1e-2) and a StepLR(5, 0.5)
    scheduler, so the run holds scheduler state too. One iteration ``t``::

        b = batch(t); opt.zero_grad(); loss = loss_fn(t, model, b)  # default: MSE of model(x) vs y
        (scaler.scale(loss) if scaler else loss).backward(); before_step(t, model, opt)
        scaler.step(opt); scaler.update()  # or opt.step()
        scheduler.step(); after_step(t, model, opt); rec.log(**log(t, loss))  # default: loss=loss

    ``start > 0`` resumes the run at ``path``. Hooks plant problems or take snapshots;
    ``recorder_kwargs`` go to the Recorder as they are.
    """
    import stepdump

    if model is None:
        model = tiny_model()
    if opt is None:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if scheduler is None:
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    if start > 0:
        recorder_kwargs.setdefault("resume", True)
    for key, value in (("scheduler", scheduler), ("scaler", scaler)):
        if value is not None:
            recorder_kwargs[key] = value
    with stepdump.Recorder(path, model, opt, **recorder_kwargs) as rec:
        for t in range(start, start + steps):
            b = batch(t)
            opt.zero_grad()
            loss = loss_fn(t, model, b) if loss_fn is not None else nn.functional.mse_loss(model(b[0]), b[1])
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if before_step is not None:
                before_step(t, model, opt)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if scheduler is not None:
                scheduler.step()
            if after_step is not None:
                after_step(t, model, opt)
            rec.log(**(log(t, loss) if log is not None else {"loss": loss}))
    return path


def one_step_run(path: Any) -> Any:
    """The smallest store: one SGD step of a seeded ``nn.Linear(4, 3)`` (tensors ``weight``
    and ``bias``), params only, raw codec; for tests that damage a store. ``path`` may be a URL."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return record_run(path, steps=1, model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1),
                      batch=lambda t: torch.randn(2, 4), loss_fn=lambda t, m, x: m(x).sum(), capture=("params",))


def train_recorded(path: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0,
                   **rec_kwargs: Any) -> list[dict[str, dict[str, torch.Tensor]]]:
    """``record_run`` on regression_batch(t) (8 in, 4 out), returning a snapshot of the model and
    optimizer taken at each pre-step moment (what record t must hold)."""
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    record_run(path, steps=steps, start=start, model=model, opt=opt,
               batch=lambda t: regression_batch(t, d_in=8, d_out=4),
               before_step=lambda t, m, o: snaps.append(snapshot(m, o)), **rec_kwargs)
    return snaps


def train_logging(rec: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int, pause: float = 0.0) -> None:
    """``steps`` steps of ``tiny_model`` on ``tiny_batch``, each logging ``loss=t`` to ``rec``
    (``pause``: seconds slept after each)."""
    for t in range(steps):
        x, y = tiny_batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        rec.log(loss=float(t))
        if pause:
            time.sleep(pause)


def peak_traced_bytes(fn: Any) -> int:
    """Peak Python-traced allocation while ``fn()`` runs (tracemalloc: numpy and torch CPU buffers too)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def catalog_sql(run_dir: Any, sql: str, args: Any = ()) -> list[Any]:
    """Run ``sql`` on a run's catalog directly (autocommit): how tests build damaged or hostile stores."""
    import sqlite3
    from pathlib import Path

    con = sqlite3.connect(Path(run_dir) / "catalog.sqlite", isolation_level=None)
    try:
        if sql.lstrip().upper().startswith(("SELECT", "WITH")) and "tensors" in sql:
            _chunk_rows_as_tensors(con)
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def same_value(a: Any, b: Any) -> bool:
    """Equal values, NaN (numpy frame) matching None (SQL / Arrow null), floats bit for bit."""
    import math

    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    if isinstance(a, float):
        return isinstance(b, float) and a.hex() == b.hex()
    return bool(a == b)


def delete_tensor_rows(run_dir: Any, where: str, args: Any = ()) -> int:
    """``DELETE FROM tensors WHERE <where>`` over every row a run recorded (:func:`rewrite_tensor_rows`):
    how a test plants a missing row. Returns the rows deleted."""
    return rewrite_tensor_rows(run_dir, where, args, lambda row: None)


def rewrite_tensor_rows(run_dir: Any, where: str, args: Any, change: Callable[[tuple], tuple | None]) -> int:
    """Each tensor row a run recorded that matches ``where`` (SQL over ``tensors``' columns), the
    catalog's rows and its stat chunks' rows alike, replaced by ``change(row)`` (a row of the
    ``tensors`` columns, in order) or dropped (None). A changed row becomes a ``tensors`` row (a
    reader takes it before a chunk's); a chunk is written again without the matched rows, or
    dropped when none is left. How tests plant damage or a missing row. Returns the rows matched."""
    import sqlite3
    from pathlib import Path

    import numpy as np

    from stepdump.store import stat_chunk

    con = sqlite3.connect(Path(run_dir) / "catalog.sqlite", isolation_level=None)
    try:
        chunks = bool(con.execute("SELECT 1 FROM sqlite_master WHERE name = 'stat_chunks'").fetchall())
        if chunks:
            _chunk_rows_as_tensors(con)
        table = "temp.tensors" if chunks else "main.tensors"
        rows = con.execute(f"SELECT * FROM {table} WHERE {where}", args).fetchall()
        keys = {(r[0], r[1]) for r in rows}
        if chunks:
            con.execute("DROP TABLE temp.tensors")
        con.execute("BEGIN")
        con.executemany("DELETE FROM main.tensors WHERE series = ? AND step = ?", sorted(keys))
        cols = stat_chunk.COUNT_STATS + stat_chunk.FLOAT_STATS
        for cid, n, data in (con.execute("SELECT id, rows, data FROM main.stat_chunks").fetchall() if chunks else []):
            a = stat_chunk.decode(data, n, cols, f"chunk {cid}")
            keep = np.asarray([(s, t) not in keys for s, t in zip(a.series.tolist(), a.step.tolist())], dtype=bool)
            if keep.all():
                continue
            if not keep.any():
                con.execute("DELETE FROM main.stat_chunks WHERE id = ?", (cid,))
                continue
            kept = a.take(keep)
            new = stat_chunk.encode_arrays(kept)
            con.execute("UPDATE main.stat_chunks SET first_step = ?, last_step = ?, rows = ?, checksum = ?, data = ? "
                        "WHERE id = ?", (int(kept.step.min()), int(kept.step.max()), len(kept),
                                         stat_chunk.checksum(new), new, cid))
        changed = [c for c in (change(tuple(r)) for r in rows) if c is not None]
        con.executemany(f"INSERT INTO main.tensors VALUES ({', '.join('?' * 16)})", changed)
        con.execute("COMMIT")
        return len(rows)
    finally:
        con.close()


def _chunk_rows_as_tensors(con: Any) -> None:
    """For a SELECT: a TEMP table ``tensors`` (which unqualified names reach before the catalog's)
    holding the catalog's tensor rows and its stat chunks' rows alike, decoded by the chunk codec
    (store/stat_chunk.py), so that a test's query sees every row a run recorded, wherever the
    writer put it. ``main.tensors`` still names the catalog's own table."""
    from stepdump.store import stat_chunk

    if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'stat_chunks'").fetchall():
        return
    con.execute("CREATE TEMP TABLE tensors AS SELECT * FROM main.tensors")
    for cid, n, data in con.execute("SELECT id, rows, data FROM main.stat_chunks ORDER BY id").fetchall():
        con.executemany(f"INSERT INTO temp.tensors VALUES ({', '.join('?' * 16)})",
                        stat_chunk.tensor_rows(stat_chunk.decode(data, n, stat_chunk.STAT_COLUMNS, f"chunk {cid}")))


def sigkill_child_when(script: Path, args: Iterable[Any], log_path: Path, ready: Callable[[], bool],
                       timeout: float = 120) -> None:
    """Run ``script`` as ``__main__`` with ARGS in a child process (output to ``log_path``) and
    SIGKILL it once ``ready()``; the test fails if the child dies or makes no progress first, and no
    child is left running. The child is forked from this process rather than a fresh ``python
    script``: torch and stepdump are imported already (a fresh interpreter spent ~4 s of CPU on
    that), and what is killed is the same: a process recording into the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # not pytest's capture
            # one intra-op thread, as in a fresh process of the suite: a thread pool the parent
            # started does not come across a fork (GNU OpenMP's can hang a child that uses it)
            torch.set_num_threads(1)
            sys.argv = [str(script), *map(str, args)]
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    status: int | None = None  # the child's wait status once reaped
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            assert not done, f"child died: {log_path.read_text()}"
            assert time.monotonic() < deadline, "child made no progress"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    finally:
        if status is None:  # the test failed with the child still running: kill and reap it
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


def tensor_row(run_dir: Any, step: int, kind: str, name: str) -> tuple[Any, Any]:
    """The (blob id, fingerprint) of one tensor row of a run's catalog."""
    (row,) = catalog_sql(run_dir, "SELECT blob, fingerprint FROM tensors WHERE step = ? AND series = "
                                  "(SELECT id FROM series WHERE kind = ? AND name = ?)", (step, kind, name))
    return row[0], row[1]


def set_tensor_row(run_dir: Any, step: int, kind: str, name: str, blob: Any, fp: Any) -> None:
    """Point one tensor row at another blob and fingerprint (a tampered record whose blob checks pass)."""
    n = rewrite_tensor_rows(run_dir, "step = ? AND series = (SELECT id FROM series WHERE kind = ? AND name = ?)",
                            (step, kind, name), lambda r: (*r[:4], blob, *r[5:15], fp))
    assert n == 1, (step, kind, name)  # the control: the row was there


def assert_seen_records(run: Any, seen: list[dict], first: int = 0) -> None:
    """Each dict of ``seen`` (what a probe callback saw at one update: ``params``, ``grads``,
    ``opt`` keyed ``(name, state key)``) is the record of step ``first + i``, bit for bit."""
    for i, s in enumerate(seen):
        t = first + i
        for n, v in s["params"].items():
            assert_same(run.tensor(n, t, "params"), v, f"params {n} @ {t}")
        assert set(run.tensors(t, "grads")) == set(s["grads"])
        for n, v in s["grads"].items():
            assert_same(run.tensor(n, t, "grads"), v, f"grads {n} @ {t}")
        for (n, k), v in s["opt"].items():
            assert_same(run.tensor(f"{n}.{k}", t, "optimizer"), v, f"optimizer {n}.{k} @ {t}")


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A new 1280x900 page of a playwright ``browser`` at ``url``, once its script has set
    ``body[data-ready='1']``; with the list that collects its console errors/warnings and page errors."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=15_000)
    return page, problems


# gloo connects the ranks over the interface the hostname resolves to; keep it on loopback.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists("/sys/class/net/lo") else {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_env(world: int, *pythonpath: Path) -> dict[str, str]:
    """The environment for ``world`` rank processes of one gloo job on loopback (rank not set),
    with ``pythonpath`` in front of PYTHONPATH."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", **LOOPBACK}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
    return env


def one_batch_run(path: Path) -> Path:
    """A plain loop's run (no framework callback): one SGD step of ``nn.Linear(2, 1)`` with its batch
    logged by hand; for tests that a framework-only path refuses it."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    import stepdump

    with stepdump.Recorder(path, model, opt) as rec:
        rec.log_batch(torch.ones(1, 2))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    return path


def seed_all(seed: int) -> None:
    """Seed torch's, numpy's and Python's global RNGs (a loop that draws from all three)."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def lean_model(seed: int = 0) -> nn.Sequential:
    """The lean-capture tests' model: layers wide enough that a lean record beats a full one."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(80, 90), nn.ReLU(), nn.Linear(90, 70))


def param_clones(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of each of the model's named parameters (its state at this moment)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def regression_loader(n: int = 16, batch: int = 4) -> torch.utils.data.DataLoader:
    """A fixed, unshuffled DataLoader of ``n`` (6-feature, 1-target) rows for the framework tests."""
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False)


def copy_run(src: Path, dst: Path) -> Path:
    """Replace ``dst`` with a copy of the run directory ``src`` (symlinks kept as links)."""
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True)
    return dst


def catalog_tables(run: Path) -> set[str]:
    """The names of the tables in a run's catalog."""
    return {r[0] for r in catalog_sql(run, "SELECT name FROM sqlite_master WHERE type = 'table'")}


def catalog_format_version(run: Path) -> int:
    """The format version a run's catalog says it is written in."""
    import json

    return int(json.loads(catalog_sql(run, "SELECT value FROM meta WHERE key = 'format_version'")[0][0]))


def weight_blob(path: Path) -> int:
    """The blob id of the parameter ``weight`` at step 0 (a one-Linear run)."""
    return catalog_sql(path, "SELECT t.blob FROM tensors t JOIN series s ON s.id = t.series "
                       "WHERE s.name = 'weight' AND t.step = 0")[0][0]
