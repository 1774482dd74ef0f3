"""A long stats-only run written straight into the catalog: the rows a recording would write.

Recording 100,000 steps of a 500-tensor model step by step takes hours; the report's scale
benchmark (``report_scale.py``) and its browser tests need the *store*, not the training.
:func:`synth_run` records the first ``template`` steps for real (``stepdump.Recorder``, stats
only, params and grads of ``tensors`` small parameters named like a transformer's blocks), then
generates the remaining steps inside SQLite: one ``INSERT … SELECT`` over the template's series x
the steps (a cross join; every stat computed in SQL from a deterministic hash of step and tensor),
each row shaped like the template's last ordinary step (same series, dtype, shape, numel, no blob,
no state, the same scalar names). SQLite appends rows in the order of the ``tensors`` key
(series, step) and the ``tensors_by_step`` index is built once at the end (dropped and created
again with its own SQL text, so ``sqlite_master`` is the writer's), with no journal: about a
million rows a second instead of the catalog writer's 20,000 to 50,000. tests/test_synth_run.py
checks the result against a run recorded for real: same tables, columns, kinds, SQLite storage
class of every column (its NULL pattern) and the planted NaN's row.

The synthetic stats are plausible rather than regular (a regular matrix compresses far better than
a real one, which would flatter the page size): a gradient's scale cycles with period 7 per tensor
and carries +-20 % hash noise, its mean is a small hash-signed fraction of its std, min and max are
mean -+ 2.5 std, norm = sqrt(numel (std^2 + mean^2)); parameters keep the template's stats, drifting
by 1e-6 of their norm per step with 1e-5 noise. Steps are 0.05 s apart on the wall clock.

Planted, so a report can be checked for them: a gradient spike (``spike`` step, the first
tensor's grad max 1e4, its norm grown to match) and a NaN (``nan_step``: the second tensor's grad
counts one NaN element, its other stats those of the finite elements as a recording stores them,
and the logged loss is NaN, SQL NULL).
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import numpy as np
import torch
from torch import nn

import stepdump
from stepdump.core import stats_file
from stepdump.store.schema import catalog_path

KINDS = ("attn_w", "attn_b", "mlp_w", "mlp_b", "ln_w", "ln_b")
NUMEL = 16
STEP_S = 0.05  # wall-clock seconds between synthetic steps
SPIKE_MAX = 1e4


def tensor_names(tensors: int) -> list[str]:
    """``h_<block>_<kind>`` for ``tensors`` tensors, six to a block."""
    return [f"h_{i // len(KINDS)}_{KINDS[i % len(KINDS)]}" for i in range(tensors)]


def grad_value(step: int, j: int) -> float:
    """Every element of tensor ``j``'s gradient at ``step`` in the recorded template steps."""
    return 0.01 * (1 + (step + j) % 7)


def record_template(path: Path, tensors: int, steps: int, *, nan_step: int | None = None) -> None:
    """Record ``steps`` steps for real: SGD on ``tensors`` parameters of 16 elements, stats only.

    ``nan_step``: at that step the second tensor's gradient holds one NaN element (and the loss is
    NaN); the parameter it spoils is set finite again as part of the update (an optimizer post-hook
    that runs before the Recorder's), as synth_run assumes: an edit after the update would be one
    outside the optimizer, which the Recorder stores at the next step."""
    torch.manual_seed(0)
    model = nn.ParameterDict({n: nn.Parameter(torch.randn(NUMEL)) for n in tensor_names(tensors)})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    at = {"step": -1}

    def finite_again(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if at["step"] == nan_step:
            with torch.no_grad():
                for p in model.values():
                    p.nan_to_num_(0.0)

    opt.register_step_post_hook(finite_again)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1, capture=("params", "grads")) as rec:
        for s in range(steps):
            for j, name in enumerate(tensor_names(tensors)):  # j as synth_run numbers them (not the dict's order)
                p = model[name]
                p.grad = torch.full((NUMEL,), grad_value(s, j))
                if s == nan_step and j == 1 % tensors:
                    p.grad[3] = float("nan")
            at["step"] = s
            opt.step()
            rec.log(loss=float("nan") if s == nan_step else 1.0 / (1 + s))


# A hash of (step, tensor index) in [0, 1): integer arithmetic that stays inside int64 for any
# step below 2**40, so SQLite never turns it into a REAL.
_HASH = "((({s} * 1103515245 + {j} * 2654435 + 12345) % 1000003) / 1000003.0)"

# tpl: one row per series of the template's model step (sid, j, grad, dtype, shape, numel and the
# params' stats); st: the steps to write. Grads first, then params, each kind by series then step.
_GRADS = f"""
INSERT INTO tensors(series, step, dtype, shape, blob, numel, nan, posinf, neginf,
                    min, max, mean, std, norm, zero_frac, fingerprint)
SELECT sid, step, dtype, shape, NULL, numel, nan, 0, 0,
       mean - 2.5 * sd, CASE WHEN spiked THEN :spike_max ELSE mean + 2.5 * sd END, mean, sd,
       CASE WHEN spiked THEN sqrt(numel * (sd * sd + mean * mean) + :spike_max * :spike_max)
            ELSE sqrt(numel * (sd * sd + mean * mean)) END,
       0.0, random()
FROM (SELECT sid, step, dtype, shape, numel, sd, sd * 0.4 * (h - 0.5) AS mean,
             (step = :spike AND j = 0) AS spiked, (step = :nan_step AND j = :nan_j) AS nan
      FROM (SELECT sid, j, step, dtype, shape, numel, h,
                   0.01 * (1 + (step + j) % 7) * (0.8 + 0.4 * h) AS sd
            FROM (SELECT tpl.*, st.step, {_HASH.format(s="st.step", j="tpl.j")} AS h
                  FROM tpl CROSS JOIN st WHERE tpl.sid = :sid ORDER BY st.step)))
"""
_PARAMS = f"""
INSERT INTO tensors(series, step, dtype, shape, blob, numel, nan, posinf, neginf,
                    min, max, mean, std, norm, zero_frac, fingerprint)
SELECT sid, step, dtype, shape, NULL, numel, 0, 0, 0,
       mn * f, mx * f, mean * f, std * f, norm * f, 0.0, random()
FROM (SELECT tpl.*, st.step,
             1 - 1e-6 * (st.step - :first) + 1e-5 * {_HASH.format(s="st.step", j="tpl.j")} AS f
      FROM tpl CROSS JOIN st WHERE tpl.sid = :sid ORDER BY st.step)
"""


def _sqrt_function(con: sqlite3.Connection) -> None:
    """sqrt() for a SQLite built without its math functions (slower: a Python call per row)."""
    try:
        con.execute("SELECT sqrt(4.0)")
    except sqlite3.OperationalError:
        con.create_function("sqrt", 1, math.sqrt, deterministic=True)


def synth_run(path: str | Path, tensors: int, steps: int, *, spike: int | None = None,
              nan_step: int | None = None, template: int = 2, chunks: bool = True) -> Path:
    """Write a ``tensors`` x ``steps`` stats-only run at ``path`` (see the module docstring).

    Args:
        path: A directory that does not exist yet.
        tensors: Parameters of the model (their params and grads get stats rows: 2 x tensors series).
        steps: Optimizer steps in all (the first ``template`` recorded for real); as in a recording,
            step ``steps`` is the final one (params in full, no grads).
        spike: Step where the first tensor's gradient spikes to max 1e4 (None: no spike).
        nan_step: Step where the second tensor's gradient holds a NaN and the loss is NaN.
        template: Steps recorded for real (a planted step among them is recorded, not generated).
        chunks: Store the stats-only rows as a recording does (stat chunks, FORMAT.md); False
            leaves them as ``tensors`` rows, the layout of a store written before chunks.
    """
    path = Path(path)
    if steps <= template:
        raise ValueError(f"steps={steps} must exceed template={template}")
    record_template(path, tensors, template, nan_step=nan_step)
    with stepdump.open(path) as run:
        final = run.meta.get("final_step")
        if final != template or run.all_steps[-1] != template:
            raise RuntimeError(f"the template has steps {run.all_steps}, final_step {final}: not what synth_run copies")
    names = tensor_names(tensors)
    stats_file.remove(path)
    if chunks:
        _synth_chunks(path, names, steps, template, spike, nan_step)
        return path
    from_chunks(path)  # the generation below copies and writes tensors rows
    con = sqlite3.connect(catalog_path(path), isolation_level=None)
    try:
        _sqrt_function(con)
        mode = con.execute("PRAGMA journal_mode").fetchone()[0]
        # A scratch store: no journal and no fsync while it is built (a crash leaves garbage in a temp dir).
        con.execute("PRAGMA journal_mode=OFF")
        con.execute("PRAGMA synchronous=OFF")
        con.execute("PRAGMA cache_size=-262144")  # 256 MiB: the index build sorts in memory longer
        con.execute("PRAGMA temp_store=MEMORY")
        con.execute("PRAGMA threads=2")  # the index build's sorter
        con.execute("BEGIN")
        model = template - 1  # an ordinary step: the final one holds params in full, no grads
        for table in ("steps", "tensors", "scalars"):  # the final step ends the run
            con.execute(f"UPDATE {table} SET step = ? WHERE step = ?", (steps, template))  # noqa: S608 - fixed names
        (index_sql,) = con.execute("SELECT sql FROM sqlite_master WHERE name = 'tensors_by_step'").fetchone()
        con.execute("DROP INDEX tensors_by_step")
        con.execute("CREATE TEMP TABLE tpl(sid INTEGER PRIMARY KEY, j INTEGER, grad INTEGER, dtype TEXT, "
                    "shape TEXT, numel INTEGER, mn REAL, mx REAL, mean REAL, std REAL, norm REAL)")
        index = {n: j for j, n in enumerate(names)}
        rows = con.execute("SELECT t.series, s.name, s.kind = 'grads', t.dtype, t.shape, t.numel, t.min, t.max, "
                           "t.mean, t.std, t.norm FROM tensors t JOIN series s ON s.id = t.series "
                           "WHERE t.step = ? AND s.kind IN ('params', 'grads')", (model,)).fetchall()
        con.executemany("INSERT INTO tpl VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [(sid, index[n], *rest) for sid, n, *rest in rows])
        _step_table(con, template, steps)
        far = -1  # a step that is never written: no spike / no NaN
        args = {"spike": far if spike is None or spike < template else spike, "spike_max": SPIKE_MAX,
                "nan_step": far if nan_step is None or nan_step < template else nan_step,
                "nan_j": 1 % tensors, "first": template}
        # Every row again in key order into the emptied table: SQLite then only ever appends to the
        # tree's last page, which it leaves full (rows inserted between two existing keys split pages
        # half way: a larger file written several times slower).
        con.execute("CREATE TEMP TABLE old AS SELECT * FROM tensors")
        con.execute("CREATE INDEX temp.old_key ON old(series, step)")
        con.execute("DELETE FROM tensors")
        grads = dict(con.execute("SELECT sid, grad FROM tpl"))
        for (sid,) in con.execute("SELECT id FROM series ORDER BY id").fetchall():
            con.execute("INSERT INTO tensors SELECT * FROM old WHERE series = ? AND step < ? ORDER BY step", (sid, template))
            if sid in grads:
                gen = {k: args[k] for k in ("spike", "spike_max", "nan_step", "nan_j")} if grads[sid] else {"first": template}
                con.execute(_GRADS if grads[sid] else _PARAMS, {**gen, "sid": sid})
            con.execute("INSERT INTO tensors SELECT * FROM old WHERE series = ? AND step >= ? ORDER BY step", (sid, template))
        con.execute("DROP TABLE old")
        con.execute(index_sql)
        _steps_and_scalars(con, model, steps, args["nan_step"])
        con.execute("COMMIT")
        con.execute(f"PRAGMA journal_mode={mode}")
    finally:
        con.close()
    return path


def _steps_and_scalars(con: sqlite3.Connection, model: int, steps: int, nan_at: int) -> None:
    """The generated steps' ``steps`` and ``scalars`` rows (the steps in the temp table ``st``), the
    final step's time and ``meta`` moved to ``steps``, the template's stats.parquet record gone."""
    # steps: level and skipped of the model step, no state (a lean step has none), 0.05 s apart
    level, t0 = con.execute("SELECT level, time FROM steps WHERE step = ?", (model,)).fetchone()
    con.execute("INSERT INTO steps(step, level, skipped, time, state) SELECT step, ?, 0, ? + (step - ?) * ?, "
                "NULL FROM st", (level, t0, model, STEP_S))
    con.execute("UPDATE steps SET time = ? WHERE step = ?", (t0 + (steps - model) * STEP_S, steps))
    # scalars: the model step's, loss = 1 / (1 + step) (NULL, a logged NaN, at nan_step)
    con.execute("INSERT INTO scalars(step, name, value) SELECT st.step, c.name, CASE WHEN c.name != 'loss' "
                "THEN c.value WHEN st.step = ? THEN NULL ELSE 1.0 / (1 + st.step) END "
                "FROM (SELECT name, value FROM scalars WHERE step = ?) c CROSS JOIN st ORDER BY c.name, st.step",
                (nan_at, model))
    con.execute("UPDATE meta SET value = ? WHERE key = 'final_step'", (str(steps),))
    # The template's stats.parquet covers its steps only: gone, as a resumed recording drops it
    # (`stepdump export-stats` builds the file from the catalog).
    con.execute("UPDATE meta SET value = 'null' WHERE key = ?", (stats_file.META_KEY,))


def _step_table(con: sqlite3.Connection, first: int, steps: int) -> None:
    """The temp table ``st`` of the steps ``first .. steps - 1`` to generate."""
    con.execute("CREATE TEMP TABLE st(step INTEGER PRIMARY KEY)")
    con.execute("INSERT INTO st WITH RECURSIVE c(s) AS (SELECT ? UNION ALL SELECT s + 1 FROM c WHERE s + 1 < ?) "
                "SELECT s FROM c", (first, steps))


# Steps a generated stat chunk holds (a recording's commit window holds a few to a few hundred).
CHUNK_STEPS = 64


def _hash(step: np.ndarray, j: np.ndarray) -> np.ndarray:
    """_HASH in numpy: the same integer arithmetic (int64), the same division."""
    return ((step * 1103515245 + j * 2654435 + 12345) % 1000003) / 1000003.0


def _synth_chunks(path: Path, names: list[str], steps: int, template: int, spike: int | None,
                  nan_step: int | None) -> None:
    """synth_run's generated steps written as a recording writes them: the stats-only rows as stat
    chunks of CHUNK_STEPS steps (numpy columns, _GRADS' and _PARAMS' arithmetic), the steps and
    scalars rows by SQL as in the row layout, the final record moved to step ``steps``."""
    from stepdump.store import stat_chunk
    from stepdump.store.queries import CatalogReader

    model = template - 1
    reader = CatalogReader(path)
    try:
        a = reader.stat_arrays(None, None, model)
        info = {i: (k, n) for i, k, n in reader.matching_series(None, None)}
        if reader.fingerprint_block(template, template) and any(
                r.blob is None for r in reader.fingerprint_block(template, template)):
            raise RuntimeError("the template's final record has stats-only rows: not what synth_run moves")
    finally:
        reader.close()
    index = {n: j for j, n in enumerate(names)}
    keep = np.asarray([info[int(i)][0] in ("params", "grads") for i in a.series.tolist()], dtype=bool)
    a = a.take(keep)
    sid = a.series
    j = np.asarray([index[info[int(i)][1]] for i in sid.tolist()], dtype=np.int64)
    grad = np.asarray([info[int(i)][0] == "grads" for i in sid.tolist()], dtype=bool)
    numel = a.stats["numel"].astype(np.float64)
    far = -1
    spike_at = far if spike is None or spike < template else spike
    nan_at = far if nan_step is None or nan_step < template else nan_step
    rng = np.random.default_rng(0)
    con = sqlite3.connect(catalog_path(path), isolation_level=None)
    try:
        mode = con.execute("PRAGMA journal_mode").fetchone()[0]
        con.execute("PRAGMA journal_mode=OFF")  # a scratch store, as the row layout's generation
        con.execute("PRAGMA synchronous=OFF")
        con.execute("BEGIN")
        for table in ("steps", "tensors", "scalars"):  # the final step ends the run
            con.execute(f"UPDATE {table} SET step = ? WHERE step = ?", (steps, template))  # noqa: S608 - fixed names
        k = len(sid)
        for first in range(template, steps, CHUNK_STEPS):
            st = np.arange(first, min(first + CHUNK_STEPS, steps), dtype=np.int64)
            s_col, j_col = np.repeat(st, k), np.tile(j, len(st))
            g_col, n_col = np.tile(grad, len(st)), np.tile(numel, len(st))
            h = _hash(s_col, j_col)
            sd = 0.01 * (1 + (s_col + j_col) % 7) * (0.8 + 0.4 * h)
            mean_g = sd * 0.4 * (h - 0.5)
            spiked = (s_col == spike_at) & (j_col == 0)
            f = 1 - 1e-6 * (s_col - template) + 1e-5 * h
            tile = {c: np.tile(a.stats[c], len(st)) for c in ("min", "max", "mean", "std", "norm")}
            floats = np.stack([
                np.where(g_col, mean_g - 2.5 * sd, tile["min"] * f),
                np.where(g_col, np.where(spiked, SPIKE_MAX, mean_g + 2.5 * sd), tile["max"] * f),
                np.where(g_col, mean_g, tile["mean"] * f),
                np.where(g_col, sd, tile["std"] * f),
                np.where(g_col, np.where(spiked, np.sqrt(n_col * (sd * sd + mean_g * mean_g) + SPIKE_MAX * SPIKE_MAX),
                                         np.sqrt(n_col * (sd * sd + mean_g * mean_g))), tile["norm"] * f),
                np.zeros(len(s_col))])
            counts = np.zeros((4, len(s_col)), dtype=np.int64)
            counts[0] = np.tile(a.stats["numel"], len(st))
            counts[1] = g_col & (s_col == nan_at) & (j_col == 1 % len(names))
            rows = stat_chunk.StatArrays(
                np.tile(sid, len(st)), s_col, rng.integers(-(2**63), 2**63 - 1, len(s_col), dtype=np.int64),
                np.full(len(s_col), -1, np.int64), np.tile(a.dtype, len(st)), np.tile(a.shape, len(st)),
                {**dict(zip(stat_chunk.COUNT_STATS, counts, strict=True)),
                 **dict(zip(stat_chunk.FLOAT_STATS, floats, strict=True))})
            data = stat_chunk.encode_arrays(rows)
            con.execute("INSERT INTO stat_chunks(first_step, last_step, rows, checksum, data) VALUES (?, ?, ?, ?, ?)",
                        (int(st[0]), int(st[-1]), len(s_col), stat_chunk.checksum(data), data))
        _step_table(con, template, steps)
        _steps_and_scalars(con, model, steps, nan_at)
        con.execute("COMMIT")
        con.execute(f"PRAGMA journal_mode={mode}")
    finally:
        con.close()


def from_chunks(path: Path) -> None:
    """Every stat chunk's rows as ``tensors`` rows, the chunks gone (a store's layout before chunks)."""
    from stepdump.store import stat_chunk

    con = sqlite3.connect(catalog_path(path), isolation_level=None)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'stat_chunks'").fetchall():
            return
        con.execute("BEGIN")
        for cid, n, data in con.execute("SELECT id, rows, data FROM stat_chunks").fetchall():
            con.executemany(f"INSERT INTO tensors VALUES ({', '.join('?' * 16)})",
                            stat_chunk.tensor_rows(stat_chunk.decode(data, n, stat_chunk.STAT_COLUMNS, f"chunk {cid}")))
        con.execute("DELETE FROM stat_chunks")
        con.execute("COMMIT")
    finally:
        con.close()


def to_chunks(path: Path, window: int = 64) -> None:
    """The stats-only ``tensors`` rows into stat chunks of ``window`` steps each, as the writer
    commits them (a recording's commit window holds a few to a few hundred steps)."""
    from stepdump.store.catalog import CatalogWriter

    cat = CatalogWriter(path)
    try:
        lo, hi = cat.con.execute("SELECT min(step), max(step) FROM tensors WHERE blob IS NULL").fetchone()
        if lo is None:
            return
        for first in range(lo, hi + 1, window):
            rows = cat.con.execute("SELECT * FROM tensors WHERE blob IS NULL AND step >= ? AND step < ? "
                                   "ORDER BY step, series", (first, first + window)).fetchall()
            if rows:
                cat.add_stat_chunk(rows)
        cat.con.execute("DELETE FROM tensors WHERE blob IS NULL")
        cat.commit()
    finally:
        cat.close()
    con = sqlite3.connect(catalog_path(path), isolation_level=None)
    try:
        con.execute("VACUUM")  # the emptied pages go: the file a recording would have written
    finally:
        con.close()
