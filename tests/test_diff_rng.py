"""An RNG stream that differs while nothing computed from it differs is a note, not a divergence.

Issue 22, item 7: nanoGPT seeds torch only, so two bitwise-identical reruns differ in the
(unused) numpy and python ``random`` states; ``stepdump diff`` said "runs diverge at step 0,
first at rng numpy", exited 1, and hid a real lr change at step 10 behind that headline.

The row: for every stream the store records (python ``random``, numpy, torch CPU; CUDA is absent
on this machine, and its name goes through the same code), the stream seeded differently in the
two runs while training is identical (identical, exit 0, a note naming the stream); the same
plus an lr change at step 10 (the headline names the lr at step 10, exit 1); and the stream
*drawn from* by training (dropout, noise, a random scale), which does change training
(divergent, the reading names that RNG as the likely cause). Then ``ignore=`` / ``--ignore``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import record_run, tiny_model
from torch import nn

import stepdump

STEPS = 12


def _seed(stream: str, seed: int) -> None:
    """Seed one global stream (the others stay as they are, equal in both runs)."""
    if stream == "python":
        random.seed(seed)
    elif stream == "numpy":
        np.random.seed(seed)
    else:
        torch.manual_seed(seed)


def _draws(stream: str) -> Callable[[int, nn.Module, Any], torch.Tensor]:
    """A loss that draws from ``stream`` at every step: dropout, input noise, a random input scale."""
    def loss(t: int, model: nn.Module, b: Any) -> torch.Tensor:
        x, y = b
        if stream == "torch":
            out = nn.functional.dropout(model(x), p=0.5, training=True)
        elif stream == "numpy":
            out = model(x + torch.from_numpy(np.random.standard_normal(tuple(x.shape)).astype(np.float32)))
        else:
            out = model(x * random.uniform(0.5, 1.5))
        return nn.functional.mse_loss(out, y)
    return loss


def _run(path: Path, stream: str, seed: int, *, lr_at: int | None = None, draw: bool = False,
         **kw: Any) -> stepdump.types.Run:
    """SGD on the tiny MLP (the same weights and data in every run), ``stream`` seeded with ``seed``
    after the model is built; ``lr_at``: the lr halved for updates ``lr_at`` on."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _seed(stream, seed)

    def halve(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if lr_at is not None and t == lr_at - 1:
            opt.param_groups[0]["lr"] *= 0.5
    return stepdump.open(record_run(path, steps=STEPS, model=model, opt=opt, after_step=halve,
                                    loss_fn=_draws(stream) if draw else None, **kw))


STREAMS = ["python", "numpy", "torch"]


@pytest.fixture(autouse=True)
def _restore_global_streams():
    """These tests seed numpy and python ``random``: leave them as they were for the next test."""
    py, npy = random.getstate(), np.random.get_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)


@pytest.mark.parametrize("stream", STREAMS)
def test_a_differently_seeded_unused_stream_is_a_note(tmp_path, cli, stream):
    a, b = _run(tmp_path / "a", stream, 1), _run(tmp_path / "b", stream, 2)
    assert a.rng_state(0)[stream] is not None
    res = stepdump.diff(a, b)
    assert res.identical and res.first_step is None and res.differences == [] and res.reading == ""
    assert [(d.stream, d.first_step, d.steps) for d in res.rng] == [(stream, 0, STEPS + 1)]  # + the final record
    assert res.notes == [f"{stream} RNG differs at every step compared (0-{STEPS}); nothing computed differs"]
    lines = res.summary().splitlines()
    assert lines[0] == f"identical over {STEPS + 1} common steps"
    assert f"note: {res.notes[0]}" in lines
    out = cli("diff", a.path, b.path, ok=0).stdout
    assert out.startswith("identical over") and f"note: {stream} RNG differs" in out
    js = json.loads(cli("diff", a.path, b.path, "--json", ok=0).stdout)
    assert js["identical"] is True and js["notes"] == res.notes
    assert js["rng"] == [{"stream": stream, "first_step": 0, "last_step": STEPS, "steps": STEPS + 1}]


@pytest.mark.parametrize("stream", STREAMS)
def test_an_lr_change_is_the_headline_past_an_unused_stream(tmp_path, cli, stream):
    a, b = _run(tmp_path / "a", stream, 1), _run(tmp_path / "b", stream, 2, lr_at=10)
    res = stepdump.diff(a, b)
    assert not res.identical and res.first_step == 10
    assert (res.cause.stage, res.cause.what, res.cause.a, res.cause.b) == ("hyperparameters", "lr", 0.1, 0.05)
    assert res.headline() == "runs diverge at step 10, first at lr (A 0.1, B 0.05)"
    assert res.reading == "lr differs at step 10 → the schedule/hyperparameters differ"
    assert res.notes == [f"{stream} RNG differs at every step compared (0-10); nothing computed differs before "
                         "step 10"]
    assert all(d.stage != "rng" for d in res.differences)
    out = cli("diff", a.path, b.path, ok=1).stdout.splitlines()
    assert out[0] == "runs diverge at step 10, first at lr (A 0.1, B 0.05)"


@pytest.mark.parametrize("stream", STREAMS)
def test_a_stream_that_training_draws_from_is_the_likely_cause(tmp_path, cli, stream):
    a = _run(tmp_path / "a", stream, 1, draw=True)
    b = _run(tmp_path / "b", stream, 2, draw=True)
    res = stepdump.diff(a, b)
    assert not res.identical and res.first_step == 0
    # the verdict is the earliest computed difference: the loss (params are equal at step 0)
    assert (res.cause.stage, res.cause.what) == ("forward", "loss")
    assert res.headline().startswith("runs diverge at step 0, first at loss (A ")
    assert res.reading.startswith("params equal, loss differs at step 0 → ")
    assert f"the {stream} RNG differs at the start of step 0 (the likely cause" in res.reading
    assert [t.kind for t in res.tensors][:1] == ["grads"]
    assert cli("diff", a.path, b.path, ok=1).stdout.startswith("runs diverge at step 0, first at loss")
    # Left out, the RNG is no longer named: the reading says it was not compared.
    res = stepdump.diff(a, b, ignore=("rng",))
    assert res.first_step == 0 and "likely cause" not in res.reading and res.notes == []


def test_several_streams_in_one_note_as_nanogpt_has_them(tmp_path, cli):
    def run(path: Path, seed: int) -> stepdump.types.Run:
        model = tiny_model()  # seeds torch, as nanoGPT does; numpy and random are left as they are
        random.seed(seed)
        np.random.seed(seed)
        return stepdump.open(record_run(path, steps=STEPS, model=model, opt=torch.optim.SGD(model.parameters(), 0.1)))
    a, b = run(tmp_path / "a", 1), run(tmp_path / "b", 2)
    res = stepdump.diff(a, b)
    assert res.identical
    assert res.notes == [f"numpy and python RNG differ at every step compared (0-{STEPS}); nothing computed differs"]
    cli("diff", a.path, b.path, ok=0)


def test_a_stream_differing_at_some_steps_says_which(tmp_path):
    def draw_at_5(t: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if t == 5:
            np.random.random()  # during iteration 5: the start of iteration 6 on differs
    model = tiny_model()
    np.random.seed(0)
    a = stepdump.open(record_run(tmp_path / "a", steps=STEPS, model=model,
                                 opt=torch.optim.SGD(model.parameters(), 0.1)))
    model = tiny_model()
    np.random.seed(0)
    b = stepdump.open(record_run(tmp_path / "b", steps=STEPS, model=model,
                                 opt=torch.optim.SGD(model.parameters(), 0.1), before_step=draw_at_5))
    res = stepdump.diff(a, b)
    assert res.identical and [(d.stream, d.first_step, d.last_step, d.steps) for d in res.rng] == \
        [("numpy", 6, STEPS, STEPS - 5)]
    assert res.notes == [f"numpy RNG differs at {STEPS - 5} of {STEPS + 1} steps compared (first at step 6); "
                         "nothing computed differs"]


# -- leaving parts out ---------------------------------------------------------------------------


def test_ignore_rng_in_the_api_and_the_cli(tmp_path, cli):
    a, b = _run(tmp_path / "a", "numpy", 1), _run(tmp_path / "b", "numpy", 2, lr_at=10)
    same = _run(tmp_path / "s", "numpy", 3)
    for ignore in (("rng",), ("rng.numpy",), "rng"):
        res = stepdump.diff(a, same, ignore=ignore)
        assert res.identical and res.notes == [] and res.rng == [], ignore
        whole = ignore != ("rng.numpy",)
        assert ("rng" in res.coverage.state_parts) != whole and res.ignored == ["rng" if whole else "rng.numpy"]
        assert "ignored: " in res.summary()
        res = stepdump.diff(a, b, ignore=ignore)
        assert res.first_step == 10 and res.cause.what == "lr" and res.notes == [], ignore
    # a stream left out is not noted; the others still are
    res = stepdump.diff(a, same, ignore=["rng.python"])
    assert [d.stream for d in res.rng] == ["numpy"] and res.ignored == ["rng.python"]
    for args in (["--ignore", "rng"], ["--ignore", "rng.numpy"], ["--ignore", "rng.numpy,rng.python"],
                 ["--ignore", "rng.numpy", "--ignore", "rng.python"]):
        out = cli("diff", a.path, same.path, *args, ok=0).stdout
        assert out.startswith("identical over") and "note:" not in out and "ignored: rng" in out, args
        js = json.loads(cli("diff", a.path, b.path, *args, "--json", ok=1).stdout)
        assert js["first_step"] == 10 and js["notes"] == [] and js["ignored"] == sorted(",".join(args[1::2]).split(","))


def _logs_speed(t: int, loss: torch.Tensor) -> dict[str, Any]:
    return {"loss": loss, "speed": random.random()}  # a wall-clock-like reading: differs in every run


def test_ignore_the_other_parts(tmp_path, cli):
    # A logged scalar that differs in every run (a throughput) hides nothing once left out.
    model = tiny_model()
    a = stepdump.open(record_run(tmp_path / "a", steps=4, model=model, opt=torch.optim.SGD(model.parameters(), 0.1),
                                 log=_logs_speed))
    model = tiny_model()
    b = stepdump.open(record_run(tmp_path / "b", steps=4, model=model, opt=torch.optim.SGD(model.parameters(), 0.1),
                                 log=_logs_speed))
    res = stepdump.diff(a, b)
    assert res.first_step == 0 and res.cause.what == "speed"
    for ignore in (["scalars.speed"], ["scalars"]):
        res = stepdump.diff(a, b, ignore=ignore)
        assert res.identical and "speed" not in res.coverage.scalars, ignore
        assert ("loss" in res.coverage.scalars) == (ignore == ["scalars.speed"]), ignore
    cli("diff", a.path, b.path, "--ignore", "scalars.speed", ok=0)
    # hyperparameters: the lr (state and scalar) left out, the params it changed still differ
    c, d = _run(tmp_path / "c", "numpy", 1), _run(tmp_path / "d", "numpy", 1, lr_at=10)
    res = stepdump.diff(c, d, ignore=["hyperparameters"])
    assert res.first_step == 11 and res.cause.stage == "params" and "lr" not in res.coverage.scalars
    assert res.coverage.lr_steps == 0 and "hyperparameters" not in res.coverage.state_parts
    # a tensor kind left out is the same as leaving it out of kinds=
    res = stepdump.diff(c, d, ignore=["hyperparameters", "params", "optimizer"])
    assert (res.first_step, res.cause.what) == (11, "loss")  # the first thing compared that the lr changed
    assert res.coverage.kinds == ["grads"]


def test_ignoring_an_unknown_part_names_the_valid_ones(tmp_path, cli):
    a = _run(tmp_path / "a", "numpy", 1)
    for bad in (["rngs"], ["rng.mps"], ["scalars."], [""]):
        with pytest.raises(stepdump.ConfigError, match="cannot ignore") as e:
            stepdump.diff(a, a, ignore=bad)
        for part in ("hyperparameters", "scheduler", "scaler", "rng", "rng.torch", "rng.cuda", "rng.numpy",
                     "rng.python", "batch", "scalars", "scalars.<name>", "params", "grads", "optimizer"):
            assert part in str(e.value), (bad, part)
    err = cli("diff", a.path, a.path, "--ignore", "rngs", ok=2)
    assert "cannot ignore 'rngs'" in err.stdout + err.stderr and "rng.numpy" in err.stdout + err.stderr


def test_a_batch_drawn_from_a_differing_stream_names_it_as_a_possible_cause(tmp_path):
    """The batch is computed (data order, augmentation): it is the verdict, and the stream it may
    have been drawn from is named beside it."""
    def noisy(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.random.standard_normal((16, 8)).astype(np.float32))
        return x, torch.zeros(16, 4)
    runs = []
    for name, seed in (("a", 1), ("b", 2)):
        model = tiny_model()
        np.random.seed(seed)
        runs.append(stepdump.open(record_run(tmp_path / name, steps=3, model=model, batch=noisy,
                                             opt=torch.optim.SGD(model.parameters(), 0.1),
                                             capture=("params", "grads", "inputs"))))
    res = stepdump.diff(*runs)
    assert res.first_step == 0 and res.cause.stage == "batch" and res.cause.what.startswith("inputs ")
    assert res.reading.startswith("the batch differs at step 0 (inputs ")
    assert res.reading.endswith("; the numpy RNG differs too (a possible cause)")


def test_a_cuda_stream_goes_through_the_same_rule(tmp_path, monkeypatch):
    """No GPU here: the recorded state gains a ``cuda`` stream (one generator state per device, as
    core/rng.py records it) seeded differently in the two runs; the diff treats it like any stream."""
    from stepdump.core import rng

    real = rng.get_rng_state
    seed = {"value": 0}

    def with_cuda() -> dict[str, Any]:
        state = real()
        state["cuda"] = [torch.Generator().manual_seed(seed["value"]).get_state()]
        return state
    monkeypatch.setattr(rng, "get_rng_state", with_cuda)
    runs = []
    for name, s in (("a", 1), ("b", 2)):
        seed["value"] = s
        runs.append(_run(tmp_path / name, "numpy", 0))
    a, b = runs
    assert "cuda" in a.step_state(0)["rng"]
    res = stepdump.diff(a, b)
    assert res.identical and [d.stream for d in res.rng] == ["cuda"]
    assert res.notes == [f"cuda RNG differs at every step compared (0-{STEPS}); nothing computed differs"]
    assert stepdump.diff(a, b, ignore=["rng.cuda"]).notes == []
