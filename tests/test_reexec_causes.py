"""Re-execution names a cause only with its evidence (docs/reexecute.md, "Causes and their evidence").

Generated loops (tests/reexec_shapes.py) that draw from the RNG inside the iteration or change params
between updates re-execute as *reproduces* at every step of every mode, an edit between steps is its
own finding, a damaged record is said as such, "suspected corruption" needs every piece of evidence,
and a flipped bit in one grad at record time is still named at its step and tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reexec_shapes as S
import stepdump
from stepdump.errors import RebuildError
from stepdump.reexec.verdict import DAMAGED, DIFFERS, REPRODUCES


@pytest.mark.parametrize("mode", sorted(S.MODES))
@pytest.mark.parametrize("shape", sorted(S.SHAPES))
def test_generated_loops_reproduce_at_every_step(tmp_path: Path, shape: str, mode: str) -> None:
    sh = S.SHAPES[shape]
    live = S.train(sh, path=tmp_path / "run", mode=mode)
    plain = S.train(sh)
    for n, p in plain.items():  # do no harm: the recorded loop trains bitwise as the plain one
        assert torch.equal(p, live[n]), n
    run = stepdump.open(tmp_path / "run")
    for t in range(S.STEPS):
        model, opt, train_step = S.factory(sh)
        try:
            r = stepdump.reexecute(run, t, model, opt, train_step, repeat=2)
        except RebuildError as e:  # a gradient log of an optimizer outside torch.optim: refused, with the reason
            assert mode == "gradlog" and shape == "schedule_free" and "not a torch.optim class" in str(e), e
            continue
        assert r.verdict == REPRODUCES, f"{shape}/{mode} step {t}: {r.summary()}"
        if sh.edits(t) and t + 1 < S.STEPS + 1:
            assert r.edited, f"{shape}/{mode} step {t}: the loop's edit after the update is not named"
            assert f"between update {t} and step {t + 1}" in r.summary(), r.summary()
        else:
            assert not r.edited, (t, r.edited)


def test_edit_between_steps_is_named_with_the_params(tmp_path: Path) -> None:
    sh = S.SHAPES["clamp"]
    S.train(sh, path=tmp_path / "run")
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 2, model, opt, train_step)
    assert r.verdict == REPRODUCES and r.edited
    assert set(r.edited) <= {n for n, _ in model.named_parameters()}
    assert f"the loop changed {len(r.edited)} param" in r.summary()


@pytest.mark.parametrize("mode", ["full", "gradlog"])
def test_flipped_bit_still_named_under_edits_and_rng_draws(tmp_path: Path, mode: str) -> None:
    sh = S.SHAPES["clamp"]
    S.train(sh, path=tmp_path / "run", mode=mode, flip=(3, "fc1.weight"))
    run = stepdump.open(tmp_path / "run")
    for t in range(S.STEPS):
        model, opt, train_step = S.factory(sh)
        r = stepdump.reexecute(run, t, model, opt, train_step, repeat=2)
        if t != 3:
            assert r.verdict == REPRODUCES, r.summary()
            continue
        assert r.verdict == DIFFERS and r.first == ("grads", "fc1.weight"), r.summary()
        assert r.cause == "suspected corruption at record time", r.summary()
        assert not r.unexcluded, r.unexcluded


def _flip_blob_byte(run_dir: Path, step: int, kind: str, name: str) -> None:
    run = stepdump.open(run_dir)
    key, offset, length = run._con.execute(
        "SELECT g.key, b.offset, b.length FROM tensors t JOIN series s ON s.id=t.series JOIN blobs b ON "
        "b.id=t.blob JOIN segments g ON g.id=b.segment WHERE s.kind=? AND s.name=? AND t.step=?",
        (kind, name, step)).fetchone()
    run.close()
    with open(run_dir / key, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("mode", ["full", "gradlog"])
def test_damaged_record_is_said_as_such(tmp_path: Path, mode: str) -> None:
    sh = S.SHAPES["get_batch"]
    S.train(sh, path=tmp_path / "run", mode=mode)
    _flip_blob_byte(tmp_path / "run", 2, "grads", "fc2.weight")
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 2, model, opt, train_step)
    assert r.verdict == DAMAGED, r.summary()
    assert any("grads" in d and "fc2.weight" in d and "checksum" in d for d in r.damaged), r.damaged
    assert "stepdump verify" in r.summary()
    model, opt, train_step = S.factory(sh)
    assert stepdump.reexecute(run, 4, model, opt, train_step).verdict == REPRODUCES  # other steps are intact


def test_corruption_is_not_named_without_the_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the evidence (the forwards' RNG not replayed, a record not compared with the update's
    output, as in a run recorded before either existed, one re-execution): no corruption verdict;
    the causes it could not exclude are listed."""
    sh = S.SHAPES["get_batch"]
    S.train(sh, path=tmp_path / "run", mode="full", flip=(2, "fc1.weight"))
    run = stepdump.open(tmp_path / "run")
    import stepdump.reexec.verdict as V

    monkeypatch.setattr(V, "edits_watched", lambda run, step: False)  # as a run recorded before the watch
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 2, model, opt, train_step, repeat=1, replay_forward_rng=False)
    assert r.verdict == DIFFERS
    assert r.cause != "suspected corruption at record time", r.summary()
    assert "suspected silent data corruption" not in r.summary()
    assert r.unexcluded and any("re-executed once" in u for u in r.unexcluded), r.unexcluded
    assert any("edit" in u for u in r.unexcluded), r.unexcluded


def test_params_reproduce_loss_differs_points_at_rng_or_data(tmp_path: Path) -> None:
    """Replaying the start RNG only (the forwards' RNG not replayed): params can still be compared,
    and when only the loss and later differ, the likely cause named first is the RNG or the data."""
    sh = S.SHAPES["get_batch"]
    S.train(sh, path=tmp_path / "run", mode="full")
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 1, model, opt, train_step, repeat=2, replay_forward_rng=False)
    assert r.verdict == DIFFERS, r.summary()
    assert r.cause != "suspected corruption at record time"
    assert r.unexcluded[0].startswith("the RNG or the data"), r.unexcluded


def test_nan_loss_is_said_as_nan(tmp_path: Path) -> None:
    import reexec_loops as L

    run = stepdump.open(L.record_nan(tmp_path / "nan", "full", bad_step=2, steps=4))
    model, opt, train_step = L.nan_factory()
    r = stepdump.reexecute(run, 2, model, opt, train_step, find_nan=True)
    text = r.summary()
    assert "no scalar 'loss' logged" not in text, text
    assert "the loss logged at step 2 was NaN" in text, text


# -- a lean run re-executes from the CLI: replayed from the nearest stored step, every step verified --------
class _Sqrt(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _lean_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(12, 4, generator=g) + 0.1, torch.rand(12, 1, generator=g)
    x[3, 1] = -0.5  # one bad sample: a NaN wherever get_batch draws it (first at step 3)
    return x, y


def lean_entry(changed: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """nanoGPT's shape: train_step draws its own batch from the global RNG when given none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Sqrt(), torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _lean_data()

    def train_step(m: torch.nn.Module, o: torch.optim.Optimizer, batch: object) -> float:
        if batch is None:
            ix = torch.randint(len(x), (4 if changed else 3,))  # changed: not the recorded pipeline
            batch = (x[ix], y[ix])
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(batch[0]), batch[1])  # type: ignore[index]
        loss.backward()
        o.step()
        return loss.item()

    return model, opt, train_step


def _record_lean(path: Path, steps: int = 8) -> int:
    model, opt, train_step = lean_entry()
    with stepdump.Recorder(path, model, opt, every=1000, stats_every=1) as rec:
        for _ in range(steps):
            rec.log(loss=train_step(model, opt, None))
    run = stepdump.open(path)
    nan = [s for s, n, v in run.scalar_rows() if n == "loss" and v is None]
    assert nan, "the bad sample was never drawn: pick another seed"
    return min(nan)


def test_lean_run_reexecutes_by_verified_replay_and_finds_the_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.cli.main import main

    bad = _record_lean(tmp_path / "run")
    assert bad > 0
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = lean_entry()
    r = stepdump.reexecute(run, bad - 1, model, opt, train_step)
    assert r.verdict == REPRODUCES and r.how.startswith("replayed from step 0"), r.summary()
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code = main(["reexecute", str(tmp_path / "run"), "--step", str(bad), "--entry", "test_reexec_causes:lean_entry",
                 "--find-nan"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "first NaN/Inf" in out and "'0'" in out, out  # module 0: the square root
    assert f"the loss logged at step {bad} was NaN" in out, out


def test_lean_replay_that_does_not_match_stops_at_the_step_and_tensor(tmp_path: Path) -> None:
    bad = _record_lean(tmp_path / "run")
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = lean_entry(changed=True)  # not the recorded loop: another batch size
    with pytest.raises(stepdump.ReplayDiverged, match="replay diverged at step 0: grads") as e:
        stepdump.reexecute(run, bad, model, opt, train_step)
    assert (e.value.step, e.value.kind) == (0, "grads")


def test_joint_run_reexec_and_bundle_refuse_with_the_true_reason(tmp_path: Path) -> None:
    from stepdump.reexec.bundle import bundle

    torch.manual_seed(0)
    g, d = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    with stepdump.Recorder(tmp_path / "j", models={"G": g, "D": d}, optimizers={"G": opt_g, "D": opt_d}):
        for _ in range(2):
            for opt, sign in ((opt_d, 1.0), (opt_g, -1.0)):
                opt_g.zero_grad()
                opt_d.zero_grad()
                (sign * d(g(torch.ones(2, 3))).mean()).backward()
                opt.step()
    run = stepdump.open(tmp_path / "j")
    with pytest.raises(stepdump.ConfigError, match=r"joint run \(pairs G, D\).*cannot be re-executed"):
        stepdump.reexecute(run, 0, g, opt_g, lambda m, o, b: None)
    with pytest.raises(stepdump.ConfigError, match=r"joint run \(pairs G, D\).*cannot be bundled"):
        bundle(run, 0, tmp_path / "b")


def test_one_grad_off_puts_corruption_first_when_evidence_is_missing(tmp_path: Path) -> None:
    """A bit flipped in one grad, re-executed once: corruption cannot be named (nondeterminism is not
    excluded), but with the loss and every other grad reproducing it is the most likely cause."""
    sh = S.SHAPES["get_batch"]
    S.train(sh, path=tmp_path / "run", mode="full", flip=(2, "fc1.weight"))
    run = stepdump.open(tmp_path / "run")
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 2, model, opt, train_step, repeat=1)
    assert r.verdict == DIFFERS and r.cause == "not determined", r.summary()
    assert r.unexcluded[0].startswith("silent data corruption at record time: only grads 'fc1.weight'"), r.unexcluded
    assert any("re-executed once" in u for u in r.unexcluded[1:]), r.unexcluded


def test_cli_damaged_record_exits_corrupt_and_json_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from stepdump.cli.main import main

    _record_lean(tmp_path / "run")
    _flip_blob_byte(tmp_path / "run", 0, "grads", "1.weight")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code = main(["reexecute", str(tmp_path / "run"), "--step", "0", "--entry", "test_reexec_causes:lean_entry", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 4, out
    assert out["verdict"] == "the record is damaged" and "1.weight" in out["damaged"][0], out


def test_no_batch_logged_and_train_step_needs_one_is_a_clear_error(tmp_path: Path) -> None:
    import reexec_loops as L

    model, opt, train_step = L.nan_factory()
    with stepdump.Recorder(tmp_path / "r", model, opt) as rec:  # the loop never calls rec.log_batch
        for t in range(3):
            rec.log(loss=train_step(model, opt, L.nan_batch(t, bad_step=99)))
    model, opt, train_step = L.nan_factory()
    with pytest.raises(stepdump.ConfigError, match="holds no batch .*given None and failed"):
        stepdump.reexecute(stepdump.open(tmp_path / "r"), 1, model, opt, train_step)
    model, opt, train_step = L.nan_factory()
    r = stepdump.reexecute(stepdump.open(tmp_path / "r"), 1, model, opt, train_step, batch=L.nan_batch(1, 99))
    assert r.verdict == REPRODUCES, r.summary()


def test_the_edit_watch_runs_where_the_next_record_is_full_and_names_lean_steps_as_unwatched(tmp_path: Path) -> None:
    """Tiered (every=2, stats_every=1): records 2 and 4 (full) were compared with the update before
    them; records 1 and 3 (lean) were not, so nothing is hashed for them on the training thread."""
    from stepdump.reexec.engine import edits_watched

    sh = S.SHAPES["clamp"]
    S.train(sh, path=tmp_path / "run", mode="full", every=2, stats_every=1)
    run = stepdump.open(tmp_path / "run")
    assert [edits_watched(run, t) for t in range(4)] == [False, True, False, True]
    model, opt, train_step = S.factory(sh)
    r = stepdump.reexecute(run, 2, model, opt, train_step)  # full step 2, its next record 3 is lean
    assert r.verdict == DIFFERS and r.cause == "not determined", r.summary()  # the clamp, unwatched at 3
    assert r.unexcluded[0].startswith("an edit of the params by the loop between update 2 and step 3"), r.unexcluded


class _TwoExperts(torch.nn.Module):
    """Expert ``b`` serves steps 0, 3, 6 only: with zero_grad(set_to_none=False) it carries a zero grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.t = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a if self.t % 3 else self.b)(x)


def _experts_step(m: torch.nn.Module, opt: torch.optim.Optimizer, batch: object) -> float:
    """One iteration; the module's ``t`` (which expert serves) is set by the caller."""
    x, y = batch  # type: ignore[misc]
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_grads_carried_into_an_iteration_are_recorded_restored_and_reexecuted(tmp_path: Path) -> None:
    """zero_grad(set_to_none=False) and an idle expert: the idle expert's zero grad is carried into
    the iteration and AdamW steps from it. Record t names it (state carried_grads), restore sets it,
    and a re-execution feeds it: the step reproduces (it differed: AdamW skipped the expert)."""
    def built() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = _TwoExperts()
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(t)
        return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    m, opt = built()
    with stepdump.Recorder(tmp_path / "r", m, opt) as rec:
        for t in range(6):
            m.t = t
            rec.log_batch(batch(t))
            rec.log(loss=_experts_step(m, opt, batch(t)))
    run = stepdump.open(tmp_path / "r")
    # Step 0: no update before it. Then the expert that sits out carries its zero grad in.
    assert "carried_grads" not in run.step_state(0)
    assert [run.step_state(t).get("carried_grads") for t in (1, 2, 3, 4)] == \
        [["b.weight", "b.bias"], ["b.weight", "b.bias"], ["a.weight", "a.bias"], ["b.weight", "b.bias"]]
    m2, opt2 = built()
    m2.t = 4
    r = stepdump.reexecute(run, 4, m2, opt2, _experts_step)
    assert r.verdict == REPRODUCES, r.summary()
