"""Fingerprint kinds in the store (FORMAT.md, "Fingerprint kinds"; docs/cuda.md).

A series whose fingerprints are not xxh3 is named in the ``fp_kinds`` table, which only a
format-2 store has: the writer creates it, and makes the store format 2, in the transaction of
its first row. A store with xxh3 series only (every CPU run under ``fingerprint="auto"``) stays
format 1, byte for byte the schema it had. The reader accepts formats 1 and 2, the table only in
format 2, and refuses a newer format by its version.

The recorder's side (``Recorder(fingerprint=)``, every row's fingerprint under its series' kind,
re-fingerprinted from the stored bytes) is tests/test_fp_kinds_recorder.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import catalog_format_version, catalog_sql, catalog_tables, record_run

import stepdump
from stepdump.store.catalog import CatalogWriter
from stepdump.store.queries import CatalogReader

GOLDEN = Path(__file__).parent / "golden" / "v1_run"


def _series(run: Path) -> dict[tuple[str, str], int]:
    return {(k, n): i for i, k, n in catalog_sql(run, "SELECT id, kind, name FROM series")}


@pytest.fixture(scope="module")
def xxh3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(tmp_path_factory.mktemp("fpk") / "run", steps=3)


def _copy(src: Path, dest: Path) -> Path:
    """A self-contained copy of a run (catalog through SQLite's backup, segments as files)."""
    import shutil

    shutil.copytree(src, dest)
    return dest


def _mark(run: Path, kinds: dict[tuple[str, str], str]) -> None:
    """Give series of ``run`` fingerprint kinds through the writer's own API, and commit."""
    w = CatalogWriter(run)
    ids = _series(run)
    for key, kind in kinds.items():
        w.set_fp_kind(ids[key], kind)
    w.close()


# -- the writer: format 1 until a series is not xxh3 ---------------------------------------------
def test_a_cpu_run_under_auto_stays_format_1_without_the_table(xxh3_run: Path) -> None:
    """fingerprint="auto" (the default) on the CPU writes today's store: no fp_kinds table, format 1."""
    assert "fp_kinds" not in catalog_tables(xxh3_run)
    assert catalog_format_version(xxh3_run) == 1
    with stepdump.open(xxh3_run) as run:
        assert run.format_version == 1
    reader = CatalogReader(xxh3_run)
    try:
        assert reader.fp_kinds() == {} and reader.fp_kinds_by_name() == {}
    finally:
        reader.close()


MARKS = [
    ("xxh3 only", {("params", "0.weight"): "xxh3"}, 1, {}),
    ("one dmix64", {("params", "0.weight"): "dmix64"}, 2, {("params", "0.weight"): "dmix64"}),
    ("two dmix64 + one xxh3", {("params", "0.weight"): "dmix64", ("grads", "2.bias"): "dmix64",
                               ("params", "2.bias"): "xxh3"}, 2,
     {("params", "0.weight"): "dmix64", ("grads", "2.bias"): "dmix64"}),
]


@pytest.mark.parametrize(("what", "kinds", "version", "stored"), MARKS, ids=[m[0] for m in MARKS])
def test_set_fp_kind_makes_format_2_with_the_first_other_kind(
        xxh3_run: Path, tmp_path: Path, what: str, kinds: dict[tuple[str, str], str], version: int,
        stored: dict[tuple[str, str], str]) -> None:
    run = _copy(xxh3_run, tmp_path / "run")
    _mark(run, kinds)
    assert catalog_format_version(run) == version, what
    assert ("fp_kinds" in catalog_tables(run)) == (version == 2), what
    ids = _series(run)
    assert dict(catalog_sql(run, "SELECT series, kind FROM fp_kinds") if version == 2 else []) == {
        ids[k]: v for k, v in stored.items()}
    reader = CatalogReader(run)
    try:
        assert reader.fp_kinds() == {ids[k]: v for k, v in stored.items()}
        assert reader.fp_kinds_by_name() == stored
    finally:
        reader.close()
    with stepdump.open(run) as r:  # the whole reader opens it, whatever the format
        assert r.format_version == version and r.steps == [0, 1, 2, 3]


def test_a_series_keeps_one_kind(xxh3_run: Path, tmp_path: Path) -> None:
    run = _copy(xxh3_run, tmp_path / "run")
    _mark(run, {("params", "0.weight"): "dmix64"})
    w = CatalogWriter(run)
    sid = _series(run)[("params", "0.weight")]
    try:
        w.set_fp_kind(sid, "dmix64")  # the same kind again: nothing to do
        with pytest.raises(stepdump.StepdumpError, match="keeps one kind"):
            w.set_fp_kind(sid, "xxh3")
    finally:
        w.close()


def test_a_rolled_back_first_kind_leaves_format_1(xxh3_run: Path, tmp_path: Path) -> None:
    """The table, its row and format 2 are one transaction: a rollback takes all three back."""
    run = _copy(xxh3_run, tmp_path / "run")
    w = CatalogWriter(run)
    sid = _series(run)[("params", "0.weight")]
    w.set_fp_kind(sid, "dmix64")
    w.rollback()
    assert w.fp_kind(sid) == "xxh3"
    w.close()
    assert catalog_format_version(run) == 1 and "fp_kinds" not in catalog_tables(run)


def test_dropped_series_take_their_kind_with_them(tmp_path: Path) -> None:
    """A resume that drops every step of a series drops its fp_kinds row: an id SQLite hands out
    again must not inherit it."""
    from stepdump.store.catalog import resume

    run = record_run(tmp_path / "run", steps=3)
    catalog_sql(run, "DELETE FROM tensors WHERE step >= 2")
    catalog_sql(run, "INSERT INTO series(kind, name) VALUES ('params', 'late')")
    late = _series(run)[("params", "late")]
    catalog_sql(run, "INSERT INTO tensors SELECT ?, 2, dtype, shape, NULL, numel, nan, posinf, neginf, min, max, "
                     "mean, std, norm, zero_frac, fingerprint FROM tensors WHERE step = 0 LIMIT 1", (late,))
    _mark(run, {("params", "late"): "dmix64", ("params", "0.weight"): "dmix64"})
    resume(run, 2, [])
    ids = _series(run)
    assert ("params", "late") not in ids
    assert dict(catalog_sql(run, "SELECT series, kind FROM fp_kinds")) == {ids[("params", "0.weight")]: "dmix64"}
    assert catalog_format_version(run) == 2  # the format never goes back down


# -- the reader: formats 1 and 2, the table only in 2, newer refused by version -----------------
OPEN_ROWS = [
    (1, False, None),
    (2, True, None),
    (1, True, "fp_kinds"),  # a table a format-1 store cannot have
    (2, False, "no 'fp_kinds' table"),
    (3, True, "no 'stat_chunks' table"),  # format 3 has both tables
    (3, False, "no 'fp_kinds' table"),
    (4, True, "newer"),
    (4, False, "newer"),
    (0, False, "older"),
]


@pytest.mark.parametrize(("version", "table", "refused"), OPEN_ROWS, ids=[f"v{v}-{'table' if t else 'none'}"
                                                                           for v, t, _ in OPEN_ROWS])
def test_which_stores_open(xxh3_run: Path, tmp_path: Path, version: int, table: bool, refused: str | None) -> None:
    run = _copy(xxh3_run, tmp_path / "run")
    if table:
        catalog_sql(run, "CREATE TABLE fp_kinds(series INTEGER PRIMARY KEY REFERENCES series(id), kind TEXT NOT NULL)")
    catalog_sql(run, "UPDATE meta SET value = ? WHERE key = 'format_version'", (json.dumps(version),))
    if refused is None:
        with stepdump.open(run) as r:
            assert r.format_version == version and r.steps == [0, 1, 2, 3]
        return
    error = stepdump.FormatVersionError if refused in ("newer", "older") else stepdump.CorruptDataError
    with pytest.raises(error, match=refused) as ei:
        stepdump.open(run)
    if refused == "newer":
        assert str(version) in str(ei.value) and "Install a stepdump release" in str(ei.value)


def test_a_newer_store_with_tables_this_stepdump_does_not_know_is_refused_by_its_version(
        xxh3_run: Path, tmp_path: Path) -> None:
    """The version is read (from the checked meta table) before the rest of the schema is checked:
    a format-4 store with a table of its own says "newer", not "not a stepdump catalog"."""
    run = _copy(xxh3_run, tmp_path / "run")
    catalog_sql(run, "CREATE TABLE future(x INTEGER)")
    catalog_sql(run, "UPDATE meta SET value = '4' WHERE key = 'format_version'")
    with pytest.raises(stepdump.FormatVersionError, match="newer"):
        stepdump.open(run)
    catalog_sql(run, "UPDATE meta SET value = '2' WHERE key = 'format_version'")  # the control
    with pytest.raises(stepdump.CorruptDataError, match="future"):
        stepdump.open(run)


BAD_KINDS = [("an unknown kind", "'sha256'"), ("a number", "7"), ("the name as a blob", "X'646d69783634'"),
             ("a trailing space", "'dmix64 '")]


@pytest.mark.parametrize(("what", "kind"), BAD_KINDS, ids=[b[0] for b in BAD_KINDS])
def test_a_damaged_fp_kinds_row_is_refused(xxh3_run: Path, tmp_path: Path, what: str, kind: str) -> None:
    run = _copy(xxh3_run, tmp_path / "run")
    _mark(run, {("params", "2.bias"): "dmix64"})
    reader = CatalogReader(run)
    try:
        assert reader.fp_kinds() == {_series(run)[("params", "2.bias")]: "dmix64"}  # the control
    finally:
        reader.close()
    catalog_sql(run, f"INSERT INTO fp_kinds(series, kind) VALUES (9999, {kind})")
    reader = CatalogReader(run)
    try:
        with pytest.raises(stepdump.CorruptDataError, match="fp_kinds"):
            reader.fp_kinds()
    finally:
        reader.close()


def test_the_golden_format_1_store_still_reads(tmp_path: Path) -> None:
    golden = _copy(GOLDEN, tmp_path / "v1_run")  # a copy: opening the committed one would leave side files
    with stepdump.open(golden) as run:
        assert run.format_version == 1 and run.steps
    reader = CatalogReader(golden)
    try:
        assert reader.fp_kinds() == {}
    finally:
        reader.close()


# -- what readers show of the kinds --------------------------------------------------------------
@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fpk-readers")
    return {o: record_run(base / o, steps=3, every=2, stats_every=1, fingerprint=o) for o in ("xxh3", "dmix64")}


@pytest.mark.parametrize("option", ["xxh3", "dmix64"])
def test_stats_frames_have_an_fp_kind_column(both: dict[str, Path], option: str) -> None:
    with stepdump.open(both[option]) as run:
        for df in (run.stats(), run.stats(kind="grads", name="0.weight"), run.stats(dtype_backend="pyarrow")):
            cols = list(df.columns)
            assert cols.index("fp_kind") == cols.index("fingerprint") + 1, cols
            assert len(df) > 0 and set(df["fp_kind"].astype(str)) == {option}


@pytest.mark.parametrize("option", ["xxh3", "dmix64"])
def test_fingerprint_kinds_follows_fingerprints(both: dict[str, Path], option: str) -> None:
    with stepdump.open(both[option]) as run:
        for step in run.stats_steps:
            for kinds in (None, ["grads"], ["params", "optimizer"]):
                fk = run.fingerprint_kinds(step, kinds)
                assert set(fk) == set(run.fingerprints(step, kinds))
                assert set(fk.values()) <= {option} and (fk or kinds == ["grads"])  # the final record: no grads


@pytest.mark.parametrize("option", ["xxh3", "dmix64"])
def test_info_says_the_kinds_of_a_run_with_dmix64(cli: object, both: dict[str, Path], option: str) -> None:
    out = cli("info", both[option], "--json").stdout  # type: ignore[operator]
    data = json.loads(out)
    n = len(catalog_sql(both[option], "SELECT id FROM series"))
    if option == "dmix64":
        assert data["fingerprint_kinds"] == {"dmix64": n}
        assert f"dmix64 for {n} tensors" in cli("info", both[option]).stdout  # type: ignore[operator]
    else:
        assert "fingerprint_kinds" not in data  # a format-1 run's summary is as before
    assert data["format_version"] == 3  # every=2 with stats between: its stats-only rows are in stat chunks


def test_a_joint_run_forwards_fingerprint_kinds(tmp_path: Path) -> None:
    from helpers import tiny_batch, tiny_model

    models = {"G": tiny_model(0), "D": tiny_model(1)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    with stepdump.Recorder(tmp_path / "run", models=models, optimizers=opts, fingerprint="dmix64", on_error="raise"):
        for t in range(2):
            x, y = tiny_batch(t)
            for k in models:
                opts[k].zero_grad()
                torch.nn.functional.mse_loss(models[k](x), y).backward()
                opts[k].step()
    with stepdump.open(tmp_path / "run") as run:
        fk = run.fingerprint_kinds(0)
        assert set(fk) == set(run.fingerprints(0)) and {n.split("/")[0] for _, n in fk} == {"G", "D"}
        assert set(fk.values()) == {"dmix64"}
