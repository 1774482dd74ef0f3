"""Retroactive capture and write-back of re-executions (issue 24 items 3 and 7, docs/reexecute.md).

A lean run of a tiny model (stats + batch fingerprints only) is re-executed with module globs for
activations and activation grads and ``write_back=True``; opened fresh, the run gives those tensors
(``run.activations``, marked as re-executed) bitwise equal to what a forward/backward hook on an
identical model saw; ``check`` reports the verdict at a step whose recorded grad had one bit flipped
and nowhere else, and the NaN origin ``find_nan`` found; the report shows the verdicts on their step.
A bundle, a run being recorded, a remote or multi-rank run refuse write-back with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import reexec_loops as L
import stepdump
from helpers import assert_same, open_page
from stepdump.core import stats_file
from stepdump.errors import ConfigError, RunLockedError, StepdumpError

STEPS, FLIP_AT = 4, 2
FLIPPED = "fc1.weight"


def _flip_hook(model: nn.Module, at: int) -> Any:
    """One flipped bit in fc1's grad at update ``at``, after backward, before the update (an
    optimizer pre-hook registered before the Recorder's: the record and the update both hold it)."""
    count = [0]

    def flip(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if count[0] == at:
            L.flip_low_bit(model.get_parameter(FLIPPED).grad)
        count[0] += 1
    return flip


def record_lean(path: Path, *, flip_at: int | None = None, bad_step: int = 99) -> Path:
    model, opt, train_step = L.nan_factory()
    if flip_at is not None:
        opt.register_step_pre_hook(_flip_hook(model, flip_at))
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1) as rec:
        for t in range(STEPS):
            b = L.nan_batch(t, bad_step)
            rec.log_batch(b)
            rec.log(loss=train_step(model, opt, b))
    return path


def at_step(step: int, bad_step: int = 99) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Fresh objects trained to the state of ``step`` (a lean run stores no state: the objects
    given must already hold it, checked by the recorded fingerprints). Steps <= FLIP_AT only."""
    model, opt, train_step = L.nan_factory()
    for t in range(step):
        train_step(model, opt, L.nan_batch(t, bad_step))
    return model, opt, train_step


def live_capture(step: int, globs: list[str], bad_step: int = 99) -> tuple[dict[str, torch.Tensor],
                                                                          dict[str, torch.Tensor]]:
    """What forward hooks on an identical model see at ``step``: each matching module's output and
    the grad that flows into it, named as the Recorder names them."""
    import fnmatch

    model, opt, train_step = at_step(step, bad_step)
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if name and any(fnmatch.fnmatchcase(name, g) for g in globs):
            def hook(m: nn.Module, a: Any, out: torch.Tensor, name: str = name) -> None:
                acts[name] = out.detach().clone()
                out.register_hook(lambda g, name=name: grads.__setitem__(name, g.detach().clone()))
            mod.register_forward_hook(hook)
    train_step(model, opt, L.nan_batch(step, bad_step))
    return acts, grads


@pytest.fixture(scope="module")
def flipped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lean run with one flipped grad bit at FLIP_AT, re-executed at steps 0..FLIP_AT with
    write_back (activations of fc*, activation grads of act)."""
    run = record_lean(tmp_path_factory.mktemp("wb") / "lean", flip_at=FLIP_AT)
    for t in range(FLIP_AT + 1):
        model, opt, train_step = at_step(t)
        r = stepdump.reexecute(run, t, model, opt, train_step, batch=L.nan_batch(t, 99),
                               activations=["fc*"], activation_grads="act", write_back=True)
        assert r.verdict == ("reproduces" if t != FLIP_AT else "differs from the record"), r.summary()
        assert r.written_back
    return run


@pytest.mark.parametrize("step", range(FLIP_AT + 1))
def test_written_back_activations_equal_live_module_outputs_bitwise(flipped: Path, step: int) -> None:
    acts, grads = live_capture(step, ["fc*", "act"])
    with stepdump.open(flipped) as run:
        got = run.activations(step)
        assert got.reexecuted and sorted(got) == ["fc1", "fc2"]
        for name in ("fc1", "fc2"):
            assert_same(got[name], acts[name])
        got_grads = run.activations(step, grads=True)
        assert got_grads.reexecuted and sorted(got_grads) == ["act"]
        assert_same(got_grads["act"], grads["act"])
        assert got.verdict is not None and got.verdict["verdict"] == \
            ("reproduces" if step != FLIP_AT else "differs from the record")
        # Not mistaken for recorded activations: a kind of their own, not "activations".
        assert "activations" not in run.kinds() and "reexec_activations" in run.kinds()
        assert run.activations(step, reexecuted=False) == {}


def test_check_reports_the_verdict_on_the_flipped_step_only(flipped: Path) -> None:
    found = [f for f in stepdump.check(flipped) if f.rule == "reexecution"]
    assert [(f.step, f.kind, f.tensor) for f in found] == [(FLIP_AT, "grads", FLIPPED)], found
    assert "differs from the record" in found[0].message and "suspected" in found[0].message


def test_check_cli_shows_the_verdict(flipped: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stepdump.cli.main import main

    main(["check", str(flipped), "--rules", "reexecution"])
    out = capsys.readouterr().out
    assert "reexecution" in out and "differs from the record" in out


def test_find_nan_origin_written_back_and_shown_by_check(tmp_path: Path) -> None:
    bad = 2
    run = record_lean(tmp_path / "nan", bad_step=bad)
    model, opt, train_step = at_step(bad, bad)
    r = stepdump.reexecute(run, bad, model, opt, train_step, batch=L.nan_batch(bad, bad), find_nan=True,
                           write_back=True)
    assert r.nan_op is not None and r.verdict == "reproduces"
    with stepdump.open(run) as fresh:
        mark = fresh.meta["reexecutions"][str(bad)]
        assert mark["nan_op"]["op"] == "aten.sqrt.default" and mark["nan_op"]["module"] == "prep"
        assert mark["nan_op"]["input_stats"][0]["min"] == -0.5
    found = [f for f in stepdump.check(run) if f.rule == "reexecution"]
    assert [f.step for f in found] == [bad]
    assert "aten.sqrt.default" in found[0].message and "'prep'" in found[0].message


@pytest.mark.parametrize("second", ["fewer", "other"])
def test_writing_twice_for_a_step_replaces_the_first(tmp_path: Path, second: str) -> None:
    run = record_lean(tmp_path / "r")
    model, opt, train_step = at_step(1)
    stepdump.reexecute(run, 1, model, opt, train_step, batch=L.nan_batch(1, 99), activations=["fc1", "fc2"],
                       activation_grads=["fc2"], write_back=True)
    globs = ["fc2"] if second == "fewer" else ["act"]
    model, opt, train_step = at_step(1)
    stepdump.reexecute(run, 1, model, opt, train_step, batch=L.nan_batch(1, 99), activations=globs,
                       write_back=True)
    acts, _ = live_capture(1, globs)
    with stepdump.open(run) as fresh:
        got = fresh.activations(1)
        assert sorted(got) == sorted(acts)
        for n in acts:
            assert_same(got[n], acts[n])
        assert fresh.activations(1, grads=True) == {}
        assert list(fresh.meta["reexecutions"]) == ["1"]
        assert stepdump.verify(fresh).ok
        # The run's stats.parquet is written again with the rows written back (core/stats_file.py).
        found = stats_file.check(fresh.path, fresh.catalog)
        assert found.data is not None and found.meta is not None, found.reason
        assert found.meta.rows == len(fresh.stats()) and "reexec_activations" in set(fresh.stats()["kind"])


def test_capture_without_write_back_is_on_the_result(tmp_path: Path) -> None:
    run = record_lean(tmp_path / "r")
    model, opt, train_step = at_step(0)
    r = stepdump.reexecute(run, 0, model, opt, train_step, batch=L.nan_batch(0, 99), activations="fc*",
                           activation_grads="fc*")
    acts, grads = live_capture(0, ["fc*"])
    assert sorted(r.activations) == ["fc1", "fc2"] and sorted(r.activation_grads) == ["fc1", "fc2"]
    for n in acts:
        assert_same(r.activations[n], acts[n])
        assert_same(r.activation_grads[n], grads[n])
    assert not r.written_back
    with stepdump.open(run) as fresh:
        assert "reexecutions" not in fresh.meta and "reexec_activations" not in fresh.kinds()


def test_a_glob_matching_no_module_is_refused(tmp_path: Path) -> None:
    run = record_lean(tmp_path / "r")
    model, opt, train_step = at_step(0)
    with pytest.raises(ConfigError, match="no module"):
        stepdump.reexecute(run, 0, model, opt, train_step, batch=L.nan_batch(0, 99), activations="blocks.*")


def _refused_bundle(tmp_path: Path) -> tuple[Path, type[StepdumpError], str]:
    from stepdump.reexec.bundle import bundle

    src = L.record_nan(tmp_path / "full", "full", bad_step=99, steps=3)
    out = tmp_path / "b.stepdump"
    bundle(stepdump.open(src), 1, out)
    return out, ConfigError, "bundle"


@pytest.mark.parametrize("case", ["bundle", "being recorded", "remote"])
def test_write_back_refused_where_it_cannot_be_safe(tmp_path: Path, case: str) -> None:
    if case == "remote":
        import uuid

        where = f"memory://stepdump-tests/{uuid.uuid4().hex}"
        model, opt, train_step = L.nan_factory()
        with stepdump.Recorder(where, model, opt, every=None, stats_every=1) as rec:
            b = L.nan_batch(0, 99)
            rec.log_batch(b)
            rec.log(loss=train_step(model, opt, b))
        with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
            model, opt, train_step = L.nan_factory()
            with pytest.raises(ConfigError, match=f"back into {where}: write-back needs a local run directory"):
                stepdump.reexecute(run, 0, model, opt, train_step, batch=L.nan_batch(0, 99), activations="fc1",
                                   write_back=True)
        with stepdump.open(where, cache_dir=tmp_path / "cache2") as run:
            assert "reexecutions" not in run.meta
        return
    if case == "bundle":
        path, err, words = _refused_bundle(tmp_path)
        model, opt, train_step = L.nan_factory()
        before = sorted(p.name for p in (path / "segments").iterdir())
        with pytest.raises(err, match=words):
            stepdump.reexecute(path, 1, model, opt, train_step, activations="fc1", write_back=True)
        assert sorted(p.name for p in (path / "segments").iterdir()) == before
        with stepdump.open(path) as b:
            assert "reexecutions" not in b.meta
        return
    path = record_lean(tmp_path / "r")
    model, opt, train_step = at_step(0)
    other, oopt, _ = L.nan_factory()
    with stepdump.Recorder(path, other, oopt, every=None, stats_every=1, resume=True):
        with pytest.raises(RunLockedError, match="being written"):
            stepdump.reexecute(path, 0, model, opt, train_step, batch=L.nan_batch(0, 99), activations="fc1",
                               write_back=True)
    with stepdump.open(path) as fresh:
        assert "reexecutions" not in fresh.meta


def test_cli_activations_and_write_back(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.cli.main import main

    run = L.record_nan(tmp_path / "k", "keyframe", bad_step=99, steps=4)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code = main(["reexecute", str(run), "--step", "2", "--entry", "test_reexecute:nan_entry", "--activations", "fc*",
                 "--activation-grads", "fc2", "--write-back"])
    out = capsys.readouterr().out
    assert code == 0 and "written back" in out, out
    acts, grads = live_capture(2, ["fc*"])
    with stepdump.open(run) as fresh:
        got = fresh.activations(2)
        assert got.reexecuted and sorted(got) == ["fc1", "fc2"]
        for n in ("fc1", "fc2"):
            assert_same(got[n], acts[n])
        assert_same(fresh.activations(2, grads=True)["fc2"], grads["fc2"])


def test_report_shows_verdicts_on_their_step(flipped: Path, tmp_path: Path, browser: Any) -> None:
    from stepdump.render.html import write_report

    with stepdump.open(flipped) as run:
        out = write_report(run, tmp_path / "r.html")
        domain = len(run.all_steps)  # the steps and the final record
    page, problems = open_page(browser, out.resolve().as_uri())
    try:
        rows = page.eval_on_selector_all(
            "#reexec-body tbody tr", "rs => rs.map(r => [r.dataset.step, r.dataset.verdict])")
        assert rows == [["0", "reproduces"], ["1", "reproduces"], [str(FLIP_AT), "differs from the record"]]
        finding = page.locator(f"#findings-body tr[data-step='{FLIP_AT}']", has_text="reexecution")
        assert finding.count() == 1 and FLIPPED in finding.inner_text()
        # The finding marks its step on the charts: hovering the loss chart there names it.
        cv = page.locator("canvas[data-plot='scalar:loss']")
        box = cv.bounding_box()
        cv.hover(position={"x": 58 + (box["width"] - 70) * (FLIP_AT + 0.5) / domain, "y": 60})
        assert "reexecution" in page.inner_text("#tip")
    finally:
        page.close()
    assert problems == []


@pytest.mark.parametrize(("start", "kept"), [(1, [0]), (3, [0, 1, 2])])
def test_a_resume_that_drops_a_step_drops_its_written_back_reexecution(tmp_path: Path, start: int,
                                                                       kept: list[int]) -> None:
    """A step recorded again is another record: the verdict on the old one must not stay on it."""
    run = record_lean(tmp_path / "r")
    for t in range(3):
        model, opt, train_step = at_step(t)
        stepdump.reexecute(run, t, model, opt, train_step, batch=L.nan_batch(t, 99), activations="fc1",
                           write_back=True)
    model, opt, train_step = at_step(start)
    with stepdump.Recorder(run, model, opt, every=None, stats_every=1, resume=True, start_step=start) as rec:
        b = L.nan_batch(start, 99)
        rec.log_batch(b)
        rec.log(loss=train_step(model, opt, b))
    with stepdump.open(run) as fresh:
        assert sorted(int(k) for k in fresh.meta.get("reexecutions", {})) == kept
        assert [t for t in range(3) if fresh.activations(t)] == kept
        assert [f.step for f in stepdump.check(fresh) if f.rule == "reexecution"] == []


def _live_gpt(step: int, acts_glob: str, grads_glob: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Hooks on an identical nanoGPT-style model at ``step`` (same seed, batches and RNG draws as the
    recording): every call of a matching module, named as the Recorder names them (``#1`` for a
    module's second call: the second micro-batch)."""
    import fnmatch

    model, opt, train_step = L.gpt_factory()
    batches = L.token_batches(step + 1)
    for t in range(step):
        train_step(model, opt, batches[t])
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    for name, mod in model.named_modules():
        for glob, into in ((acts_glob, acts), (grads_glob, grads)):
            if name and fnmatch.fnmatchcase(name, glob):
                def hook(m: nn.Module, a: Any, out: torch.Tensor, name: str = name, into: dict = into) -> None:
                    key = (name, id(into))
                    n = calls.get(str(key), 0)
                    calls[str(key)] = n + 1
                    label = name if n == 0 else f"{name}#{n}"
                    if into is acts:
                        acts[label] = out.detach().clone()
                    else:
                        out.register_hook(lambda g, label=label: grads.__setitem__(label, g.detach().clone()))
                mod.register_forward_hook(hook)
    train_step(model, opt, batches[step])
    return acts, grads


@pytest.mark.parametrize("mode", ["full", "keyframe", "gradlog", "lean"])
def test_micro_batches_and_every_mode_write_back_what_live_hooks_see(tmp_path: Path, mode: str) -> None:
    """nanoGPT-style loop (dropout, accumulation 2): each module runs twice per step; step 2's state
    comes from a restore, a replay from a keyframe, a gradient-log rebuild, or (lean) the objects."""
    step = 2
    run = L.record_gpt(tmp_path / mode, mode, steps=4)
    model, opt, train_step = L.gpt_factory()
    kw: dict[str, Any] = {}
    if mode == "lean":
        batches = L.token_batches(step + 1)
        for t in range(step):
            train_step(model, opt, batches[t])
        kw["batch"] = batches[step]
    r = stepdump.reexecute(run, step, model, opt, train_step, activations="transformer.h.*.mlp",
                           activation_grads="transformer.h.1.attn", write_back=True, **kw)
    assert r.verdict == "reproduces", r.summary()
    acts, grads = _live_gpt(step, "transformer.h.*.mlp", "transformer.h.1.attn")
    assert sorted(acts) == ["transformer.h.0.mlp", "transformer.h.0.mlp#1", "transformer.h.1.mlp",
                            "transformer.h.1.mlp#1"]
    with stepdump.open(run) as fresh:
        got, got_grads = fresh.activations(step), fresh.activations(step, grads=True)
        assert got.reexecuted and sorted(got) == sorted(acts) and sorted(got_grads) == sorted(grads)
        for n in acts:
            assert_same(got[n], acts[n])
        for n in grads:
            assert_same(got_grads[n], grads[n])
        assert fresh.activations(step + 1) == {}
        assert stepdump.verify(fresh).ok
        # Re-execution still reads the run: the written-back kinds are not mistaken for the record.
        model, opt, train_step = L.gpt_factory()
        if mode == "lean":
            for t in range(step):
                train_step(model, opt, batches[t])
        assert stepdump.reexecute(fresh, step, model, opt, train_step, **kw).verdict == "reproduces"


def test_write_back_leaves_the_record_as_it_was(tmp_path: Path) -> None:
    """What the recording wrote is untouched: diff against a twin recording is identical, and every
    step's level, state, stats rows and scalars are the twin's."""
    a, b = record_lean(tmp_path / "a", flip_at=FLIP_AT), record_lean(tmp_path / "b", flip_at=FLIP_AT)
    for t in (1, FLIP_AT):
        model, opt, train_step = at_step(t)
        stepdump.reexecute(a, t, model, opt, train_step, batch=L.nan_batch(t, 99), activations="fc*",
                           activation_grads="*", find_nan=True, write_back=True)
    with stepdump.open(a) as ra, stepdump.open(b) as rb:
        assert stepdump.diff(ra, rb).identical
        timed = [[r for r in run.scalar_rows() if not r[1].startswith("sys/")] for run in (ra, rb)]  # not timings
        assert ra.all_steps == rb.all_steps and timed[0] == timed[1] and len(timed[0]) >= len(ra.all_steps)
        for t in ra.all_steps:
            assert ra.catalog.level(t) == rb.catalog.level(t) and ra.catalog.step_state(t) == rb.catalog.step_state(t)
            recorded = {k: fp for k, fp in ra.fingerprints(t).items() if not k[0].startswith("reexec_")}
            assert recorded == rb.fingerprints(t)
        assert sorted(ra.kinds()) == sorted([*rb.kinds(), "reexec_activations", "reexec_activation_grads"])


@pytest.mark.parametrize("fail_in", ["add_tensors", "set_meta"])
def test_a_write_back_that_fails_half_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fail_in: str) -> None:
    from stepdump.store.catalog import CatalogWriter

    run = record_lean(tmp_path / "r")
    model, opt, train_step = at_step(1)
    stepdump.reexecute(run, 1, model, opt, train_step, batch=L.nan_batch(1, 99), activations="fc1", write_back=True)

    def boom(*a: Any, **k: Any) -> None:
        raise OSError("disk gone")
    monkeypatch.setattr(CatalogWriter, fail_in, boom)
    model, opt, train_step = at_step(1)
    with pytest.raises(OSError, match="disk gone"):
        stepdump.reexecute(run, 1, model, opt, train_step, batch=L.nan_batch(1, 99), activations="fc2",
                           write_back=True)
    monkeypatch.undo()
    with stepdump.open(run) as fresh:  # the first write-back, whole; the second, not at all
        assert sorted(fresh.activations(1)) == ["fc1"]
        assert fresh.meta["reexecutions"]["1"]["captured"]["activations"] == ["fc1"]
        assert stepdump.verify(fresh).ok
    model, opt, train_step = at_step(1)  # and the lock was released: a write-back works again
    stepdump.reexecute(run, 1, model, opt, train_step, batch=L.nan_batch(1, 99), activations="fc2", write_back=True)
    with stepdump.open(run) as fresh:
        assert sorted(fresh.activations(1)) == ["fc2"]
