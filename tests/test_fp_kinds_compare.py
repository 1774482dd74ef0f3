"""Comparisons never call two fingerprint kinds equal (docs/cuda.md, "Comparisons").

The same seeded CPU training is recorded with ``fingerprint="xxh3"`` and ``"dmix64"`` (and a twin
of each): a diff of twins is identical (the control); across kinds a tensor is compared by its
bytes where a step stored them (both runs, or one run's bytes under the other's kind) and is
otherwise named as not compared, so the result is never ``identical``; a real difference is still
found. Cross-rank comparison does the same per rank pair; restore, replay, the gradient log and
re-execution check the live or rebuilt tensors under the recorded row's kind, so a dmix64 run
verifies, continues bitwise and gives true verdicts.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, record_run, tiny_batch, tiny_model

import reexec_loops as L
import stepdump
from stepdump.analysis.cross_rank import cross_rank
from stepdump.analysis.findings import Severity
from stepdump.store import ranks as ranks_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ranks_gen import write_ranks  # noqa: E402

STEPS = 4  # iterations 0..3, then the final record 4 (stored in full by close())
SCHEDULES: dict[str, dict[str, Any]] = {"lean": {"every": None, "stats_every": 1}, "every2": {"every": 2}}


def _record(path: Path, fp: str, schedule: str, seed: int = 0) -> Path:
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return record_run(path, steps=STEPS, model=model, opt=opt, fingerprint=fp, on_error="raise",
                      **SCHEDULES[schedule])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Path]:
    """(fingerprint, schedule, which) -> run: ``a`` and its ``twin`` (the same training), ``other``
    (another seed: other initial params, so every tensor differs from step 0 on)."""
    root = tmp_path_factory.mktemp("fpkinds")
    out = {}
    for fp in ("xxh3", "dmix64"):
        for schedule in SCHEDULES:
            for which, seed in (("a", 0), ("twin", 0), ("other", 1)):
                out[(fp, schedule, which)] = _record(root / f"{fp}-{schedule}-{which}", fp, schedule, seed)
    return out


def _stats_only(run: Any) -> list[int]:
    return sorted(set(run.stats_steps) - set(run.steps))


def _uncompared(run_a: Any, run_b: Any, steps: list[int]) -> int:
    """Step-tensor checks a diff cannot make across kinds at ``steps``: the (kind, name) both runs
    fingerprinted there (every diffed kind; this model has no buffers, state refs aside)."""
    return sum(len({k for k in run_a.fingerprints(s) if k[0] != "inputs"} & set(run_b.fingerprints(s)))
               for s in steps)


def test_the_runs_carry_the_kind_they_were_recorded_with(runs: dict[tuple[str, str, str], Path]) -> None:
    """The control for everything below: a dmix64 run's rows are dmix64, an xxh3 run's xxh3."""
    for (fp, _, _), path in runs.items():
        with stepdump.open(path) as run:
            kinds = {k for s in run.stats_steps for k in run.fingerprint_kinds(s).values()}
            assert kinds == {fp}, (path, kinds)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("fp", ["xxh3", "dmix64"])
def test_twins_of_one_kind_are_identical(runs: dict[tuple[str, str, str], Path], fp: str, schedule: str) -> None:
    with stepdump.open(runs[(fp, schedule, "a")]) as a, stepdump.open(runs[(fp, schedule, "twin")]) as b:
        res = stepdump.diff(a, b)
        assert res.identical and res.complete, res.summary()
        assert res.coverage.fp_kinds_differ == 0
        assert "fingerprint kind" not in res.summary()


# (A's kind, A's schedule, B's kind, B's schedule): every pairing of two kinds, each order.
ACROSS = [("xxh3", "lean", "dmix64", "lean"), ("dmix64", "lean", "xxh3", "lean"),
          ("xxh3", "every2", "dmix64", "every2"), ("dmix64", "every2", "xxh3", "every2"),
          ("xxh3", "every2", "dmix64", "lean"), ("dmix64", "lean", "xxh3", "every2")]


def _ids(row: tuple[str, ...]) -> str:
    return "-".join(row)


@pytest.mark.parametrize("row", ACROSS, ids=_ids)
def test_the_same_training_across_kinds_is_never_identical(runs: dict[tuple[str, str, str], Path],
                                                           row: tuple[str, str, str, str]) -> None:
    """Bytes compared (equal) where either run stored them; every other step-tensor named as not
    compared; so no difference is found, yet the result is neither identical nor complete."""
    ka, sa, kb, sb = row
    with stepdump.open(runs[(ka, sa, "a")]) as a, stepdump.open(runs[(kb, sb, "twin")]) as b:
        res = stepdump.diff(a, b)
        neither = sorted(set(_stats_only(a)) & set(_stats_only(b)))  # steps where no run stored bytes
        assert res.first_step is None and not res.identical and not res.complete, res.summary()
        assert res.coverage.fp_kinds_differ == _uncompared(a, b, neither) > 0
        first = res.coverage.fp_kinds_differ_first
        assert first is not None and first[0] == neither[0] and first[3:] == (ka, kb), first
        assert f"fingerprint kinds differ ({ka} in A, {kb} in B) and no bytes are stored" in res.summary()
        # Compared where bytes exist: at the final record always; at every step one run stored.
        stored = sorted(set(a.stats_steps) - set(neither))
        assert res.coverage.tensor_checks == _uncompared(a, b, stored) > 0
        assert res.comparable


@pytest.mark.parametrize("row", ACROSS[:2], ids=_ids)
def test_nothing_comparable_across_kinds_without_bytes(runs: dict[tuple[str, str, str], Path],
                                                       row: tuple[str, str, str, str]) -> None:
    """Grads are never in the final record: lean runs of two kinds have nothing comparable there."""
    ka, sa, kb, sb = row
    with stepdump.open(runs[(ka, sa, "a")]) as a, stepdump.open(runs[(kb, sb, "twin")]) as b:
        res = stepdump.diff(a, b, kinds=("grads",))
        assert not res.comparable and not res.identical, res.summary()
        assert res.headline().startswith("nothing to compare: ") and "fingerprint kinds differ" in res.headline()
        assert res.coverage.fp_kinds_differ == STEPS * len(a.names("grads")) == 16  # 4 grads x 4 iterations


@pytest.mark.parametrize("row", ACROSS, ids=_ids)
def test_a_real_difference_is_found_across_kinds(runs: dict[tuple[str, str, str], Path],
                                                 row: tuple[str, str, str, str]) -> None:
    """Another seed: found at the first step where either run stored the params' bytes."""
    ka, sa, kb, sb = row
    with stepdump.open(runs[(ka, sa, "a")]) as a, stepdump.open(runs[(kb, sb, "other")]) as b:
        res = stepdump.diff(a, b, ignore="scalars")
        first_bytes = min(set(a.steps) | set(b.steps))
        assert res.first_tensor_step == first_bytes, res.summary()
        assert not res.identical
        diffs = {(t.kind, t.name): t for t in res.tensors}
        assert ("params", "0.weight") in diffs
        both = first_bytes in a.steps and first_bytes in b.steps
        # Both stored: values compared; one stored: its bytes under the other's kind (values unknown).
        assert diffs[("params", "0.weight")].reason == ("values" if both else "fingerprint"), diffs


@pytest.mark.parametrize("row", ACROSS[:4], ids=_ids)
def test_noise_diff_across_kinds_is_never_identical(runs: dict[tuple[str, str, str], Path],
                                                    row: tuple[str, str, str, str]) -> None:
    ka, sa, kb, sb = row
    with stepdump.open(runs[(ka, sa, "a")]) as a, stepdump.open(runs[(ka, sa, "twin")]) as rep, \
            stepdump.open(runs[(kb, sb, "twin")]) as b:
        same = stepdump.diff(a, rep, noise=[rep])
        assert same.coverage.fp_kinds_differ == 0 and same.first_step is None  # the control
        res = stepdump.diff(a, b, noise=[rep])
        assert res.first_step is None and not res.identical and res.coverage.fp_kinds_differ > 0, res.summary()


# -- cross-rank ------------------------------------------------------------------------------------
def _mixed(root: Path, rank0: Path, rank1: Path) -> Path:
    """A 2-rank run whose rank 0 is ``rank0``'s and rank 1 ``rank1``'s (two recordings of one job)."""
    root.mkdir()
    shutil.copy(rank0 / ranks_file.RANKS_FILE, root / ranks_file.RANKS_FILE)
    for r, src in ((0, rank0), (1, rank1)):
        shutil.copytree(src / ranks_file.rank_dir(r), root / ranks_file.rank_dir(r))
    return root


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, int], Path]:
    """(fingerprint, schedule, seed) -> a 2-rank DDP recording (benchmarks/ranks_gen.py)."""
    root = tmp_path_factory.mktemp("fpranks")
    out = {}
    for fp in ("xxh3", "dmix64"):
        for schedule, kw in SCHEDULES.items():
            for seed in (0, 1):
                out[(fp, schedule, seed)] = write_ranks(root / f"{fp}-{schedule}-{seed}", 2, steps=STEPS, seed=seed,
                                                        record={**kw, "fingerprint": fp, "on_error": "raise"})
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kinds", [("xxh3", "dmix64"), ("dmix64", "xxh3")], ids=_ids)
def test_cross_rank_across_kinds(ranked: dict[tuple[str, str, int], Path], tmp_path: Path, schedule: str,
                                 kinds: tuple[str, str]) -> None:
    """Replicas of two kinds: no ERROR where the bytes agree, a WARNING naming what was not compared
    (the control: one kind, no finding at all); a rank of another seed is an ERROR at the first step
    where its bytes can be compared."""
    k0, k1 = kinds
    for fp in kinds:  # the controls
        with stepdump.open(ranked[(fp, schedule, 0)]) as run:
            assert cross_rank(run) == [], fp
    with stepdump.open(_mixed(tmp_path / "same", ranked[(k0, schedule, 0)], ranked[(k1, schedule, 0)])) as run:
        found = cross_rank(run)
        assert [f.severity for f in found] == [Severity.WARNING], found
        assert "fingerprint kinds differ" in found[0].message and "not compared" in found[0].message
        assert f"{k0} on rank 0" in found[0].message and f"{k1} on rank 1" in found[0].message
        with stepdump.open(ranked[(k0, schedule, 0)]) as other:
            assert not stepdump.diff(other, run).identical  # rank 1 of two kinds: never identical
    seed1 = ranked[(k1, schedule, 1)]
    with stepdump.open(_mixed(tmp_path / "apart", ranked[(k0, schedule, 0)], seed1)) as run:
        errors = [f for f in cross_rank(run) if f.severity == Severity.ERROR]
        first_full = min(run.rank(0).steps)  # every2: step 0; lean: only the final record stores bytes
        assert errors and {f.step for f in errors} == {first_full}, errors


# -- restore, replay, gradient log, re-execution of a dmix64 run -----------------------------------
def test_restore_of_a_dmix64_run_verifies_and_continues_bitwise(tmp_path: Path) -> None:
    path = record_run(tmp_path / "r", steps=6, model=tiny_model(0), fingerprint="dmix64", every=2,
                      on_error="raise")
    ref = record_run(tmp_path / "x", steps=6, model=tiny_model(0), fingerprint="xxh3", every=2)
    with stepdump.open(path) as run, stepdump.open(ref) as xrun:
        assert stepdump.verify(run).ok
        for step in (2, 4):
            model = tiny_model(5)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            run.restore(step, model, opt, sched)
            for t in range(step, 6):  # continue: each later full record is met bit for bit
                x, y = tiny_batch(t)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                sched.step()
                if t + 1 in run.steps:
                    for name, p in model.named_parameters():
                        assert_same(p.detach(), run.tensor(name, t + 1), f"{name} at {t + 1} from {step}")
                        assert_same(p.detach(), xrun.tensor(name, t + 1), f"{name} vs the xxh3 run")


def test_replay_of_a_dmix64_run_verifies_each_step(tmp_path: Path) -> None:
    """Lean steps between keyframes: replay fingerprints the live tensors under dmix64 (under xxh3
    every step would be a divergence); a changed loop still diverges (the verdict stays true)."""
    def run_loop(path: Path, **kw: Any) -> Path:
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with stepdump.Recorder(path, model, opt, keyframe_every=3, fingerprint="dmix64", on_error="raise") as rec:
            for t in range(5):
                b = tiny_batch(t)
                rec.log_batch(b)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(b[0]), b[1]).backward()
                opt.step()
        return path

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: Any, scale: float = 1.0) -> None:
        opt.zero_grad()
        (scale * torch.nn.functional.mse_loss(model(b[0]), b[1])).backward()
        opt.step()

    with stepdump.open(run_loop(tmp_path / "r")) as run:
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        res = stepdump.replay(run, 2, model, opt, train_step)
        assert res.steps_replayed >= 2
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(stepdump.ReplayDiverged):
            stepdump.replay(run, 2, model, opt, lambda m, o, b: train_step(m, o, b, 1.5))


@pytest.mark.parametrize("fp", ["xxh3", "dmix64"])
def test_gradient_log_of_a_dmix64_run_reads_every_step_bitwise(tmp_path: Path, fp: str) -> None:
    full = record_run(tmp_path / "full", steps=7, model=tiny_model(0), every=1)
    log = record_run(tmp_path / "log", steps=7, model=tiny_model(0), gradient_log=3, fingerprint=fp,
                     on_error="raise")
    with stepdump.open(full) as ref, stepdump.open(log) as run:
        assert {k for s in run.stats_steps for k in run.fingerprint_kinds(s).values()} == {fp}
        for step in ref.steps:
            for kind in ("params", "optimizer"):
                want, got = ref.tensors(step, kind), run.tensors(step, kind)
                assert want.keys() == got.keys(), (step, kind)
                for name in want:
                    assert_same(got[name], want[name], f"{kind} {name} at {step}")
        assert stepdump.verify(run).ok


@pytest.mark.parametrize("mode", ["full", "gradlog"])
def test_reexecution_verdicts_on_a_dmix64_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """An identical re-executed step reproduces; the step whose recorded grad had a bit flipped
    differs from the record, first at that grad (the verdicts of an xxh3 run, tests/test_reexecute.py)."""
    monkeypatch.setitem(L.MODES, mode, {**L.MODES[mode], "fingerprint": "dmix64"})
    flip_at = 1
    with stepdump.open(L.record_gpt(tmp_path / mode, mode, steps=3, flip_at=flip_at)) as run:
        assert set(run.fingerprint_kinds(0).values()) == {"dmix64"}
        for t in range(3):
            model, opt, train_step = L.gpt_factory()
            r = stepdump.reexecute(run, t, model, opt, train_step, repeat=2)
            if t != flip_at:
                assert r.verdict == "reproduces", r.summary()
            else:
                assert r.verdict == "differs from the record", r.summary()
                assert r.first == ("grads", L.FLIPPED)


# -- the other places a recorded row meets a live or rebuilt tensor -------------------------------
def test_bundle_of_a_dmix64_run_keeps_the_kinds_and_reproduces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle copies fingerprints: its series keep the source's kind (read as xxh3 they would
    make every re-execution of the bundle "differ"); re-executing it reproduces."""
    from stepdump.reexec.bundle import bundle

    monkeypatch.setitem(L.MODES, "full", {"fingerprint": "dmix64"})
    with stepdump.open(L.record_gpt(tmp_path / "run", "full", steps=3)) as run:
        want = {s: (run.fingerprints(s), run.fingerprint_kinds(s)) for s in (1, 2)}
        bundle(run, 1, tmp_path / "b")
    with stepdump.open(tmp_path / "b") as b:
        for s in (1, 2):
            fps, kinds = want[s]
            assert {k: b.fingerprints(s)[k] for k in fps} == fps, s
            assert {k: b.fingerprint_kinds(s)[k] for k in kinds} == kinds == dict.fromkeys(kinds, "dmix64"), s
        assert stepdump.verify(b).ok
        model, opt, train_step = L.gpt_factory()
        r = stepdump.reexecute(b, 1, model, opt, train_step, repeat=2)
        assert r.verdict == "reproduces", r.summary()


def test_frozen_base_of_a_dmix64_run_is_checked_under_dmix64(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """frozen='fingerprint': restore takes the base from the live model after checking it against
    the recorded (dmix64) fingerprint: the same base restores and continues bitwise, another is refused."""
    import test_adapters as AD

    monkeypatch.setitem(AD.MODES, "fingerprint-full", {**AD.MODES["fingerprint-full"], "fingerprint": "dmix64"})
    _, want = AD.record(tmp_path / "run", "fingerprint-full")
    with stepdump.open(tmp_path / "run") as run:
        assert "dmix64" in set(run.fingerprint_kinds(4).values())
        o = AD.build(adapter_seed=54)
        run.restore(4, o["model"], o["optimizer"], o["scheduler"])
        for t in range(4, AD.N):
            AD.iteration(t, o)
        AD.assert_same_tree(AD.state(o), want, "restore(4) onto the same base + continue")
        o = AD.build(adapter_seed=7, base_seed=3)
        with pytest.raises(stepdump.RestoreMismatchError, match=r"frozen '0\.base\.weight' differs"):
            run.restore(4, o["model"], o["optimizer"], o["scheduler"])


def test_averaged_model_of_a_dmix64_gradient_log_is_rebuilt_and_checked(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An AveragedModel between keyframes is rebuilt and checked against its dmix64 fingerprints:
    every step reads bitwise; one updated twice an iteration is still refused."""
    import test_extra_state as XS

    monkeypatch.setitem(XS.MODES, "gradlog3", {**XS.MODES["gradlog3"], "fingerprint": "dmix64"})
    snaps, _ = XS.record(tmp_path / "run", "gradlog3")
    with stepdump.open(tmp_path / "run") as run:
        assert "dmix64" in set(run.fingerprint_kinds(4).values())
        for s in run.gradient_log.readable_steps():
            for name in ("ema", "swa"):
                XS.assert_same_tree(run.extra_state_dict(s, name), snaps[s][name], f"step {s} {name}")
    o = XS.build(0)
    with stepdump.Recorder(tmp_path / "twice", o["model"], o["optimizer"], o["scheduler"], on_error="raise",
                           extra_state=o["extra_state"], gradient_log=4, fingerprint="dmix64"):
        for t in range(6):
            XS.iteration(t, o)
            o["extra_state"]["ema"].update_parameters(o["model"])
    with stepdump.open(tmp_path / "twice") as run, \
            pytest.raises(stepdump.RebuildError, match=r"differs from its recorded fingerprint \(dmix64\)"):
        run.extra_state_dict(2, "ema")


@pytest.mark.parametrize(("which", "code"), [("twin", 6), ("other", 1)])
def test_cli_diff_across_kinds_exits_neither_identical_nor_different(runs: dict[tuple[str, str, str], Path], cli: Any,
                                                                       which: str, code: int) -> None:
    """Exit 6 (not everything could be compared) where nothing compared differs, 1 where something
    does; never 0 (the control: twins of one kind exit 0)."""
    cli("diff", str(runs[("dmix64", "every2", "a")]), str(runs[("dmix64", "every2", "twin")]), ok=0)
    got = cli("diff", str(runs[("xxh3", "every2", "a")]), str(runs[("dmix64", "every2", which)]), ok=code)
    if code == 6:
        assert "fingerprint kinds differ (xxh3 in A, dmix64 in B)" in got.stdout, got.stdout
    js = cli("diff", str(runs[("xxh3", "every2", "a")]), str(runs[("dmix64", "every2", which)]), "--json", ok=code)
    assert '"fp_kinds_differ"' in js.stdout and "\"identical\": false" in js.stdout
