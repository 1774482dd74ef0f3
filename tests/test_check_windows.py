"""``check`` of a long run walks the stats window by window and tensor by tensor (issue 26 item 5).

The rules used to read a run's whole stats frame (steps x tensors rows: 50 M for 100 k steps of
500 tensors). They now walk it in windows of ``rule_runner.WINDOW_STEPS`` stats steps, or one
tensor's history at a time, and read the few rows a finding needs (the window before a gradient
spike). Rows here:

* every planted problem of tests/test_checks.py (a NaN in a grad, in a weight, in the loss, an
  AMP-skipped Inf, an lr blow-up, vanishing gradients, a dead layer, an unchanged tensor, weight
  growth, an eps-dominated Adam state, a plateau, a frozen parameter, dead activations): the
  findings with a 3-step window equal, row for row (rule, step, tensor, message, ...), those of the
  whole-frame path and those of the rules run on the plain Run;
* the memory of ``check`` on synthetic runs (benchmarks/synth_run.py) 4x longer: the traced Python
  peak grows by a small fraction of what the whole-frame path's grows by.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from helpers import peak_traced_bytes
from pandas.testing import assert_frame_equal
from test_checks import train
from torch import nn

import stepdump
from stepdump.analysis import rule_runner
from stepdump.analysis.checks import resolve_rules
from stepdump.analysis.rule_runner import CachedRun, run_rules, sort_key
from stepdump.store import queries_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synth_run import synth_run  # noqa: E402

K = 9  # the step where most problems are planted


def _nan_grad(t: int, model: nn.Module, _: Any) -> None:
    if t == K:
        model[0].weight.grad[3, 2] = float("nan")


def _nan_weight(t: int, model: nn.Module, _: Any) -> None:
    if t == K - 1:
        with torch.no_grad():
            model[2].weight[0, 5] = float("nan")


def _inf_grad(t: int, model: nn.Module, _: Any) -> None:
    if t == K:
        model[0].bias.grad[0] = float("inf")


def _lr_blow(t: int, _: nn.Module, opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (1000 if t == K else 1)


def _kill(model: nn.Module) -> list[dict[str, Any]]:
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return [{"params": list(model.parameters())}]


def _split(model: nn.Module) -> list[dict[str, Any]]:
    frozen = model[2].bias
    return [{"params": [p for p in model.parameters() if p is not frozen]}, {"params": [frozen], "lr": 0.0}]


def _zero(t: int, model: nn.Module, _: Any) -> None:
    model[0].bias.grad.zero_()


def _freeze(model: nn.Module) -> list[dict[str, Any]]:
    model[0].weight.requires_grad_(False)
    return [{"params": list(model.parameters())}]


# name -> (train() arguments, a rule that must find something)
PLANTED: dict[str, tuple[dict[str, Any], str]] = {
    "healthy": ({"steps": 25}, ""),
    "nan_grad": ({"steps": 20, "opt": "sgd", "before_step": _nan_grad}, "nan_inf"),
    "nan_weight": ({"steps": 20, "opt": "sgd", "after_step": _nan_weight}, "nan_inf"),
    "nan_loss": ({"steps": 15, "log": lambda t, loss: {"loss": float("nan") if t == K else loss}}, "nan_inf"),
    "amp_skip": ({"steps": 15, "before_step": _inf_grad, "scaler": "amp"}, "nan_inf"),
    "lr_blow_up": ({"steps": 30, "opt": "sgd", "before_step": _lr_blow}, "exploding_gradient"),
    "vanishing": ({"steps": 25, "opt": "sgd", "loss_fn": lambda t, m, loss: loss * (1e-12 if t >= K else 1.0)},
                  "vanishing_gradient"),
    "dead_layer": ({"steps": 20, "groups": _kill}, "dead_units"),
    "dead_activations": ({"steps": 15, "groups": _kill, "capture": ("params", "grads", "activations")},
                         "dead_units"),
    "unchanged": ({"steps": 20, "opt": "sgd", "groups": _split, "before_step": _zero}, "unchanged_tensor"),
    "frozen": ({"steps": 12, "groups": _freeze}, "unchanged_tensor"),
    "weight_growth": ({"steps": 60, "lr": 0.05, "loss_fn": lambda t, m, loss: loss - 0.1 * (m[0].weight ** 2).sum()},
                      "weight_norm_growth"),
    "eps_state": ({"steps": 15, "eps": 100.0}, "optimizer_state"),
    "plateau": ({"steps": 30, "opt": "sgd", "lr": 1e-2, "maximize": True}, "loss_not_decreasing"),
    "tiny_updates": ({"steps": 12, "opt": "sgd", "lr": 1e-8, "dtype": torch.float64}, "update_ratio"),
}


def _train(path: Path, name: str) -> stepdump.types.Run:
    kwargs = dict(PLANTED[name][0])
    if kwargs.get("scaler") == "amp":
        kwargs["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    return train(path, **kwargs)


def _whole(run: Any) -> list[Any]:
    return run_rules(CachedRun(run, streaming=False), resolve_rules(None))


@pytest.mark.parametrize("planted", list(PLANTED))
def test_windowed_check_finds_what_the_whole_frame_finds(tmp_path: Path, planted: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run = _train(tmp_path / "run", planted)
    whole = _whole(run)
    monkeypatch.setattr(rule_runner, "WINDOW_STEPS", 3)
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 0)  # stream however small the run
    windowed = stepdump.check(run)
    assert CachedRun(run).streaming
    plain = sorted((f for rule in resolve_rules(None) for f in rule(run)), key=sort_key)  # a Run, no view
    assert windowed == whole
    assert plain == whole
    rule = PLANTED[planted][1]
    if rule:
        assert any(f.rule == rule for f in windowed), [f.rule for f in windowed]


def test_windows_cover_every_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _train(tmp_path / "run", "nan_grad")
    monkeypatch.setattr(rule_runner, "WINDOW_STEPS", 4)
    view = CachedRun(run, streaming=True)
    assert {"grads", "params"} <= set(run.kinds())
    for kind in (None, *run.kinds()):
        windows = list(view.stats_windows(kind))
        assert len(windows) >= 5  # 21 stats steps in windows of 4
        whole = run.stats(kind) if kind else run.stats()
        full = [w for w in windows if not w.empty]  # a window may hold no row of a kind (the final step: no grads)
        assert_frame_equal(pd.concat(full, ignore_index=True), whole, check_exact=True, obj=str(kind))
    series = {n: rows.reset_index(drop=True) for n, rows in view.tensor_series("grads")}
    grouped = {str(n): rows.reset_index(drop=True) for n, rows in run.stats("grads").groupby("name", sort=False)}
    assert list(series) == list(grouped)
    for n in grouped:
        assert_frame_equal(series[n], grouped[n], check_exact=True, obj=n)


# -- memory ------------------------------------------------------------------------------
TENSORS, SHORT, LONG, WINDOW = 8, 128, 512, 64


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("synth")
    return {n: synth_run(root / f"r{n}", TENSORS, n, spike=n // 2, nan_step=n // 3) for n in (SHORT, LONG)}


def _peak(path: Path, check: Callable[[Any], Any]) -> int:
    with stepdump.open(path) as run:
        run.stats_steps, run.kinds()  # the catalog opened and its lists read outside the measure
        return peak_traced_bytes(lambda: check(run))


def test_check_memory_does_not_grow_with_steps_times_tensors(synth: dict[int, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rule_runner, "WINDOW_STEPS", WINDOW)
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 0)  # what a run past the threshold does
    # and the reader's decoded stat chunks held as a run's do once it is past its 16 MB of them
    monkeypatch.setattr(queries_stats, "CACHE_BYTES", 1 << 16)
    peak = {n: _peak(p, stepdump.check) for n, p in synth.items()}
    whole = _peak(synth[LONG], _whole)
    rows = (LONG - SHORT) * 2 * TENSORS  # params and grads of each tensor at each added step
    # The whole frame costs ~400-600 traced bytes a row (built from stat chunks' numpy columns;
    # ~800 when it was a Python tuple per row); the windows hold one window, one tensor's
    # history and the per-step series (scalars, the global grad norm), whatever the tensors.
    # Measured here: the whole frame 3.6 MB at 512 steps; the windowed peak ~1.1-1.2 MB at 128
    # and 512 steps (growth -0.2 to +0.2 MB, the per-step series and allocator noise).
    assert whole - peak[LONG] > 250 * rows, (whole, peak)  # what reading the whole frame costs
    # Per added step the windowed check may keep its per-step series (scalars, the global grad norm,
    # one tensor's history): measured 0.6-1.3 KB a step here (the short run's peak is the lower the
    # less a window's decoding holds), where the whole frame takes ~6 KB a step (16 rows): the bound
    # sits between, and does not grow with the tensors.
    assert peak[LONG] - peak[SHORT] < 2000 * (LONG - SHORT), (peak, whole)


# -- a lean run's stat chunks, read a group of tensors at a time ----------------------------
LEAN = ("dead_layer", "unchanged", "weight_growth", "nan_grad")


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every stat chunk decoded from now on."""
    from stepdump.store import stat_chunk

    calls: list[int] = []
    decode = stat_chunk.decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(stat_chunk, "decode", counted)
    return calls


@pytest.mark.parametrize("planted", LEAN)
def test_lean_check_reads_tensors_in_groups_with_the_same_findings(tmp_path: Path, planted: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A lean run keeps its stats in stat chunks, a share of each chunk per tensor: the rules that
    walk the tensors read a group of them per pass over the chunks (``Run.stats_by_tensor``), not
    one, with the findings of the whole frame and of the same rows in the row layout."""
    import shutil

    import helpers
    import test_checks
    from synth_run import from_chunks

    monkeypatch.setattr(test_checks, "record_run", lambda *a, **kw: helpers.record_run(
        *a, **kw, every=None, stats_every=1))
    run = _train(tmp_path / "lean", planted)
    assert run.catalog.has_stat_chunks
    shutil.copytree(tmp_path / "lean", tmp_path / "rows")
    from_chunks(tmp_path / "rows")
    whole = _whole(run)
    steps = len(run.stats_steps)
    monkeypatch.setattr(rule_runner, "WINDOW_STEPS", 3)
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 2 * steps)  # groups of two tensors, and streaming
    grouped = stepdump.check(run)
    assert CachedRun(run).streaming
    with stepdump.open(tmp_path / "rows") as rows:
        assert not rows.catalog.has_stat_chunks
        in_rows = stepdump.check(rows)
    assert grouped == whole
    assert in_rows == whole
    rule = PLANTED[planted][1]
    assert any(f.rule == rule for f in grouped), [f.rule for f in grouped]


def test_lean_check_decodes_each_chunk_once_per_group_not_per_tensor(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Read one tensor at a time, each walk over a kind's tensors (update_ratio twice,
    unchanged_tensor, weight_norm_growth over the params; dead_units over the grads) decoded every
    chunk once per tensor: 5 x 12 x chunks decodes here, ~2,500,000 for 100,000 steps of 500
    tensors. In groups (a walk reads twelve here, a one-tensor read six), at most once per group
    and walk, plus the windowed rules' reads."""
    path = synth_run(tmp_path / "run", 12, 200, spike=100, nan_step=150)  # chunks of 64 steps
    with stepdump.open(path) as run:
        whole = _whole(run)
        steps = len(run.stats_steps)
        chunks = run.catalog.connection.execute("SELECT count(*) FROM stat_chunks").fetchone()[0]
    assert chunks >= 4
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 6 * steps)  # groups of six tensors, and streaming
    # the reader keeps one decoded chunk, as a run's reader does once past its 16 MB of them
    monkeypatch.setattr(queries_stats, "CACHE_BYTES", 1)
    decodes = _decodes(monkeypatch)
    grouped = stepdump.check(path)
    assert grouped == whole
    assert {f.rule for f in grouped} >= {"nan_inf", "exploding_gradient"}
    # measured (6 chunks): 27 with one walk shared by the rules, 40 with a walk per rule, 304 one tensor at a time
    assert len(decodes) <= 2 * (5 * 2 * chunks), (len(decodes), chunks)


WALKING = ["update_ratio", "unchanged_tensor", "dead_units", "weight_norm_growth"]


def test_the_tensor_walks_share_one_pass_over_the_chunks_per_group(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The four rules that walk every tensor's history (update_ratio, unchanged_tensor,
    weight_norm_growth over the params; dead_units over the grads) each walked its own groups, a
    pass over the chunks per group and rule: 3 x 2 + 2 = 8 passes here (12 params and 12 grads in
    groups of six). They now share one walk whose groups span the kinds: at most 4 passes (3: a
    group holds eight tensors with only the five stat columns the walks read), with the findings
    of the whole frame and of each rule run alone."""
    path = synth_run(tmp_path / "run", 12, 200, spike=100, nan_step=150)  # chunks of 64 steps
    rules = resolve_rules(WALKING)
    with stepdump.open(path) as run:
        whole = run_rules(CachedRun(run, streaming=False), rules)
        steps = len(run.stats_steps)
        chunks = run.catalog.connection.execute("SELECT count(*) FROM stat_chunks").fetchone()[0]
    assert chunks >= 4
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 3 * steps)  # a walk's group: six tensors, and streaming
    monkeypatch.setattr(queries_stats, "CACHE_BYTES", 1)  # one decoded chunk kept, as past 16 MB of them
    with stepdump.open(path) as run:
        alone = sorted((f for rule in rules for f in rule(CachedRun(run))), key=sort_key)
        decodes = _decodes(monkeypatch)
        together = stepdump.check(run, rules=WALKING)
    assert together == whole
    assert alone == whole
    # + 2: each kind's tensors in the order the frame first shows them (its first chunk).
    # measured (6 chunks): 19 (3 passes + 1), 50 when each rule walked its own groups (8 passes + 2);
    # 7 since the walk reads windows of steps (one pass + 1)
    assert len(decodes) <= 4 * chunks + 2, (len(decodes), chunks)


def test_the_tensor_walks_decode_each_chunk_about_once_whatever_the_tensors(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared walk read its tensors in groups, a pass over every stat chunk per group: its
    decodes grew with the tensors (steps x tensors chunks' worth, so steps^2 x tensors work on a
    long run). It now reads the stats in windows of steps, one pass over the chunks whatever the
    tensors: the same decodes for 8 tensors and 32, about one per chunk, and the same findings."""
    rules = resolve_rules(WALKING)
    decoded, chunked = {}, {}
    for tensors in (8, 32):
        path = synth_run(tmp_path / f"r{tensors}", tensors, 200, spike=100)  # chunks of 64 steps
        with stepdump.open(path) as run:
            whole = run_rules(CachedRun(run, streaming=False), rules)
            steps = len(run.stats_steps)
            chunked[tensors] = run.catalog.connection.execute("SELECT count(*) FROM stat_chunks").fetchone()[0]
        with monkeypatch.context() as m:
            m.setattr(rule_runner, "STREAM_ROWS", 2 * steps)  # a group: about six tensors' histories
            m.setattr(queries_stats, "CACHE_BYTES", 1)  # one decoded chunk kept, as past 16 MB of them
            with stepdump.open(path) as run:
                assert CachedRun(run).streaming
                decodes = _decodes(m)
                found = stepdump.check(run, rules=WALKING)
        assert found == whole
        decoded[tensors] = len(decodes)
    # The two real steps synth_run records first make one chunk or two, as the writer's commit
    # windows fell (timing): the same decodes *per chunk*, not always the same chunks.
    assert min(chunked.values()) >= 4 and abs(chunked[8] - chunked[32]) <= 1, chunked
    # measured (6 chunks): 7 for both (one pass, and a first chunk for the tensors' order);
    # 25 and 79 when the walk read groups of tensors
    assert decoded[8] - chunked[8] == decoded[32] - chunked[32] <= 2, (decoded, chunked)


@pytest.mark.parametrize("planted", ["healthy", "dead_layer", "dead_activations", "unchanged", "frozen",
                                     "weight_growth", "tiny_updates", "lr_blow_up"])
def test_lean_walks_in_windows_of_three_steps_find_what_the_whole_frame_finds(
        tmp_path: Path, planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules that walk the tensors keep per-tensor state across the windows of a lean run (a
    stretch of dead steps, a weight's first norm, the norm a change at a window's last step needs):
    in windows of three steps (one, seven), the findings of whole histories, row for row."""
    import helpers
    import test_checks

    monkeypatch.setattr(test_checks, "record_run", lambda *a, **kw: helpers.record_run(
        *a, **kw, every=None, stats_every=1))
    run = _train(tmp_path / "lean", planted)
    assert run.catalog.has_stat_chunks
    whole = _whole(run)
    monkeypatch.setattr(rule_runner, "STREAM_ROWS", 0)  # windows of WINDOW_STEPS steps
    for steps in (3, 1, 7):
        monkeypatch.setattr(rule_runner, "WINDOW_STEPS", steps)
        windowed = stepdump.check(run)
        alone = sorted((f for rule in resolve_rules(WALKING) for f in rule(CachedRun(run))), key=sort_key)
        assert windowed == whole, steps
        assert alone == [f for f in whole if f.rule in WALKING], steps
