"""What gets recorded: kinds, include/exclude globs, ``every`` and ``stats_every`` schedules."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    MLP,
    assert_run_matches,
    assert_same,
    snapshot,
    train_recorded,
    training_scalars,
)
from torch import nn

import stepdump
from stepdump.capture.lean import OPTIMIZER_EVERY
from stepdump.core.hashing import fingerprint
from stepdump.core.stats import compute_stats

N = 12


def _train(path, steps=N, model=None, **rec_kwargs):
    torch.manual_seed(0)
    model = model if model is not None else MLP(8, 16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return train_recorded(path, model, opt, steps, **rec_kwargs)


def _only(snap, keep):
    return {
        "params": {n: t for n, t in snap["params"].items() if keep(n)},
        "grads": {n: t for n, t in snap["grads"].items() if keep(n)},
        "optimizer": {n: t for n, t in snap["optimizer"].items() if keep(n.rsplit(".", 1)[0])},
    }


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("fc1.*", None, ["fc1.weight", "fc1.bias"]),
        ("*", "*.bias", ["fc1.weight", "fc2.weight"]),
        (["fc1.weight", "fc2.*"], None, ["fc1.weight", "fc2.weight", "fc2.bias"]),
        (["fc*"], ["fc2.weight", "*.bias"], ["fc1.weight"]),
        (None, "fc1.bias", ["fc1.weight", "fc2.weight", "fc2.bias"]),
    ],
)
def test_include_exclude_globs(tmp_path, include, exclude, expected):
    snaps = _train(tmp_path / "run", steps=4, include=include, exclude=exclude)
    with stepdump.open(tmp_path / "run") as run:
        assert run.names("params") == expected
        assert run.names("grads") == expected
        assert sorted(run.names("optimizer")) == sorted(
            f"{n}.{k}" for n in expected for k in ("step", "exp_avg", "exp_avg_sq")
        )
        for t in range(4):
            assert_run_matches(run, t, _only(snaps[t], lambda n: n in expected))
        assert set(run.stats(kind="params")["name"]) == set(expected)
        assert set(run.stats(kind="grads")["name"]) == set(expected)
        if len(expected) < 4:  # a partial recording has no full state_dict, and says why
            with pytest.raises(stepdump.StepNotFoundError, match="include/exclude"):
                run.state_dict(2)


def test_include_filters_buffers_too(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    _train(tmp_path / "run", steps=2, model=model, include="1.*")
    with stepdump.open(tmp_path / "run") as run:
        assert run.names("params") == ["1.weight", "1.bias"]
        assert sorted(run.names("buffers")) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


@pytest.mark.parametrize(
    "capture, kinds",
    [
        (("params",), ["params"]),
        ("grads", ["grads"]),
        (("params", "optimizer"), ["params", "optimizer"]),
    ],
)
def test_capture_kinds(tmp_path, capture, kinds):
    snaps = _train(tmp_path / "run", steps=3, capture=capture)
    with stepdump.open(tmp_path / "run") as run:
        for kind in ("params", "grads", "optimizer"):
            if kind in kinds:
                assert run.names(kind)
                assert_run_matches(run, 2, snaps[2], kinds=[kind])
            else:
                assert run.names(kind) == []
                with pytest.raises(stepdump.TensorNotFoundError):
                    run.tensor("fc1.weight" if kind != "optimizer" else "fc1.weight.exp_avg", 2, kind=kind)


def _every_fn(s: int) -> bool:
    return s % 4 == 1


@pytest.mark.parametrize(
    "every, expected",
    [
        (1, list(range(N))),
        (3, [0, 3, 6, 9]),
        (range(2, 9, 2), [2, 4, 6, 8]),
        ([1, 4, 7, 30], [1, 4, 7]),
        ({0, 11}, [0, 11]),
        ((s for s in (5, 6)), [5, 6]),
        (_every_fn, [1, 5, 9]),
        (lambda s: s >= 10, [10, 11]),
        (None, []),
    ],
    ids=["1", "3", "range", "list", "set", "generator", "fn", "lambda", "None"],
)
def test_every_schedules(tmp_path, every, expected):
    snaps = _train(tmp_path / "run", every=every, stats_every=None)
    with stepdump.open(tmp_path / "run") as run:
        # whatever the schedule, close() stores the final record N (the trained model) in full
        assert run.steps == [*expected, N] and run.meta["final_step"] == N
        assert run.stats_steps == [*expected, N]
        assert run.all_steps == list(range(N + 1))  # every optimizer step is known
        assert run.tensors(N, "grads") == {}
        for t in expected:
            assert_run_matches(run, t, snaps[t])
            # the RNG state of a full step is there, also when the previous step was not full
            assert run.rng_state(t)["torch"].dtype == torch.uint8
        # (the final record names the tensors even when no other step was stored)
        for t in sorted(set(range(N)) - set(expected))[:3]:
            with pytest.raises(stepdump.StepNotFoundError):
                run.tensor("fc1.weight", t)
        # scalars are there for every step, recorded in full or not
        sc = training_scalars(run)
        assert list(sc.index) == list(range(N))
        assert sc["loss"].notna().all()
        assert run.stats(steps=[t for t in range(N) if t not in expected]).empty


def test_stats_every_keeps_stats_and_fingerprints_of_other_steps(tmp_path):
    snaps = _train(tmp_path / "run", every=5)  # stats_every=1 by default
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 5, 10, N] and run.meta["final_step"] == N  # N: close()'s final record
        assert run.stats_steps == list(range(N + 1))
        # the final record has the stats of what it stores: params and optimizer state, no grads
        assert set(run.stats(steps=N)["kind"]) == {"params", "optimizer"} and run.stats(steps=N)["stored"].all()
        with pytest.raises(stepdump.StepNotFoundError, match="only stats") as ei:
            run.tensor("fc1.weight", 3)
        assert "5" in str(ei.value)
        with pytest.raises(stepdump.StepNotFoundError):
            run.tensors(3, "grads")
        with pytest.raises(stepdump.StepNotFoundError):
            run.state_dict(3)
        with pytest.raises(stepdump.StepNotFoundError):
            run.optimizer_state_dict(7)
        stats = run.stats()
        for t in range(N):
            rows = stats[stats["step"] == t]
            # a stats-only step reads the optimizer state every OPTIMIZER_EVERY steps (the lean path)
            kinds = ("params", "grads") + (("optimizer",) if t % 5 == 0 or t % OPTIMIZER_EVERY == 0 else ())
            want = {(k, n): v for k in kinds for n, v in snaps[t][k].items()}
            got = {(r.kind, r.name): r for r in rows.itertuples()}
            assert set(got) == set(want), f"step {t}"
            for key, live in want.items():
                row = got[key]
                assert row.stored == (t % 5 == 0), f"{key} at {t}"
                assert row.fingerprint == fingerprint(live), f"fingerprint {key} at {t}"
                assert row.numel == live.numel()
                assert row.shape == ",".join(map(str, live.shape))
                assert row.dtype == "float32"
                exp = compute_stats(live)
                assert row.norm == pytest.approx(exp[8], rel=1e-6, abs=1e-12)
                assert row.mean == pytest.approx(exp[6], rel=1e-6, abs=1e-12)
        # the fingerprints of stored steps are those of the stored bytes
        for t in run.steps:
            for (kind, name), fp in run.fingerprints(t).items():
                if kind != "buffers":
                    assert fingerprint(run.tensor(name, t, kind=kind)) == fp
        # fingerprints tell steps apart
        assert run.fingerprints(3)[("params", "fc1.weight")] != run.fingerprints(4)[("params", "fc1.weight")]


def test_every_and_stats_every_combine(tmp_path):
    snaps = _train(tmp_path / "run", every=4, stats_every=3)
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [0, 4, 8, N] and run.meta["final_step"] == N
        assert run.stats_steps == [0, 3, 4, 6, 8, 9, N]  # a full step always has stats
        assert run.all_steps == list(range(N + 1))
        stats = run.stats(kind="params", name="fc2.bias")
        assert list(stats["step"]) == [0, 3, 4, 6, 8, 9, N]
        assert list(stats["stored"]) == [True, False, True, False, True, False, True]
        for t in run.stats_steps[:-1]:
            assert run.fingerprints(t)[("params", "fc2.bias")] == fingerprint(snaps[t]["params"]["fc2.bias"])


def test_stats_filters(tmp_path):
    _train(tmp_path / "run", steps=6)
    with stepdump.open(tmp_path / "run") as run:
        df = run.stats(kind="grads", name="fc1.*", steps=range(2, 5))
        assert list(df.columns) == [
            "step", "kind", "name", "dtype", "shape", "numel", "nan", "posinf", "neginf", "min", "max",
            "mean", "std", "norm", "zero_frac", "fingerprint", "fp_kind", "stored",
        ]
        assert sorted(set(df["step"])) == [2, 3, 4]
        assert set(df["kind"]) == {"grads"}
        assert set(df["name"]) == {"fc1.weight", "fc1.bias"}
        assert len(df) == 6
        assert set(run.stats(steps=slice(4, None))["step"]) == {4, 5, 6}  # 6: the final record
        assert set(run.stats(steps=[0, 5])["step"]) == {0, 5}
        assert set(run.stats(steps=3)["step"]) == {3}
        assert set(run.stats()["kind"]) == {"params", "grads", "optimizer"}


def test_stats_of_a_tensor_with_nan_and_inf(tmp_path):
    """Counts of the non-finite values; min/max/mean/std/norm over the finite ones."""
    values = [float("nan"), 1.0, float("inf"), 0.0, -2.0, float("-inf"), 3.0, 0.0, float("nan"), 4.0]

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(values))
            self.ok = nn.Parameter(torch.ones(3))

    model = Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with stepdump.Recorder(tmp_path / "run", model, opt, capture=("params",)):
        model.ok.sum().backward()
        opt.step()
    finite = torch.tensor([1.0, 0.0, -2.0, 3.0, 0.0, 4.0])
    with stepdump.open(tmp_path / "run") as run:
        assert_same(run.tensor("w", 0), torch.tensor(values))  # NaN payloads and all, bit for bit
        row = run.stats(kind="params", name="w").iloc[0]
        assert (row["numel"], row["nan"], row["posinf"], row["neginf"]) == (10, 2, 1, 1)
        assert row["min"] == -2.0 and row["max"] == 4.0
        assert row["mean"] == pytest.approx(finite.mean().item())
        assert row["std"] == pytest.approx(finite.std(correction=0).item())
        assert row["norm"] == pytest.approx(finite.norm().item())
        assert row["zero_frac"] == pytest.approx(2 / 10)
        assert row["fingerprint"] == fingerprint(torch.tensor(values))
        ok = run.stats(kind="params", name="ok").iloc[0]
        assert (ok["nan"], ok["posinf"], ok["neginf"], ok["zero_frac"]) == (0, 0, 0, 0.0)
        assert ok["std"] == 0.0 and ok["norm"] == pytest.approx(3**0.5)


def test_a_trigger_that_turns_on_mid_iteration(tmp_path):
    """A callable ``every`` that says yes only at the optimizer step (a trigger set by the loop):
    the step is stored in full, and since a callable schedule makes the recorder take the
    start-of-iteration state (RNG, buffers) every iteration, the record is complete."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trigger = {"on": False}
    snaps = []
    rng_at_start = {}
    with stepdump.Recorder(tmp_path / "run", model, opt, every=lambda s: trigger["on"], stats_every=None):
        for t in range(5):
            rng_at_start[t] = torch.get_rng_state()
            model(torch.randn(4, 2)).sum().backward()
            trigger["on"] = t == 3  # e.g. "the loss spiked: keep this step"
            snaps.append(snapshot(model, opt))
            opt.step()
            opt.zero_grad()
    with stepdump.open(tmp_path / "run") as run:
        assert run.steps == [3, 5] and run.meta["final_step"] == 5  # 5: the final record, always stored
        for name, b in model.named_buffers():  # the buffers as they are at close
            assert_same(run.tensor(name, 5, kind="buffers"), b, f"final buffer {name}")
        assert_run_matches(run, 3, snaps[3])
        assert torch.equal(run.rng_state(3)["torch"], rng_at_start[3])
        fresh = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        run.restore(3, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
        assert torch.equal(fresh[0].weight, run.tensor("0.weight", 3))


def test_a_steps_level_is_asked_once_for_a_fixed_schedule_and_every_time_for_a_callable():
    """The hooks ask for a step's level several times a step: a fixed schedule's answer for the
    last step is kept (its predicate is not run again); a callable one may change its mind within
    a step (a trigger the loop sets) and is asked every time."""
    from stepdump.capture.selection import Levels
    from stepdump.store.format import LEVEL_FULL, LEVEL_NONE, LEVEL_STATS

    fixed = Levels(5, 2)
    calls = {"n": 0}
    inner = fixed.full._pred
    fixed.full._pred = lambda s: (calls.__setitem__("n", calls["n"] + 1), inner(s))[1]
    assert [fixed(t) for t in (0, 0, 0, 2, 2, 3, 5, 5)] == [LEVEL_FULL] * 3 + [LEVEL_STATS] * 2 + [
        LEVEL_NONE, LEVEL_FULL, LEVEL_FULL]
    assert calls["n"] == 4  # once each for steps 0, 2, 3 and 5

    on = {"now": False}
    dynamic = Levels(lambda s: on["now"], None)
    assert dynamic(7) == LEVEL_NONE
    on["now"] = True  # the loop's trigger, set within step 7
    assert dynamic(7) == LEVEL_FULL
    assert dynamic(7) == LEVEL_FULL and dynamic(8) == LEVEL_FULL
