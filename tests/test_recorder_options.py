"""The Recorder's grouped options (stepdump.capture.options) and its public capture hooks.

* every invalid combination is a ConfigError that says what to do, before anything is created;
* the flat keywords and the option groups are two spellings of the same Recorder: same options,
  bit-identical records;
* the option objects are frozen;
* the optimizer hooks, the ring and the framework integrations use only the public hooks
  (``capture``, ``end_step``, ``begin_iteration``), so a framework callback written against
  them records exactly what the built-in optimizer hooks record.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pydoc
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from torch import nn

import stepdump
from stepdump import ConfigError, StepdumpError
from stepdump.options import (
    KeyframeSchedule,
    RecordOptions,
    Remote,
    ResolvedOptions,
    RingSchedule,
    StepSchedule,
    StoreOptions,
)
from stepdump.capture import recorder as recorder_module

SRC = Path(stepdump.__file__).parent
KINDS = ("params", "grads", "optimizer")


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def _train(path: Path, steps: int = 8, nan_at: int | None = None, **rec_kwargs) -> ResolvedOptions:
    """Train a small model under a Recorder built with ``rec_kwargs``; return its options."""
    model, opt = _setup()
    with stepdump.Recorder(path, model, opt, **rec_kwargs) as rec:
        for t in range(steps):
            x, y = _batch(t)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if t == nan_at:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
            if t == nan_at:
                with torch.no_grad():
                    model[0].weight.nan_to_num_(0.0)
            rec.log(loss=loss)
        return rec.options


def _contents(path: Path) -> dict:
    """Everything a run holds that a spelling could change: steps, meta, scalars, every tensor."""
    with stepdump.open(path) as run:
        out: dict = {"steps": run.steps, "stats_steps": run.stats_steps, "all_steps": run.all_steps,
                     "meta": {k: run.meta.get(k) for k in ("capture", "every", "stats_every", "keyframe_every",
                                                           "codec")},
                     "scalars": run.scalars()}
        out["tensors"] = {(t, k): run.tensors(t, kind=k) for t in run.steps for k in KINDS}
    return out


def _assert_same_run(a: Path, b: Path) -> None:
    ca, cb = _contents(a), _contents(b)
    assert ca["tensors"] and ca["steps"], "the runs must hold tensors to compare"
    for key in ("steps", "stats_steps", "all_steps", "meta"):
        assert ca[key] == cb[key], key
    assert ca["scalars"].equals(cb["scalars"])  # NaN losses after a NaN update compare equal here
    assert ca["tensors"].keys() == cb["tensors"].keys()
    for where, tensors in ca["tensors"].items():
        assert tensors.keys() == cb["tensors"][where].keys(), where
        for name, tensor in tensors.items():
            assert_same(tensor, cb["tensors"][where][name], f"{where} {name}")  # torch.equal on the bits


# -- invalid combinations ------------------------------------------------------------------------

INVALID = {
    # a flight-recorder option without the ring: did nothing, silently, before the groups
    "trigger without ring": ({"trigger": "nan_inf"}, "pass ring=N"),
    "misspelt trigger without ring": ({"trigger": "nan_in"}, "pass ring=N"),
    "after without ring": ({"after": 3}, "pass ring=N"),
    "misspelt keyword": ({"ring": 2, "triger": "nan_inf"}, r"unknown option triger=; did you mean trigger=\?"),
    "misspelt every": ({"evry": 10}, "did you mean every="),
    "ring and every": ({"ring": 2, "every": 5}, "ring= decides which steps are stored in full.*every="),
    "ring and stats_every": ({"ring": 2, "stats_every": 2}, "do not combine it with stats_every="),
    "ring and keyframes": ({"ring": 2, "keyframe_every": 4}, "do not combine it with keyframe_every="),
    "ring of 0": ({"ring": 0}, "ring=0: give the number of steps to keep in memory"),
    "negative after": ({"ring": 2, "after": -1}, r"after=-1: give the number of steps \(0 or more\)"),
    "misspelt trigger": ({"ring": 2, "trigger": "nan_in"}, "trigger='nan_in': give 'nan_inf', 'loss_spike'"),
    "keyframes and every": ({"keyframe_every": 4, "every": 2}, "pass only keyframe_every, not every="),
    "keyframes and stats_every": ({"keyframe_every": 4, "stats_every": 1}, "pass only keyframe_every"),
    "keyframe_every 0": ({"keyframe_every": 0}, "keyframe_every=0: give a positive number"),
    "every 0": ({"every": 0}, "every=0: give a positive step interval"),
    "stats_every string": ({"stats_every": "12"}, "stats_every must be an int, range"),
    "unknown kind": ({"capture": ("params", "weights")}, "unknown capture kind 'weights'; choose from"),
    "modules without activations": ({"modules": "fc*"}, "add one of them to capture=, or leave modules= out"),
    "include not globs": ({"include": 3}, "include= takes a glob string"),
    "profile not bool": ({"profile": "yes"}, "profile='yes': give True or False"),
    "unknown codec": ({"codec": "zip"}, "unknown codec 'zip'; choose one of"),
    "delta chain 0": ({"codec": "delta-lz4", "delta_chain": 0}, "delta_chain=0: give a number of blobs from 1"),
    "queue depth 0": ({"queue_depth": 0}, "queue_depth must be at least 1"),
    "queue depth float": ({"queue_depth": 2.5}, "queue_depth=2.5"),
    "durability": ({"durability": "sync"}, "durability='sync': choose 'flush' or 'fsync'"),
    "segment bytes 0": ({"segment_bytes": 0}, "segment_bytes=0: give the size of a segment file"),
    "remote not a Remote": ({"remote": 5}, "remote= must be a stepdump.options.Remote or a dict"),
    "remote for a local path": ({"remote": Remote()}, "remote= applies to URLs"),
    "on_error": ({"on_error": "ignore"}, "on_error='ignore': choose 'raise' or 'warn'"),
    "resume not bool": ({"resume": "yes"}, "resume='yes': give True or False"),
    "negative start_step": ({"start_step": -1}, "start_step=-1: give a step number"),
    "metadata not JSON": ({"metadata": {"x": object()}}, "metadata= must be a dict that JSON can hold"),
    "metadata not a dict": ({"metadata": [1, 2]}, "metadata= must be a dict"),
    "no ranks": ({"ranks": []}, "ranks= is empty"),
    "auto_capture not bool": ({"auto_capture": 1}, "auto_capture=1: give True or False"),
    # the same option both ways
    "record both ways": ({"record": RecordOptions(), "include": "0.*"},
                         "include= is also set by record=; give it one way"),
    "store both ways": ({"store": StoreOptions(codec="zstd"), "codec": "zstd"},
                        "codec= is also set by store=; give it one way"),
    "schedule both ways": ({"schedule": StepSchedule(every=2), "every": 2},
                           "every= is also set by schedule=; give it one way"),
    "ring beside a schedule": ({"schedule": StepSchedule(), "ring": 2}, "ring= is also set by schedule="),
    # a keyword given with its default value is given all the same
    "default value beside its group": ({"schedule": StepSchedule(every=2), "every": 1},
                                       "every= is also set by schedule="),
    "trigger beside a ring schedule": ({"schedule": RingSchedule(size=2), "trigger": "loss_spike"},
                                       "trigger= is also set by schedule="),
    # a group of the wrong type
    "schedule of the wrong type": ({"schedule": RecordOptions()}, "schedule= takes a StepSchedule, KeyframeSchedule"),
    "store as a dict": ({"store": {"codec": "raw"}}, r"store= takes StoreOptions \(from stepdump.options\)"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_every_invalid_combination_is_a_config_error_that_says_what_to_do(tmp_path, case):
    kwargs, message = INVALID[case]
    model, opt = _setup()
    with pytest.raises(ConfigError, match=message):
        stepdump.Recorder(tmp_path / "run", model, opt, **kwargs)
    assert not (tmp_path / "run").exists()  # refused before anything was created


@pytest.mark.parametrize("build, message", [
    (lambda: RingSchedule(size=2, trigger="nan_in"), "trigger='nan_in'"),
    (lambda: RingSchedule(size=True), "ring=True"),
    (lambda: KeyframeSchedule(every=-3), "keyframe_every=-3"),
    (lambda: StepSchedule(every=0), "every=0"),
    (lambda: StoreOptions(codec="nope"), "unknown codec 'nope'"),
    (lambda: StoreOptions(delta_chain=10**6), "readers follow no longer chains"),
    (lambda: RecordOptions(capture=("grads",), modules="fc*"), "add one of them to capture="),
    (lambda: ResolvedOptions(on_error="loud"), "on_error='loud'"),
])
def test_option_objects_check_themselves_when_built(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        StoreOptions("zstd")  # type: ignore[misc]
    with pytest.raises(TypeError):
        RingSchedule(4)  # type: ignore[misc]


# -- frozen --------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj, field, value", [
    (RecordOptions(), "capture", ("grads",)),
    (StepSchedule(), "every", 5),
    (KeyframeSchedule(every=4), "every", 8),
    (RingSchedule(size=3), "trigger", "loss_spike"),
    (StoreOptions(), "codec", "zstd"),
    (ResolvedOptions(), "on_error", "raise"),
])
def test_options_cannot_be_mutated(obj, field, value):
    before = getattr(obj, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, value)
    assert getattr(obj, field) == before


def test_options_are_normalised_and_do_not_follow_the_callers_lists(tmp_path):
    include = ["0.*", "2.weight"]
    steps = [0, 3, 6]
    opts = RecordOptions(capture=["params", "grads"], include=include, exclude="0.bias")
    sched = StepSchedule(every=(s for s in steps), stats_every=steps)
    include.append("*")
    steps.append(7)
    assert opts.capture == ("params", "grads")
    assert opts.include == ("0.*", "2.weight") and opts.exclude == ("0.bias",)
    assert sched.every == frozenset({0, 3, 6}) and sched.stats_every == frozenset({0, 3, 6})
    got = _train(tmp_path / "run", record=opts, schedule=sched)
    assert got.record is opts and got.schedule is sched
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.store = StoreOptions()  # type: ignore[misc]
    with stepdump.open(tmp_path / "run") as run:
        # the generator was read once, and kept (8: the final record close() always writes)
        assert run.steps == [0, 3, 6, 8] and run.meta["final_step"] == 8
        assert sorted(run.names("grads")) == ["0.weight", "2.weight"]


# -- two spellings, one Recorder -----------------------------------------------------------------


def _fire_at_5(info) -> bool:
    return info.step == 5


SPELLINGS = {
    "tiered": (
        dict(capture=KINDS, include="*", exclude="2.bias", every=3, stats_every=1, codec="zstd", queue_depth=1,
             durability="fsync", segment_bytes=4096, profile=False, metadata={"who": "flat"}),
        dict(record=RecordOptions(capture=KINDS, exclude="2.bias", profile=False),
             schedule=StepSchedule(every=3, stats_every=1),
             store=StoreOptions(codec="zstd", queue_depth=1, durability="fsync", segment_bytes=4096),
             metadata={"who": "flat"}),
    ),
    "delta": (
        dict(codec="delta-lz4", delta_chain=3),
        dict(store=StoreOptions(codec="delta-lz4", delta_chain=3)),
    ),
    "keyframes": (
        dict(keyframe_every=4),
        dict(schedule=KeyframeSchedule(every=4)),
    ),
    "ring": (
        dict(ring=2, trigger=_fire_at_5, after=1),
        dict(schedule=RingSchedule(size=2, trigger=_fire_at_5, after=1)),
    ),
    "ring on NaN": (
        dict(ring=3),
        dict(schedule=RingSchedule(size=3, trigger="nan_inf")),
    ),
}


@pytest.mark.parametrize("case", list(SPELLINGS))
def test_flat_and_grouped_spellings_record_the_same_run(tmp_path, case):
    flat, grouped = SPELLINGS[case]
    nan_at = 4 if case == "ring on NaN" else None
    a = _train(tmp_path / "flat", nan_at=nan_at, **flat)
    b = _train(tmp_path / "grouped", nan_at=nan_at, **grouped)
    assert a == b  # one set of options, however spelt
    _assert_same_run(tmp_path / "flat", tmp_path / "grouped")
    if case.startswith("ring"):
        with stepdump.open(tmp_path / "flat") as run:
            # the ring's flushed steps, and the final record 8
            assert run.steps == ([3, 4, 5, 6, 8] if case == "ring" else [1, 2, 3, 4, 5, 6, 7, 8])
            assert run.meta["final_step"] == 8
            assert run.stats_steps == list(range(9))


def test_the_common_case_is_unchanged(tmp_path):
    opts = _train(tmp_path / "run", every=4)
    assert opts == ResolvedOptions(schedule=StepSchedule(every=4))
    assert opts.record.capture == KINDS and opts.store.codec == "raw" and opts.on_error == "warn"
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 4, 8] and run.stats_steps == list(range(9)) and run.meta["final_step"] == 8
        assert run.meta["every"] == "every 4" and run.meta["stats_every"] == "every 1"


def test_help_shows_the_real_parameters_grouped_as_the_option_objects():
    """help(stepdump.Recorder) lists every parameter with its default (not ``*args, **kwargs``):
    the objects, the joint spelling's dicts, the option groups, and each group's fields as
    keyword-only options in the group's order, each documented in the docstring."""
    params = inspect.signature(stepdump.Recorder).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.VAR_KEYWORD not in kinds
    assert list(params)[:5] == ["path", "model", "optimizer", "scheduler", "scaler"]
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only[:4] == ["models", "optimizers", "schedulers", "scalers"]  # the joint spelling
    resolved = {f.name: f for f in dataclasses.fields(ResolvedOptions)}
    assert set(resolved) <= set(keyword_only)
    for name in ("on_error", "resume", "start_step", "metadata", "ranks", "auto_capture"):
        assert params[name].default == resolved[name].default, name
    # each group's fields, in the group's order, with the group's defaults (shown as values)
    flat = [n for n in keyword_only if n not in resolved and n not in ("models", "optimizers", "schedulers", "scalers")]
    record, store = [f.name for f in dataclasses.fields(RecordOptions)], [f.name for f in dataclasses.fields(StoreOptions)]
    schedule = ["every", "stats_every", "keyframe_every", "gradient_log", "ring", "trigger", "after"]
    assert flat == record + schedule + store
    for group in (RecordOptions, StepSchedule, StoreOptions):
        for f in dataclasses.fields(group):
            assert repr(params[f.name].default) == repr(f.default), f.name
    assert repr(params["trigger"].default) == repr("nan_inf")
    assert len(params) == 42
    text = pydoc.render_doc(stepdump.Recorder, renderer=pydoc.plaintext)
    # the call line and the docstring (pydoc lists the bases' resolution order, if any, then the methods)
    shown = " ".join(text.split("Method resolution order")[0].split("Methods defined here")[0].split())
    assert "Recorder(path: " in shown and "*, models: " in shown and "codec: 'str' = 'raw'" in shown
    assert "*args" not in shown and "**kwargs" not in shown
    doc = " ".join((stepdump.Recorder.__doc__ or "").split())
    undocumented = [n for n in params if not re.search(rf"(^|[ ,(]){n}[,:]", doc)]
    assert undocumented == []
    assert "Recorder(path, models=" in doc  # the joint spelling says itself


def test_concepts_lists_the_recorders_parameters_in_order_with_their_defaults():
    """docs/concepts.md's table of the Recorder's parameters is the signature, in order, with its defaults."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    table = text[text.index("| group | parameters (defaults) |"):]
    table = table[:table.index("\n\n")]
    listed = re.findall(r"`(\w+)(?:=([^`]+))?`", "".join(row.split("|")[2] for row in table.splitlines()[2:]))
    params = inspect.signature(stepdump.Recorder).parameters
    assert [name for name, _ in listed if name in params] == list(params)
    for name, default in listed:
        if name in params and default:
            assert repr(eval(default, {})) == repr(params[name].default), name  # noqa: S307 - our own docs
        elif name in params:
            assert params[name].default is inspect.Parameter.empty, name


# -- the public capture hooks --------------------------------------------------------------------


def _private_reads(path: Path) -> list[str]:
    """``obj._name`` on anything but ``self``/``cls`` (reading or overriding another object's insides)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            assert not any("Recorder" in b for b in bases), f"{path.name}: {node.name} subclasses {bases}"
    return found


def test_integrations_ring_and_optimizer_hooks_use_only_public_recorder_api():
    files = [*sorted((SRC / "integrations").glob("*.py")), SRC / "capture" / "ring.py", SRC / "capture" / "hooks.py"]
    assert len(files) >= 5
    assert [hit for f in files for hit in _private_reads(f)] == []


def test_the_optimizer_hooks_drive_the_public_capture_hooks(tmp_path, monkeypatch):
    calls: list[tuple[str, int, bool]] = []
    capture, end_step = recorder_module.Recorder.capture, recorder_module.Recorder.end_step

    def spy_capture(self, *, skipped=False):
        calls.append(("capture", self.step, skipped))
        return capture(self, skipped=skipped)

    def spy_end_step(self):
        calls.append(("end_step", self.step, False))
        return end_step(self)

    monkeypatch.setattr(recorder_module.Recorder, "capture", spy_capture)
    monkeypatch.setattr(recorder_module.Recorder, "end_step", spy_end_step)
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with stepdump.Recorder(tmp_path / "run", model, opt, scaler=scaler) as rec:
        for t in range(3):
            x, y = _batch(t)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (float("inf") if t == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)  # step 1: inf found, optimizer.step() never runs
            scaler.update()
    assert calls == [("capture", 0, False), ("end_step", 0, False),
                     ("capture", 1, True), ("end_step", 1, False),
                     ("capture", 2, False), ("end_step", 2, False)]
    assert rec.step == 3
    with stepdump.open(tmp_path / "run") as run:
        assert run.skipped_steps == [1]


class PublicHooksCallback:
    """A minimal framework integration, written only against the public capture hooks.

    Like Lightning, the framework runs forward and backward inside ``optimizer.step(closure)``
    and calls ``before_update`` once the grads are final; a step it skips never calls
    ``optimizer.step()``.
    """

    def __init__(self, path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.rec = stepdump.Recorder(path, model, opt, auto_capture=False)

    def before_update(self, skipped: bool = False) -> int:
        return self.rec.capture(skipped=skipped)

    def after_skipped_update(self) -> None:
        self.rec.end_step()


def test_a_callback_on_the_public_hooks_records_what_the_optimizer_hooks_record(tmp_path):
    # Reference: the plain Recorder, whose optimizer pre-hook captures.
    _train(tmp_path / "plain", steps=6)
    model, opt = _setup()
    cb = PublicHooksCallback(tmp_path / "manual", model, opt)
    with cb.rec:
        for t in range(6):
            x, y = _batch(t)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                assert cb.before_update() == t
                assert cb.before_update() == t  # a second evaluation (LBFGS) is not recorded again
                closure.loss = loss
                return loss

            opt.step(closure)  # the pre-hook would be too early here: grads come from the closure
            cb.rec.log(loss=closure.loss)
        assert cb.rec.step == 6
    _assert_same_run(tmp_path / "plain", tmp_path / "manual")


def test_a_skipped_step_through_the_public_hooks(tmp_path):
    model, opt = _setup()
    cb = PublicHooksCallback(tmp_path / "run", model, opt)
    with cb.rec:
        for t in range(4):
            x, y = _batch(t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if t == 2:  # the framework skips this update (a GradScaler found inf)
                cb.before_update(skipped=True)
                cb.after_skipped_update()
            else:
                cb.before_update()
                opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.skipped_steps == [2] and run.steps == [0, 1, 2, 3, 4] and run.meta["final_step"] == 4
        # no update at step 2: its params are step 3's
        assert torch.equal(run.tensor("0.weight", 2), run.tensor("0.weight", 3))
        assert torch.equal(run.tensor("0.weight", 4), model[0].weight)  # the final record: the trained model
        assert not torch.equal(run.tensor("0.weight", 1), run.tensor("0.weight", 2))


def test_begin_iteration_takes_the_rng_state_again(tmp_path):
    model, opt = _setup()
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        for t in range(3):
            if t == 2:  # a per-epoch reseed after the update that ended step 1
                torch.manual_seed(1234)
                rec.begin_iteration()
                want = torch.get_rng_state()
            x, y = _batch(t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert torch.equal(run.rng_state(2)["torch"], want)
        assert not torch.equal(run.rng_state(1)["torch"], want)


def test_a_closed_recorder_refuses_more_and_its_hooks_are_gone(tmp_path):
    model, opt = _setup()
    rec = stepdump.Recorder(tmp_path / "run", model, opt)
    rec.close()
    assert rec.capture() == 0  # after close nothing is recorded; the hooks are detached
    opt.zero_grad()
    nn.functional.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    opt.step()
    assert rec.step == 0
    with pytest.raises(ConfigError, match="closed"):
        rec.log(loss=1.0)
    with stepdump.open(tmp_path / "run") as run:
        assert run.all_steps == []
    assert issubclass(ConfigError, StepdumpError)
