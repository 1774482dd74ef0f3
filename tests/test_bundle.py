"""One-step bundles (issue 24 item 5, docs/reexecute.md "Attach a step to a bug report").

``stepdump bundle RUN --step k -o step-k.stepdump`` writes step k as a small store of its own: the
state at k, its RNG and batch, the recorded fingerprints of k and k+1. It must be a store like any
run (open, verify, reexecute), re-execute in a fresh process with the source run gone, keep the record's
fingerprints (a grad whose bit flipped at record time is still *differs from the record*), and hold
about one step of state plus the batch, not the grads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import stepdump
from stepdump.errors import ConfigError, RunExistsError, StepNotFoundError
from stepdump.reexec.bundle import bundle

FACTORY = '''
"""A tiny loop for the bundle tests: the --entry factory and the batches the run was fed."""
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), train_step


def train_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def batch(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
'''

MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "keyframe": {"keyframe_every": 4},
    "gradlog": {"gradient_log": 4},
    "lean": {"every": None, "stats_every": 1},
}
STEP = 3  # neither a keyframe of the keyframe run nor of the gradient log: rebuilt there
FLIPPED = "0.weight"


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the factory module ``bundle_factory`` (on sys.path for this module)."""
    d = tmp_path_factory.mktemp("code")
    (d / "bundle_factory.py").write_text(FACTORY)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("bundle_factory", None)


def record(path: Path, mode: str, steps: int = 6, flip_at: int | None = None) -> Path:
    import bundle_factory as F

    model, opt, train_step = F.make()
    seen = [0]
    if flip_at is not None:
        def flip(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if seen[0] == flip_at:  # one bit of one grad, after backward, before the update and the record
                model.get_parameter(FLIPPED).grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
            seen[0] += 1
        opt.register_step_pre_hook(flip)
    with stepdump.Recorder(path, model, opt, **MODES[mode]) as rec:
        for t in range(steps):
            b = F.batch(t)
            rec.log_batch(b)
            rec.log(loss=train_step(model, opt, b))
    return path


def objects() -> dict[str, Any]:
    import bundle_factory as F

    model, opt, train_step = F.make()
    return {"model": model, "optimizer": opt, "train_step": train_step}


def reexec_elsewhere(code: Path, path: Path, step: int) -> tuple[int, dict[str, Any]]:
    """`stepdump reexecute` in a fresh Python process, run from the factory's directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "stepdump", "reexecute", str(path), "--step", str(step),
                           "--entry", "bundle_factory:make", "--json"], cwd=code, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- a bundle is a store that re-executes elsewhere ------------------------------------------------------
@pytest.mark.parametrize(("mode", "via"), [("full", "api"), ("gradlog", "api"), ("keyframe", "api"),
                                           ("full", "cli"), ("keyframe", "cli")])
def test_bundle_reexecutes_in_a_fresh_process_with_the_run_gone(tmp_path: Path, code: Path, mode: str,
                                                                 via: str, capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    run_dir = record(tmp_path / "run", mode)
    out = tmp_path / f"step-{STEP}.stepdump"
    with stepdump.open(run_dir) as run:
        recorded = {s: run.fingerprints(s) for s in (STEP, STEP + 1)}
        loss = [v for s, n, v in run.scalar_rows(STEP) if n == "loss"]
    if via == "api":
        kw = objects() if mode == "keyframe" else {}
        with stepdump.open(run_dir) as run:
            made = bundle(run, STEP, out, **kw)
        assert made.path == out and made.step == STEP
    else:
        from stepdump.cli.main import main

        args = ["bundle", str(run_dir), "--step", str(STEP), "-o", str(out)]
        assert main(args + (["--entry", "bundle_factory:make"] if mode == "keyframe" else [])) == 0
        assert "bytes" in capsys.readouterr().out
    shutil.rmtree(run_dir)

    with stepdump.open(out) as b:
        assert b.steps == [STEP] and b.stats_steps == [STEP, STEP + 1]
        # The record's fingerprints of k and k+1, every one of them, unchanged; a keyframe run's step
        # between keyframes gains its optimizer state (replayed), which the source held no row of.
        for s in (STEP, STEP + 1):
            got = b.fingerprints(s)
            assert {k: got[k] for k in recorded[s]} == recorded[s], s
            assert {k for k in got if k not in recorded[s]} == (
                {("optimizer", f"{p}.{k}") for p in ("0.weight", "0.bias", "3.weight", "3.bias")
                 for k in ("step", "exp_avg", "exp_avg_sq")} if mode == "keyframe" and s == STEP else set()), s
        assert [v for s, n, v in b.scalar_rows(STEP) if n == "loss"] == loss
        assert b.meta["bundle"]["step"] == STEP and b.meta["gradient_log"] is None
        assert stepdump.verify(b).ok  # every stored tensor's bytes against its (recorded) fingerprint
        assert set(b.state_dict(STEP)) == set(objects()["model"].state_dict())
    code_rc, got = reexec_elsewhere(code, out, STEP)
    assert (code_rc, got["verdict"]) == (0, "reproduces"), got
    assert got["compared"] >= 1 + 3 * 4, got  # the loss, 4 grads, 4 params and their AdamW state after
    assert got["how"].startswith("restored"), got


def test_bundle_holds_one_step_of_state_and_the_batch_not_the_grads(tmp_path: Path, code: Path) -> None:
    with stepdump.open(record(tmp_path / "run", "full")) as run:
        made = bundle(run, STEP, tmp_path / "b")
        want = {k: sum(t.numel() * t.element_size() for t in run.tensors(STEP, k).values())
                for k in ("params", "optimizer", "inputs", "grads")}
        state = sum(t.numel() * t.element_size() for t in
                    (run.tensor(n, STEP, "state") for n in run.catalog.stored_names(STEP, "state")))
    with stepdump.open(made.path) as b:
        stored, raw = b.blob_bytes()
        assert raw == want["params"] + want["optimizer"] + want["inputs"] + state  # and nothing else
        with pytest.raises(StepNotFoundError):
            b.tensor(FLIPPED, STEP, "grads")  # the grads are there as fingerprints only
    assert made.tensor_bytes == stored and made.bytes == dir_bytes(made.path)
    assert made.state_bytes == want["params"] + want["optimizer"]
    assert f"{made.bytes} bytes" in made.summary() and str(made.state_bytes) in made.summary()


# -- it keeps the record: a flipped bit at record time, a flipped bit in the bundle ---------------------------
@pytest.mark.parametrize("mode", ["full", "gradlog"])
def test_bundle_of_a_step_whose_grad_flipped_differs_from_the_record(tmp_path: Path, code: Path, mode: str) -> None:
    with stepdump.open(record(tmp_path / "run", mode, flip_at=STEP)) as run:
        bundle(run, STEP, tmp_path / "flipped")
        bundle(run, STEP - 1, tmp_path / "before")
    with stepdump.open(tmp_path / "flipped") as b:
        r = stepdump.reexecute(b, STEP, **objects(), repeat=2)
    assert r.verdict == "differs from the record", r.summary()
    assert r.first == ("grads", FLIPPED) and r.cause == "suspected corruption at record time"
    with stepdump.open(tmp_path / "before") as b:
        r = stepdump.reexecute(b, STEP - 1, **objects(), repeat=2)
    assert r.verdict == "reproduces", r.summary()


def test_a_bit_flipped_in_the_bundle_itself_is_found_not_re_executed(tmp_path: Path, code: Path) -> None:
    with stepdump.open(record(tmp_path / "run", "full")) as run:
        made = bundle(run, STEP, tmp_path / "b")
    seg = next((made.path / "segments").iterdir())
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x10
    seg.write_bytes(bytes(data))
    with stepdump.open(made.path) as b:
        assert not stepdump.verify(b).ok
        r = stepdump.reexecute(b, STEP, **objects())  # said as damaged, nothing compared with it
        assert r.verdict == "the record is damaged" and r.damaged and r.how == "not re-executed", r.summary()


# -- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "step", "kw", "error", "words"), [
    ("lean", STEP, {}, StepNotFoundError, "cannot be bundled"),
    ("keyframe", STEP, {}, ConfigError, "--entry"),
    ("full", 99, {}, StepNotFoundError, "99"),
    ("full", STEP, {"exists": True}, RunExistsError, "already"),
])
def test_bundle_refuses_with_the_reason(tmp_path: Path, code: Path, mode: str, step: int, kw: dict[str, Any],
                                        error: type, words: str) -> None:
    out = tmp_path / "out"
    with stepdump.open(record(tmp_path / "run", mode)) as run:
        if kw.get("exists"):
            bundle(run, step, out)
        with pytest.raises(error, match=words):
            bundle(run, step, out)
