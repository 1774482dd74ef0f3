"""Bad input gets the right stepdump error, with a message that helps (issue 2 g)."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from helpers import MLP, assert_same, record_run, regression_batch
from torch import nn

import stepdump


def _record(path, steps=5, every=1, model=None, opt=None):
    """``record_run`` of a 10 -> 5 -> 1 MLP with SGD + momentum on regression_batch(t); returns (model, opt)."""
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 1))
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record_run(path, steps=steps, model=model, opt=opt, batch=regression_batch, every=every)
    return model, opt


def test_every_error_is_a_stepdump_error():
    for cls in (
        stepdump.ConfigError, stepdump.NotARunError, stepdump.FormatVersionError, stepdump.RunExistsError,
        stepdump.RunLockedError, stepdump.StepNotFoundError, stepdump.TensorNotFoundError,
        stepdump.RestoreMismatchError, stepdump.CorruptDataError, stepdump.WriterError, stepdump.ReplayDiverged,
    ):
        assert issubclass(cls, stepdump.StepdumpError)


def test_open_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(stepdump.NotARunError, match="does not exist") as ei:
        stepdump.open(tmp_path / "nope")
    assert "nope" in str(ei.value)


def test_open_a_directory_without_a_catalog(tmp_path):
    (tmp_path / "somedir").mkdir()
    (tmp_path / "somedir" / "notes.txt").write_text("hello")
    with pytest.raises(stepdump.NotARunError, match="not a stepdump run") as ei:
        stepdump.open(tmp_path / "somedir")
    assert "catalog.sqlite" in str(ei.value)


def test_unknown_format_version(tmp_path):
    _record(tmp_path / "run", steps=2)
    con = sqlite3.connect(tmp_path / "run" / "catalog.sqlite")
    with con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (json.dumps(999),))
    con.close()
    with pytest.raises(stepdump.FormatVersionError) as ei:
        stepdump.open(tmp_path / "run")
    msg = str(ei.value)
    assert "999" in msg and str(stepdump.FORMAT_VERSION) in msg
    assert "newer" in msg


def test_step_that_was_not_recorded_names_nearest_steps(tmp_path):
    _record(tmp_path / "run", steps=10, every=3)  # full steps 0, 3, 6, 9 and the final record 10
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 3, 6, 9, 10] and run.meta["final_step"] == 10
        with pytest.raises(stepdump.StepNotFoundError) as ei:
            run.tensor("0.weight", 40)
        msg = str(ei.value)
        assert "step 40" in msg and "nearest recorded steps: 6, 9, 10" in msg
        # a step that exists with stats only says so
        with pytest.raises(stepdump.StepNotFoundError) as ei:
            run.tensor("0.weight", 4)
        assert "only stats" in str(ei.value) and "3, 6" in str(ei.value)
        for call in (lambda: run.state_dict(7), lambda: run.optimizer_state_dict(7),
                     lambda: run.tensors(7), lambda: run.rng_state(-1)):
            with pytest.raises(stepdump.StepNotFoundError, match="nearest recorded steps"):
                call()
        # StepNotFoundError is also a KeyError, but prints without quotes
        assert isinstance(ei.value, KeyError)
        assert not str(ei.value).startswith("'")


def test_unknown_name_suggests_a_close_one(tmp_path):
    model = MLP(8, 16, 4)
    opt = torch.optim.Adam(model.parameters())
    with stepdump.Recorder(tmp_path / "run", model, opt):
        for t in range(2):
            x, y = regression_batch(t, d_in=8, d_out=4)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    with stepdump.open(tmp_path / "run") as run:
        with pytest.raises(stepdump.TensorNotFoundError) as ei:
            run.tensor("fc1.wieght", 1)
        assert "fc1.wieght" in str(ei.value) and "'fc1.weight'" in str(ei.value)
        with pytest.raises(stepdump.TensorNotFoundError, match="fc1.weight.exp_avg"):
            run.tensor("fc1.weight.exp_avgg", 1, kind="optimizer")
        # right name, wrong kind: the message says where it is
        with pytest.raises(stepdump.TensorNotFoundError, match="kind 'optimizer'"):
            run.tensor("fc1.weight.exp_avg", 1, kind="params")
        with pytest.raises(stepdump.TensorNotFoundError, match="unknown kind 'weights'"):
            run.names("weights")


def test_restore_into_a_different_model_changes_nothing(tmp_path):
    _record(tmp_path / "run", steps=3)
    with stepdump.open(tmp_path / "run") as run:
        # shapes differ
        wide = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 1))
        opt = torch.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9)
        before = {k: v.clone() for k, v in wide.state_dict().items()}
        with pytest.raises(stepdump.RestoreMismatchError) as ei:
            run.restore(2, wide, opt)
        msg = str(ei.value)
        assert "'0.weight'" in msg and "(5, 10)" in msg and "(6, 10)" in msg
        for k, v in wide.state_dict().items():
            assert_same(v, before[k], k)
        assert opt.state_dict()["state"] == {}
        assert opt.param_groups[0]["lr"] == 0.1

        # names differ
        class Named(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = nn.Linear(10, 5)
                self.fc2 = nn.Linear(5, 1)

        named = Named()
        before = {k: v.clone() for k, v in named.state_dict().items()}
        with pytest.raises(stepdump.RestoreMismatchError, match="'fc1.weight'"):
            run.restore(2, named, torch.optim.SGD(named.parameters(), lr=0.1, momentum=0.9))
        for k, v in named.state_dict().items():
            assert_same(v, before[k], k)

        # dtype differs
        double = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 1)).double()
        with pytest.raises(stepdump.RestoreMismatchError, match="float64"):
            run.restore(2, double)

        # right model, wrong optimizer groups: the model must not be touched either
        good = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 1))
        before = {k: v.clone() for k, v in good.state_dict().items()}
        two_groups = torch.optim.SGD(
            [{"params": [good[0].weight, good[0].bias]}, {"params": [good[2].weight, good[2].bias]}],
            lr=0.1, momentum=0.9,
        )
        with pytest.raises(stepdump.RestoreMismatchError, match="param groups"):
            run.restore(2, good, two_groups)
        for k, v in good.state_dict().items():
            assert_same(v, before[k], k)
        # wrong optimizer class
        with pytest.raises(stepdump.RestoreMismatchError, match="SGD"):
            run.restore(2, good, torch.optim.Adam(good.parameters()))
        for k, v in good.state_dict().items():
            assert_same(v, before[k], k)
        # and with everything right it works
        run.restore(2, good, torch.optim.SGD(good.parameters(), lr=0.1, momentum=0.9))
        assert_same(good[0].weight.detach(), run.tensor("0.weight", 2))


def test_restore_scheduler_or_scaler_that_was_not_recorded(tmp_path):
    model, opt = _record(tmp_path / "run", steps=2)
    with stepdump.open(tmp_path / "run") as run:
        sched = torch.optim.lr_scheduler.StepLR(opt, 3)
        with pytest.raises(stepdump.RestoreMismatchError, match="no LR scheduler"):
            run.restore(1, model, opt, scheduler=sched)
        with pytest.raises(stepdump.RestoreMismatchError, match="no GradScaler"):
            run.restore(1, model, opt, scaler=torch.amp.GradScaler("cpu"))


def test_second_recorder_on_a_live_run_is_locked(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "run", model, opt) as rec:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        other = nn.Linear(3, 1)
        with pytest.raises(stepdump.RunLockedError) as ei:
            stepdump.Recorder(tmp_path / "run", other, torch.optim.SGD(other.parameters(), lr=0.1), resume=True)
        assert "another Recorder" in str(ei.value) and "pid" in str(ei.value)
        # without resume=True too: "pass resume=True" would not help while the run is live
        with pytest.raises(stepdump.RunLockedError, match="another Recorder"):
            stepdump.Recorder(tmp_path / "run", other, torch.optim.SGD(other.parameters(), lr=0.1))
        # the first Recorder is unaffected
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert rec.step == 2
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2] and run.meta["final_step"] == 2  # 2: the first Recorder's final record


def test_recorder_on_an_existing_run_needs_resume(tmp_path):
    model, opt = _record(tmp_path / "run", steps=2)
    with pytest.raises(stepdump.RunExistsError, match="resume=True"):
        stepdump.Recorder(tmp_path / "run", model, opt)
    # nothing was changed by the refused Recorder: steps 0, 1 and the final record 2
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2] and run.meta["final_step"] == 2 and "history" not in run.meta
    # a non-empty directory that is not a run is refused too
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_bytes(b"x")
    with pytest.raises(stepdump.RunExistsError, match="not empty"):
        stepdump.Recorder(tmp_path / "other", model, opt)
    assert list((tmp_path / "other").iterdir()) == [tmp_path / "other" / "data.bin"]


def test_resume_appends_with_continued_step_numbers(tmp_path):
    model, opt = _record(tmp_path / "run", steps=3)
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2, 3] and run.meta["final_step"] == 3
        assert run.tensors(3, "grads") == {}
    # resuming after a clean close goes on at the final record 3, replacing it
    with stepdump.Recorder(tmp_path / "run", model, opt, resume=True) as rec:
        assert rec.step == 3
        model(torch.randn(2, 10)).sum().backward()
        opt.step()
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 1, 2, 3, 4] and run.meta["final_step"] == 4
        assert sorted(run.tensors(3, "grads")) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert [h["resumed_at"] for h in run.meta["history"]] == [3]
    # resuming with different parameters is refused
    other = nn.Linear(10, 1)
    with pytest.raises(stepdump.ConfigError, match="differ"):
        stepdump.Recorder(tmp_path / "run", other, torch.optim.SGD(other.parameters(), lr=0.1), resume=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "every=0"),
        ({"every": True}, "bool"),
        ({"every": "often"}, "every"),
        ({"every": "12"}, "got str"),
        ({"every": [1, "x"]}, "every"),
        ({"every": 2.5}, "every"),
        ({"stats_every": -1}, "stats_every"),
        ({"codec": "gzip"}, "unknown codec 'gzip'"),
        ({"capture": ("params", "weights")}, "unknown capture kind 'weights'"),
        ({"include": ["fc*", 3]}, "glob"),
        ({"durability": "maybe"}, "durability"),
        ({"queue_depth": 0}, "queue_depth"),
    ],
)
def test_bad_recorder_arguments(tmp_path, kwargs, match):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(stepdump.ConfigError, match=match):
        stepdump.Recorder(tmp_path / "run", model, opt, **kwargs)
    assert not (tmp_path / "run" / "catalog.sqlite").exists()


def test_recorder_needs_a_module_and_an_optimizer(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(stepdump.ConfigError, match="torch.nn.Module"):
        stepdump.Recorder(tmp_path / "a", lambda x: x, opt)
    with pytest.raises(stepdump.ConfigError, match="torch.optim.Optimizer"):
        stepdump.Recorder(tmp_path / "b", model, object())
    (tmp_path / "file").write_text("")
    with pytest.raises(stepdump.ConfigError, match="is a file"):
        stepdump.Recorder(tmp_path / "file", model, opt)


def test_open_a_file_or_a_damaged_catalog(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(stepdump.NotARunError):
        stepdump.open(tmp_path / "file.txt")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "catalog.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(stepdump.CorruptDataError, match="not a readable stepdump catalog"):
        stepdump.open(tmp_path / "bad")


def test_damaged_segment_bytes_fail_their_checksum(tmp_path):
    _record(tmp_path / "run", steps=2)
    (seg,) = (tmp_path / "run" / "segments").glob("*.seg")
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with stepdump.open(tmp_path / "run") as run:
        with pytest.raises(stepdump.CorruptDataError, match="checksum"):
            for t in run.steps:
                for kind in ("params", "grads", "optimizer"):
                    run.tensors(t, kind)
                run.step_state(t)


def test_an_empty_run_opens(tmp_path):
    model = nn.Linear(2, 1)
    stepdump.Recorder(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1)).close()
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [] and run.all_steps == [] and run.skipped_steps == []
        assert run.names("params") == []
        assert run.stats().empty and list(run.scalars().columns) == ["skipped"]
        with pytest.raises(stepdump.StepNotFoundError, match="no recorded steps yet"):
            run.state_dict(0)


def test_steps_taken_from_a_dataframe_work(tmp_path):
    """numpy.int64 steps (from run.stats() / run.scalars()) are steps like any other."""
    model, opt = _record(tmp_path / "run", steps=3)
    with stepdump.open(tmp_path / "run") as run:
        step = run.stats()["step"].iloc[-1]
        assert type(step) is not int and step == 3 == run.meta["final_step"]
        assert_same(run.tensor("0.weight", step), run.tensor("0.weight", 3))
        assert sorted(run.tensors(step)) == sorted(run.tensors(3))
        assert list(run.state_dict(step)) == list(run.state_dict(3))
        assert run.optimizer_state_dict(step)["param_groups"] == run.optimizer_state_dict(3)["param_groups"]
        assert run.scheduler_state_dict(step) is None and run.scaler_state_dict(step) is None
        assert_same(run.rng_state(step)["torch"], run.rng_state(3)["torch"])
        assert run.fingerprints(step) == run.fingerprints(3)
        assert list(run.stats(steps=step)["step"].unique()) == [3]
        assert list(run.scalars(steps=run.scalars().index[1]).index) == [1]
        run.restore(step, model, opt)
        with pytest.raises(stepdump.ConfigError, match="integer"):
            run.tensor("0.weight", 1.5)
        with pytest.raises(stepdump.ConfigError, match="integer"):
            run.tensor("0.weight", "2")
