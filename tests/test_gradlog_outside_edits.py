"""A gradient log with params changed outside the optimizer (docs/gradient-log.md, "Params changed
outside the optimizer"): a clamp or projection after ``optimizer.step()``, a pruning mask through
``.data`` between backward and step, ``vector_to_parameters``, a write through a numpy view, a
``copy_`` under no_grad. Replay cannot derive such params from the recorded updates; the recorder
sees the change at the optimizer's pre-hook (it compares the params entering update k+1 with what
update k produced, by content: ``.data`` and numpy writes bump no version counter) and stores
what replay cannot derive, so every step still reads exactly.

The row: every kind of edit x {SGD with momentum, AdamW}. The oracle is the training itself: a
live snapshot of the model and the optimizer at the moment each record is of (right before each
update, after an edit made between backward and step), compared bit for bit with what the run
reads back at every step; ``stepdump verify`` exits 0; ``stepdump info`` says which steps are
stored in full and at which steps params were stored between keyframes, exactly the steps the
edits changed; and the recorder says so once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_tree, bits, catalog_sql, optimizer_state_clone, record_run
from torch import nn

import stepdump
from stepdump.cli.main import main

K = 4
STEPS = 10
KEYFRAMES = {0, 4, 8, STEPS}  # every K-th step, and the final record close() writes
WARNING = "changed outside the optimizer"

Model = nn.Sequential


def _model() -> Model:
    """Ten params (five Linear layers): an edit of a single param of many leaves nine alone."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


OPTIMIZERS: dict[str, Callable[[Model], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
}


@dataclass(frozen=True)
class Edit:
    """A change of params outside the optimizer: ``when`` "after" (after ``optimizer.step()`` of
    iteration t, so record t + 1 holds it) or "before" (between backward and step of iteration t,
    so record t holds it); ``apply(t, model)`` edits."""

    when: str
    apply: Callable[[int, Model], None]


def _clamp(t: int, m: Model) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.clamp_(-0.2, 0.2)


def _prune(t: int, m: Model) -> None:
    g = torch.Generator().manual_seed(7)
    for name, p in m.named_parameters():
        if name.endswith("weight"):
            p.data.mul_((torch.rand(p.shape, generator=g) > 0.5).to(p.dtype))  # a fixed mask per weight


def _vector_to_parameters(t: int, m: Model) -> None:
    vec = nn.utils.parameters_to_vector(m.parameters())
    nn.utils.vector_to_parameters(vec * 0.99, m.parameters())  # `param.data = ...`: new storage, no version bump


def _numpy_view(t: int, m: Model) -> None:
    m[0].weight.detach().numpy()[0, :] *= 0.5  # straight into the param's memory


def _copy_no_grad(t: int, m: Model) -> None:
    with torch.no_grad():
        m[2].weight.copy_(m[2].weight * 0.9)


def _clamp_at_5(t: int, m: Model) -> None:
    if t == 5:
        _clamp(t, m)


def _one_of_many(t: int, m: Model) -> None:
    m[4].bias.data.add_(0.01)


EDITS: dict[str, Edit | None] = {
    "clamp-after-step": Edit("after", _clamp),
    "data-mul-mask-before-step": Edit("before", _prune),
    "vector-to-parameters-before-step": Edit("before", _vector_to_parameters),
    "numpy-view-before-step": Edit("before", _numpy_view),
    "copy-under-no-grad-after-step": Edit("after", _copy_no_grad),
    "clamp-at-one-step-only": Edit("after", _clamp_at_5),
    "one-param-of-many-every-step": Edit("after", _one_of_many),
    "no-edit": None,  # the control: nothing stored between keyframes, nothing said
}


@dataclass
class Recorded:
    path: Path
    states: list[dict[str, torch.Tensor]]  # model.state_dict() entering each update, and at the end
    optimizer: list[dict[str, Any]]  # optimizer.state_dict() likewise
    changed: set[int]  # records whose params an edit changed (bits differ from the update's output)


def _record(path: Path, opt_name: str, edit: Edit | None) -> Recorded:
    model = _model()
    opt = OPTIMIZERS[opt_name](model)
    states: list[dict[str, torch.Tensor]] = []
    optim: list[dict[str, Any]] = []
    changed: set[int] = set()

    def state() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def edited(t: int, record: int) -> None:
        assert edit is not None
        before = [bits(p).clone() for p in model.parameters()]
        edit.apply(t, model)
        if any(not torch.equal(b, bits(p)) for b, p in zip(before, model.parameters())):
            changed.add(record)

    def before_step(t: int, m: Model, o: torch.optim.Optimizer) -> None:
        if edit is not None and edit.when == "before":
            edited(t, t)
        states.append(state())
        optim.append(optimizer_state_clone(o))

    def after_step(t: int, m: Model, o: torch.optim.Optimizer) -> None:
        if edit is not None and edit.when == "after":
            edited(t, t + 1)

    record_run(path, steps=STEPS, model=model, opt=opt, batch=lambda t: (
        torch.randn(16, 8, generator=torch.Generator().manual_seed(t)),
        torch.randn(16, 4, generator=torch.Generator().manual_seed(100 + t))),
        before_step=before_step, after_step=after_step, gradient_log=K)
    states.append(state())  # the final record: the model after the last update (and any edit after it)
    optim.append(optimizer_state_clone(opt))
    return Recorded(path, states, optim, changed)


CASES = [pytest.param(o, e, id=f"{e}-{o}") for e in EDITS for o in OPTIMIZERS]


@pytest.mark.parametrize("opt_name,edit_name", CASES)
def test_every_step_reads_exactly_what_trained_verify_passes_info_is_true_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        opt_name: str, edit_name: str) -> None:
    edit = EDITS[edit_name]
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        rec = _record(tmp_path / "run", opt_name, edit)
    said = [r for r in caplog.records if WARNING in r.getMessage()]
    if edit is None:
        assert rec.changed == set() and said == [], [r.getMessage() for r in said]
    else:
        assert rec.changed - KEYFRAMES, f"the edit changed no record between keyframes: {sorted(rec.changed)}"
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        first = min(rec.changed - {0})  # an edit before the first update is part of keyframe 0
        assert f"between steps {first - 1} and {first}" in said[0].getMessage(), said[0].getMessage()

    with stepdump.open(rec.path) as run:
        assert run.steps == list(range(STEPS + 1))
        for s in range(STEPS + 1):
            assert_same_tree(dict(run.state_dict(s)), rec.states[s], f"state_dict({s})")
            assert_same_tree(run.optimizer_state_dict(s), rec.optimizer[s], f"optimizer_state_dict({s})")
            params = run.tensors(s, "params")
            assert_same_tree(params, {n: rec.states[s][n] for n in params}, f"tensors({s}, 'params')")
            for n in params:
                assert_same_tree(run.tensor(n, s), rec.states[s][n], f"tensor({n!r}, {s})")

    capsys.readouterr()
    assert main(["verify", str(rec.path)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main(["info", str(rec.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps_stored"] == {"count": len(KEYFRAMES), "first": 0, "last": STEPS}, info["steps_stored"]
    between = sorted(rec.changed - KEYFRAMES)
    assert info["params_between_keyframes"] == {"count": len(between), "first": between[0] if between else None,
                                                "last": between[-1] if between else None}, info


# -- a step that truly cannot be rebuilt names its cause ------------------------------------------


def _other_capability() -> str:
    return "AVX2" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "AVX512"


def _tampered_grad(path: Path) -> None:
    """Step 5's grad names step 6's blob and fingerprint: every blob check passes, the update does not."""
    from helpers import set_tensor_row, tensor_row

    set_tensor_row(path, 5, "grads", "0.weight", *tensor_row(path, 6, "grads", "0.weight"))


def _recorded_elsewhere(path: Path) -> None:
    _tampered_grad(path)  # (this host's kernels reproduce the update; a record that does not stands in)
    catalog_sql(path, "UPDATE meta SET value = ? WHERE key = 'cpu_capability'", (json.dumps(_other_capability()),))


def _recorded_before_the_watch(path: Path) -> None:
    """A clamped log as a stepdump that did not watch for edits wrote it: no params between
    keyframes, no ``outside_edits`` meta."""
    catalog_sql(path, "UPDATE tensors SET blob = NULL WHERE step IN (SELECT step FROM steps WHERE level = 1) "
                      "AND series IN (SELECT id FROM series WHERE kind = 'params')")
    catalog_sql(path, "DELETE FROM meta WHERE key = 'outside_edits'")


def _reset_momentum(t: int, m: Model, o: torch.optim.Optimizer) -> None:
    if t == 5:
        for p in m.parameters():
            o.state[p]["momentum_buffer"].zero_()  # the optimizer's state, changed outside its step()


CAUSES = {
    # (what training did, what the store then went through, the cause named, causes that must not be)
    "tampered-grad": (None, _tampered_grad, "the record itself is inconsistent", ["when recorded", "did not look"]),
    "recorded-on-another-cpu": (None, _recorded_elsewhere,
                                "CPU capability {other} when recorded, {here} here; the re-applied update may round "
                                "differently", ["inconsistent", "did not look"]),
    "clamped-log-of-an-older-recorder": ("clamp", _recorded_before_the_watch,
                                         "did not look for params changed outside the optimizer",
                                         ["when recorded", "inconsistent"]),
    "optimizer-state-changed-outside-step": ("momentum", None, "does not follow the optimizer state between updates",
                                             ["when recorded", "did not look"]),
}
FIRST_DIFFERENT = {"clamped-log-of-an-older-recorder": 5}  # the first clamp follows update 4; else update 5's record


@pytest.mark.parametrize("case", list(CAUSES))
def test_a_step_that_cannot_be_rebuilt_names_its_cause_and_nothing_else(tmp_path: Path, case: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    training, damage, cause, not_causes = CAUSES[case]
    model = _model()
    opt = OPTIMIZERS["sgd-momentum"](model)
    after = {"clamp": lambda t, m, o: _clamp(t, m), "momentum": _reset_momentum}.get(training or "")
    path = record_run(tmp_path / "run", steps=STEPS, model=model, opt=opt, after_step=after, gradient_log=K)
    if damage is not None:
        damage(path)
    want = cause.format(other=_other_capability(), here=torch.backends.cpu.get_cpu_capability())
    with stepdump.open(path) as run:
        with pytest.raises(stepdump.RebuildError) as e:
            run.state_dict(7) if training != "momentum" else run.optimizer_state_dict(7)
    text = str(e.value)
    assert want in text and e.value.step == FIRST_DIFFERENT.get(case, 6), text
    assert not [c for c in not_causes if c in text], text
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1  # verify agrees: the segment does not reproduce
    assert want in capsys.readouterr().out
