"""Recorder(fingerprint="auto" | "xxh3" | "dmix64"): every row under its series' kind (FORMAT.md,
"Fingerprint kinds"; docs/cuda.md).

Each recording mode (lean, full every step, every=2 with stats between, gradient log, ring) is
recorded under xxh3 and dmix64 and held to a hand snapshot of the tensors at each pre-step
moment: every row's fingerprint is the snapshot tensor's under the row's kind, by definitions
apart from the library (xxh3-64 of the raw bytes; dmix64 in plain Python integers,
tests/dmix_reference.py); every stored blob's bytes give the row's value again; verify passes
and catches a changed blob. "auto" on the CPU is exactly xxh3 (format 1, no fp_kinds table).
A tensor that moves between the CPU and a GPU keeps its first kind (the writer driven as the
CUDA path drives it), and a resumed run keeps its kinds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from dmix_reference import reference_dmix64
from helpers import assert_run_matches, catalog_format_version, catalog_sql, catalog_tables, record_run, snapshot

import stepdump
from stepdump.core.hashing import raw_bytes, signed64


# -- the recorder: Recorder(fingerprint=) and every row under its series' kind ------------------
def _fire_at_3(info: object) -> bool:
    return getattr(info, "step", None) == 3


MODES: dict[str, dict[str, object]] = {
    "lean": {"every": None, "stats_every": 1},
    "full every step": {"every": 1},
    "every=2 mix": {"every": 2, "stats_every": 1},
    "gradient log": {"gradient_log": 2},
    "ring": {"ring": 2, "trigger": _fire_at_3, "after": 1},
}
STEPS = 6


def _train(path: Path, option: str | None, mode: str) -> tuple[Path, list[dict[str, dict[str, torch.Tensor]]]]:
    """The tiny model (Adam + StepLR) recorded under ``mode``, with a hand snapshot of params,
    grads and optimizer state at each pre-step moment (what record t must describe)."""
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    kwargs = dict(MODES[mode])
    if option is not None:
        kwargs["fingerprint"] = option
    record_run(path, steps=STEPS, before_step=lambda t, m, o: snaps.append(snapshot(m, o)), on_error="raise",
               **kwargs)
    return path, snaps


def _as(kind: str, t: torch.Tensor) -> int:
    """``t``'s fingerprint under ``kind``, by definitions independent of the library's code paths:
    xxh3-64 of the raw bytes, or dmix64 in plain Python integers (tests/dmix_reference.py)."""
    data = bytes(raw_bytes(t))
    return signed64(xxhash.xxh3_64_intdigest(data)) if kind == "xxh3" else reference_dmix64(data)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("option", ["xxh3", "dmix64"])
def test_every_row_has_its_kind_and_describes_the_recorded_bytes(tmp_path: Path, option: str, mode: str) -> None:
    path, snaps = _train(tmp_path / "run", option, mode)
    chunks = mode != "full every step"  # every other mode has stats-only rows: stat chunks, format 3
    assert ("stat_chunks" in catalog_tables(path)) == chunks
    assert catalog_format_version(path) == (3 if chunks else 2 if option == "dmix64" else 1)
    assert ("fp_kinds" in catalog_tables(path)) == (option == "dmix64" or chunks)
    with stepdump.open(path) as run:
        assert run.stats_steps, "the control: rows were written"
        for step in run.stats_steps:
            kinds = run.fingerprint_kinds(step)
            assert kinds and set(kinds.values()) == {option}, (step, kinds)
            assert set(kinds) == set(run.fingerprints(step))
        stats = run.stats()
        assert list(stats.columns).index("fp_kind") == list(stats.columns).index("fingerprint") + 1
        assert set(stats["fp_kind"]) == {option}
        # Every row of a step the snapshot saw (record t: before update t) is the fingerprint of the
        # snapshot's tensor under the row's kind, stats-only rows included.
        checked = 0
        for step in run.stats_steps:
            if step >= len(snaps):
                continue  # the final record: after the last update, no snapshot
            for (kind, name), fp in run.fingerprints(step, ["params", "grads", "optimizer"]).items():
                want = snaps[step][kind].get(name)
                assert want is not None, (step, kind, name)
                assert fp == _as(option, want), (step, kind, name)
                checked += 1
        assert checked >= STEPS * 4, checked  # the control: rows of every kind were compared
        # Every stored blob's bytes, fingerprinted again under the row's kind, give the row's value.
        stored = 0
        for step in run.steps:
            fps = run.fingerprints(step)
            for kind in ("params", "grads", "optimizer"):
                for name in run.stored_names(step, kind):
                    assert _as(option, run.tensor(name, step, kind)) == fps[(kind, name)], (step, kind, name)
                    stored += 1
        assert stored > 0, "the control: some bytes were stored"
        # Every step that can be read in full (a gradient log: rebuilt) reads back the snapshot.
        full = [t for t in run.steps if t < len(snaps)]
        assert full or mode == "lean", "the control: steps to read"  # lean: only the final record is full
        for step in full:
            assert_run_matches(run, step, snaps[step], kinds=[k for k in ("params", "grads", "optimizer")
                                                              if run.stored_names(step, k)])
            run.optimizer_state_dict(step)  # reads (and checks) every optimizer tensor under its kind
            run.state_dict(step)
        report = stepdump.verify(run)
        assert report.ok, report.problems
        assert report.blobs_checked > 0
        if mode == "gradient log":  # its updates re-applied against the rows, under their kind
            assert report.segments_checked > 0 and not report.unchecked, report


@pytest.mark.parametrize("mode", list(MODES))
def test_auto_on_the_cpu_is_exactly_xxh3(tmp_path: Path, mode: str) -> None:
    """fingerprint="auto" (the default) records a CPU run exactly as fingerprint="xxh3" does: the
    same format (1 for full steps only, 3 with stat chunks), no fingerprint of another kind (no
    fp_kinds row), and the same fingerprints at every step."""
    auto, _ = _train(tmp_path / "auto", None, mode)
    xxh3, _ = _train(tmp_path / "xxh3", "xxh3", mode)
    assert catalog_format_version(auto) == catalog_format_version(xxh3) == (1 if mode == "full every step" else 3)
    assert "fp_kinds" not in catalog_tables(auto) or catalog_sql(auto, "SELECT count(*) FROM fp_kinds") == [(0,)]
    rows = "SELECT step, series, fingerprint, blob IS NOT NULL FROM tensors ORDER BY step, series"
    assert catalog_sql(auto, rows) == catalog_sql(xxh3, rows)
    assert catalog_sql(auto, "SELECT id, kind, name FROM series") == catalog_sql(xxh3, "SELECT id, kind, name FROM series")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dmix64_run_is_caught_when_its_bytes_change(tmp_path: Path, mode: str) -> None:
    """verify checks a blob against its row under the row's kind: a stored blob whose bytes were
    changed (checksum fixed up) fails, so the dmix64 comparison is one that can fail."""
    path, _ = _train(tmp_path / "run", "dmix64", mode)
    blob, = catalog_sql(path, "SELECT t.blob FROM tensors t JOIN series s ON s.id = t.series WHERE s.kind = 'params' "
                              "AND t.blob IS NOT NULL AND t.step = (SELECT min(step) FROM steps WHERE level = 2) "
                              "ORDER BY s.id LIMIT 1")[0:1]
    seg, offset, length, codec = catalog_sql(path, "SELECT sg.key, b.offset, b.length, b.codec FROM blobs b "
                                                   "JOIN segments sg ON sg.id = b.segment WHERE b.id = ?", (blob[0],))[0]
    assert codec == "raw"
    f = path / seg
    data = bytearray(f.read_bytes())
    data[offset] ^= 1
    f.write_bytes(bytes(data))
    catalog_sql(path, "UPDATE blobs SET checksum = ? WHERE id = ?",
                (signed64(xxhash.xxh3_64_intdigest(bytes(data[offset:offset + length]))), blob[0]))
    with stepdump.open(path) as run:
        report = stepdump.verify(run)
    assert not report.ok
    assert any("fingerprint (dmix64)" in p.detail for p in report.problems), report.problems


BAD_OPTIONS = ["sha256", "XXH3", "", None, 1]


@pytest.mark.parametrize("value", BAD_OPTIONS, ids=repr)
def test_a_bad_fingerprint_option_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(stepdump.ConfigError, match="'auto'.*'xxh3'.*'dmix64'"):
        record_run(tmp_path / "run", steps=1, fingerprint=value)
    assert not (tmp_path / "run" / "catalog.sqlite").exists()


# -- a tensor that moves between devices keeps its series' first kind (the writer, as the CUDA
# -- path drives it: items with a device fingerprint, lean rows of a kind) ---------------------
def _writer_run(path: Path, messages: list[object], fingerprint: str = "auto") -> None:
    from stepdump.capture.staging import StagingPool
    from stepdump.capture.writer import Writer
    from stepdump.store.catalog import create
    from stepdump.store.storage import LocalStorage

    path.mkdir()
    create(path, {})
    w = Writer(path, StagingPool(1), "raw", "flush", 1 << 20, 4, storage=LocalStorage(path), fingerprint=fingerprint)
    w.start()
    w.wait_ready()
    for m in messages:
        w.queue.put(m)  # type: ignore[arg-type]
    w.queue.put(None)
    w.join()
    assert w.error is None, w.error


def _item(t: torch.Tensor, full: bool, device_fp: bool) -> object:
    from stepdump.capture.staging import Item

    if not device_fp:
        return Item("params", "w", t, full)
    # As the CUDA path sends it: dmix64 computed on the device, beside the host copy.
    return Item("params", "w", t, full, device_fp=torch.tensor(reference_dmix64(bytes(raw_bytes(t)))),
                fp_kind="dmix64")


def _row(t: torch.Tensor, kind: str | None) -> object:
    from stepdump.capture.packed import LeanRow
    from stepdump.core.stats import compute_stats
    from stepdump.store.format import format_shape

    fp = reference_dmix64(bytes(raw_bytes(t))) if kind == "dmix64" else _as("xxh3", t)
    return LeanRow("params", "w", None, None, "float32", format_shape(t.shape), compute_stats(t), fp, kind)


T0, T1, T2 = (torch.arange(5, dtype=torch.float32) * (i + 1) for i in range(3))
# (what steps 0, 1, 2 send, the series' kind, the steps that must have a row)
MOVES = {
    "cpu full, then device full": ([_item(T0, True, False), _item(T1, True, True), _item(T2, False, True)],
                                   "xxh3", [0, 1, 2]),
    "device full, then cpu full": ([_item(T0, True, True), _item(T1, True, False), _item(T2, False, False)],
                                   "dmix64", [0, 1, 2]),
    "cpu full, then a device stats row": ([_item(T0, True, False), _row(T1, "dmix64"), _item(T2, True, True)],
                                          "xxh3", [0, 2]),
    "device stats row, then a cpu one": ([_row(T0, "dmix64"), _row(T1, None), _item(T2, True, False)],
                                         "dmix64", [0, 2]),
}


@pytest.mark.parametrize("case", list(MOVES))
def test_a_tensor_that_moves_keeps_its_first_kind(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    from stepdump.capture.packed import LeanRow
    from stepdump.capture.writer import StepMessage

    sent, kind, kept = MOVES[case]
    tensors = [T0, T1, T2]
    msgs = []
    for step, what in enumerate(sent):
        full = not isinstance(what, LeanRow) and what.full  # type: ignore[attr-defined]
        msgs.append(StepMessage(step, 2 if full else 1, items=[] if isinstance(what, LeanRow) else [what],
                                lean=[what] if isinstance(what, LeanRow) else []))
    with caplog.at_level("WARNING", logger="stepdump"):
        _writer_run(tmp_path / "run", msgs)
    with stepdump.open(tmp_path / "run") as run:
        got = [s for s in run.stats_steps if ("params", "w") in run.fingerprints(s)]
        assert got == kept
        for step in kept:
            assert run.fingerprint_kinds(step) == {("params", "w"): kind}
            assert run.fingerprints(step)[("params", "w")] == _as(kind, tensors[step]), step
        assert stepdump.verify(run).ok
    dropped = [r for r in caplog.records if "fingerprints in this run" in r.getMessage()]
    assert len(dropped) == (3 - len(kept)), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("device_fp", [False, True])
def test_the_dmix64_option_gives_every_new_series_dmix64(tmp_path: Path, device_fp: bool) -> None:
    from stepdump.capture.writer import StepMessage

    _writer_run(tmp_path / "run", [StepMessage(0, 2, items=[_item(T0, True, device_fp)])], fingerprint="dmix64")
    assert catalog_format_version(tmp_path / "run") == 2
    with stepdump.open(tmp_path / "run") as run:
        assert run.fingerprint_kinds(0) == {("params", "w"): "dmix64"}
        assert run.fingerprints(0)[("params", "w")] == reference_dmix64(bytes(raw_bytes(T0)))


# -- resuming: the run's kinds decide -------------------------------------------------------------
RESUMES = [
    ("dmix64", "auto", "dmix64"),  # auto goes on with the run's kind: the lean rows stay dmix64
    ("dmix64", "dmix64", "dmix64"),
    ("xxh3", "auto", "xxh3"),
    ("xxh3", "xxh3", "xxh3"),
    ("dmix64", "xxh3", "refused"),
    ("xxh3", "dmix64", "refused"),
]


@pytest.mark.parametrize(("first", "then", "want"), RESUMES, ids=[f"{a}-then-{b}" for a, b, _ in RESUMES])
def test_resuming_keeps_the_kinds(tmp_path: Path, first: str, then: str, want: str,
                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "run"
    lean = {"every": None, "stats_every": 1, "on_error": "raise"}
    record_run(path, steps=3, fingerprint=first, **lean)
    before = catalog_sql(path, "SELECT step, series, fingerprint FROM tensors ORDER BY step, series")
    if want == "refused":
        with pytest.raises(stepdump.ConfigError, match=f"fingerprint='{first}'"):
            record_run(path, steps=3, start=3, fingerprint=then, **lean)
        assert catalog_sql(path, "SELECT step, series, fingerprint FROM tensors ORDER BY step, series") == before
        return
    with caplog.at_level("WARNING", logger="stepdump"):
        record_run(path, steps=3, start=3, fingerprint=then, **lean)
    assert not [r for r in caplog.records if "fingerprints in this run" in r.getMessage()]
    with stepdump.open(path) as run:
        assert run.stats_steps == list(range(7))
        n = len(run.fingerprints(1))
        for step in range(6):  # every lean step has every tensor's row, of the run's kind
            assert len(run.fingerprints(step)) == n and set(run.fingerprint_kinds(step).values()) == {want}, step
        assert stepdump.verify(run).ok
    assert catalog_format_version(path) == 3  # lean: its rows are in stat chunks


# -- other layouts and dtypes: a sparse grad (its header, indices and values), bf16 ---------------
def _sparse() -> tuple[torch.nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True))
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda t: torch.tensor([t, t + 1, 3]), \
        lambda t, mm, x: mm(x).sum()


def _bf16() -> tuple[torch.nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), lambda t: torch.randn(3, 8).to(torch.bfloat16), \
        lambda t, mm, x: mm(x).float().square().mean()


LAYOUTS = {"sparse grads": _sparse, "bf16": _bf16}


@pytest.mark.parametrize("mode", ["lean", "full every step"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", ["xxh3", "dmix64"])
def test_other_layouts_under_each_kind(tmp_path: Path, option: str, layout: str, mode: str) -> None:
    model, opt, batch, loss = LAYOUTS[layout]()
    snaps: list[dict[str, dict[str, torch.Tensor]]] = []
    record_run(tmp_path / "run", steps=3, model=model, opt=opt, batch=batch, loss_fn=loss,
               before_step=lambda t, m, o: snaps.append(snapshot(m, o)), fingerprint=option, on_error="raise",
               **MODES[mode])
    with stepdump.open(tmp_path / "run") as run:
        checked = 0
        for step in range(3):
            fps = run.fingerprints(step, ["params", "grads", "optimizer"])
            assert set(run.fingerprint_kinds(step).values()) == {option}
            for (kind, name), fp in fps.items():
                assert fp == _as(option, snaps[step][kind][name]), (step, kind, name)
                checked += 1
        assert checked >= 6
        if layout == "sparse grads":  # the control: the grad is recorded sparse
            assert run.stats(kind="grads")["dtype"].iloc[0].startswith("sparse_coo:")
        assert stepdump.verify(run).ok
