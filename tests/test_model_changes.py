"""The model's structure changes mid-run (pruning, ``prune.remove``, a parametrization added):
the record follows the model's own names and buffers at every step.

Each loop is a Linear-ReLU-Linear trained with SGD (momentum), changed at the start of an
iteration. For every recording mode the test checks: training bitwise equal to the same loop
unrecorded; each step's record equal to the live ``state_dict()`` of that step (names and values:
params before the update, buffers at the iteration's start); restore of a step into the model as it
was then, and training on from it, bitwise; restore into the other structure refused naming the
difference; ``check`` naming the change at its step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

import stepdump
from stepdump.errors import RestoreMismatchError

STEPS = 7


def _prune(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    prune.l1_unstructured(m[2], "weight", 0.5)


def _unprune(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    prune.remove(m[2], "weight")


def _spectral(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    parametrizations.spectral_norm(m[0])


def _unparametrize(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    parametrize.remove_parametrizations(m[0], "weight")


def _replace(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A new head, trained from here in a param group of its own (the old one's params stay in
    the optimizer, out of the model: ``group0.param2`` / ``param3``)."""
    m[2] = nn.Linear(8, 4)
    opt.add_param_group({"params": list(m[2].parameters()), "lr": 0.02})


Change = Callable[[nn.Module, torch.optim.Optimizer], None]
# change name -> {iteration: what happens at its start}
CHANGES: dict[str, dict[int, Change]] = {
    "prune": {3: _prune},
    "prune_remove": {2: _prune, 4: _unprune},
    "parametrize": {3: _spectral},
    "parametrize_remove": {2: _spectral, 4: _unparametrize},
    "replace_module": {3: _replace},
}
MODES = {
    "full": {},
    "lean": {"every": None, "stats_every": 1},
    "gradient_log": {"gradient_log": 4},
}


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, changes: dict[int, Change],
           start: int = 0, seen: list[OrderedDict[str, torch.Tensor]] | None = None,
           stepped: list[set[str]] | None = None) -> None:
    """Iterations ``start``..STEPS-1; ``seen``: each step's live state_dict as a record holds it;
    ``stepped``: the names of its params (the model's and the optimizer's)."""
    for step in range(start, STEPS):
        if step in changes:
            changes[step](model, opt)
        begin = {k: v.detach().clone() for k, v in model.state_dict().items()}
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if seen is not None:
            params = {n for n, _ in model.named_parameters()}
            seen.append(OrderedDict((k, v.detach().clone() if k in params else begin[k])
                                    for k, v in model.state_dict().items()))
            if stepped is not None:  # the names of the params each step records: the optimizer's too
                ids = {id(p) for p in model.parameters()}
                stepped.append(params | {f"group{i}.param{j}" for i, g in enumerate(opt.param_groups)
                                         for j, p in enumerate(g["params"]) if id(p) not in ids})
        opt.step()


def _structure_at(step: int, changes: dict[int, Change]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _build()
    for s in sorted(changes):
        if s <= step:
            changes[s](model, opt)
    return model, opt


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("change", list(CHANGES))
def test_record_follows_the_model_structure(tmp_path, change, mode):
    changes = CHANGES[change]
    ref, ref_opt = _build()
    _train(ref, ref_opt, changes)
    model, opt = _build()
    seen: list[OrderedDict[str, torch.Tensor]] = []
    stepped: list[set[str]] = []
    with stepdump.Recorder(tmp_path / "r", model, opt, **MODES[mode]):
        _train(model, opt, changes, seen=seen, stepped=stepped)
    live = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, live[k]), k  # recording changed nothing
    run = stepdump.open(tmp_path / "r")
    final = run.state_dict(STEPS)
    assert list(final) == list(live)
    for k, v in live.items():
        assert torch.equal(final[k], v), k
    if mode == "lean":  # stats only: the names of each step are the model's then
        stats = run.stats(kind="params")
        for step, names in enumerate(stepped):
            assert set(stats[stats.step == step]["name"]) == names, step
        return
    for step, sd in enumerate(seen):
        rec = run.state_dict(step)
        assert list(rec) == list(sd), step
        for k, v in sd.items():
            assert torch.equal(rec[k], v), (step, k)
    first = min(changes)
    # Restore a step after the (first) change into the model as it was then, and train on: bitwise.
    for step in (first - 1, first, STEPS - 2):
        m2, o2 = _structure_at(step, changes)
        run.restore(step, m2, o2)
        _train(m2, o2, {s: f for s, f in changes.items() if s > step}, start=step)
        for k, v in live.items():
            assert torch.equal(m2.state_dict()[k], v), (step, k)
    # Into the other structure: refused, naming what differs.
    before, o_before = _structure_at(first - 1, changes)
    with pytest.raises(RestoreMismatchError, match=r"at step %d" % first):
        run.restore(first, before, o_before)
    after, o_after = _structure_at(first, changes)
    with pytest.raises(RestoreMismatchError):
        run.restore(first - 1, after, o_after)


def test_pruned_step_exports_the_pruned_model(tmp_path):
    model, opt = _build()
    with stepdump.Recorder(tmp_path / "r", model, opt):
        _train(model, opt, CHANGES["prune"])
    run = stepdump.open(tmp_path / "r")
    path = run.export(5, tmp_path / "ck.pt")
    ck = torch.load(path, weights_only=True)
    m2, _ = _structure_at(5, CHANGES["prune"])
    m2.load_state_dict(ck["model"])
    assert int((m2[2].weight == 0).sum()) == 16  # the effective weight of the pruned model
    assert torch.equal(ck["model"]["2.weight_mask"], run.state_dict(5)["2.weight_mask"])


def test_check_names_the_change_at_its_step(tmp_path):
    model, opt = _build()
    with stepdump.Recorder(tmp_path / "r", model, opt):
        _train(model, opt, CHANGES["prune"])
    findings = stepdump.check(stepdump.open(tmp_path / "r"))
    changed = [f for f in findings if f.rule == "model_changed"]
    assert len(changed) == 1 and changed[0].step == 3
    assert "2.weight_orig" in changed[0].message and "2.weight_mask" in changed[0].message


def test_diff_and_report_name_the_change_at_its_step(tmp_path):
    for name, changes in (("a", CHANGES["prune"]), ("b", {})):
        model, opt = _build()
        with stepdump.Recorder(tmp_path / name, model, opt):
            _train(model, opt, changes)
    a, b = stepdump.open(tmp_path / "a"), stepdump.open(tmp_path / "b")
    result = stepdump.diff(a, b)
    assert result.first_step == 3
    assert "structure changed at step 3" in result.reading and "'2.weight_mask'" in result.reading
    from stepdump.analysis.report import build_report_data

    found = build_report_data(a)["findings"]
    assert [f["step"] for f in found if f["rule"] == "model_changed"] == [3]


def test_resume_before_the_change_into_the_unchanged_model(tmp_path):
    """Resumed at a step before the prune, into the model as it was then, and never pruned again: the
    steps recorded again are the unpruned model's (the run's layout history is cut at the resume)."""
    model, opt = _build()
    with stepdump.Recorder(tmp_path / "r", model, opt):
        _train(model, opt, CHANGES["prune"])
    run = stepdump.open(tmp_path / "r")
    m2, o2 = _structure_at(2, CHANGES["prune"])
    run.restore(2, m2, o2)
    run.close()
    seen: list[OrderedDict[str, torch.Tensor]] = []
    with stepdump.Recorder(tmp_path / "r", m2, o2, resume=True, start_step=2):
        _train(m2, o2, {}, start=2, seen=seen)
    run = stepdump.open(tmp_path / "r")
    for step, sd in enumerate(seen, start=2):
        rec = run.state_dict(step)
        assert list(rec) == list(sd) and all(torch.equal(rec[k], v) for k, v in sd.items()), step
    assert [f for f in stepdump.check(run) if f.rule == "model_changed"] == []
    # Another run, resumed after the change into the pruned model, and changed again from there: every
    # step keeps its own layout.
    model, opt = _build()
    with stepdump.Recorder(tmp_path / "s", model, opt):
        _train(model, opt, CHANGES["prune"])
    run = stepdump.open(tmp_path / "s")
    m3, o3 = _structure_at(5, CHANGES["prune"])
    run.restore(5, m3, o3)
    run.close()
    with stepdump.Recorder(tmp_path / "s", m3, o3, resume=True, start_step=5):
        _train(m3, o3, {6: _unprune}, start=5)
    run = stepdump.open(tmp_path / "s")
    assert "2.weight" in run.state_dict(2) and "2.weight_mask" in run.state_dict(5) and "2.weight" in run.state_dict(7)
    assert [f.step for f in stepdump.check(run) if f.rule == "model_changed"] == [3, 6]
    # Resumed before the change with the model after it (or any other optimizer): refused, at once.
    m4, o4 = _structure_at(5, CHANGES["prune"])
    with pytest.raises(stepdump.StepdumpError, match="at step 1"):
        stepdump.Recorder(tmp_path / "s", m4, o4, resume=True, start_step=1)
