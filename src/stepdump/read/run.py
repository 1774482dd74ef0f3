"""``Run``: read access to a recorded run, also while it is still being written."""

from __future__ import annotations

import fnmatch
import operator
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from stepdump.core import tjson
from stepdump.errors import (
    ConfigError,
    CorruptDataError,
    StepdumpError,
    StepNotFoundError,
    TensorNotFoundError,
    close_names,
    nearest_steps,
)
from stepdump.read.blobs import BlobReader
from stepdump.read.state import check_meta
from stepdump.store import catalog
from stepdump.store.catalog import STAT_COLUMNS
from stepdump.store.format import ALL_KINDS, LEVEL_FULL
from stepdump.store.lock import is_locked

if TYPE_CHECKING:
    from stepdump.read.ranked import DistributedRun

StepRange = int | range | slice | Iterable[int] | None


class Run:
    """A recorded run. Every query sees all steps committed so far.

    Open with :func:`stepdump.open`. Tensors are read lazily, one blob at a
    time, and checked against their checksum.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._con = catalog.connect_reader(self.path)
        try:
            self.meta: dict[str, Any] = catalog.read_meta(self._con)
            check_meta(self.meta, self.path)
        except BaseException:
            self._con.close()
            raise
        self.format_version: int = int(self.meta["format_version"])
        self._blobs = BlobReader(self.path, self._con)
        self._replayed: dict[int, Any] = {}  # step -> ReplayResult, filled by stepdump.replay
        self._series_checked = False  # see _check_series

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        self._blobs.close()
        self._con.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<stepdump.Run {str(self.path)!r}: {len(self.all_steps)} steps>"

    @property
    def live(self) -> bool:
        """True while a Recorder still holds this run open for writing."""
        return is_locked(self.path)

    # -- steps and names -----------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Steps whose tensors are stored in full (what :meth:`tensor` can read)."""
        return self._ints("SELECT step FROM steps WHERE level >= ? ORDER BY step", (LEVEL_FULL,))

    @property
    def stats_steps(self) -> list[int]:
        """Steps with stats and fingerprints (a superset of :attr:`steps`)."""
        return self._ints("SELECT step FROM steps WHERE level >= 1 ORDER BY step", ())

    @property
    def all_steps(self) -> list[int]:
        """Every optimizer step the recorder saw, recorded in full or not."""
        return self._ints("SELECT step FROM steps ORDER BY step", ())

    @property
    def skipped_steps(self) -> list[int]:
        """Steps the GradScaler skipped (inf/NaN gradients, no update)."""
        return self._ints("SELECT step FROM steps WHERE skipped = 1 ORDER BY step", ())

    def blob_bytes(self) -> tuple[int, int]:
        """(stored, raw): bytes of tensor data in the segments, and what they decode to.

        Their ratio is what the run's codec saved (1.0 for ``raw``)."""
        stored, raw = self._con.execute("SELECT total(length), total(raw_length) FROM blobs").fetchone()
        try:
            return int(stored), int(raw)
        except (TypeError, ValueError, OverflowError):
            raise CorruptDataError(f"the blob sizes in the catalog of {self.path} are not numbers") from None

    def kinds(self) -> list[str]:
        """Kinds of tensors present in the run (params, grads, optimizer, ...)."""
        rows = {k for (k,) in self._con.execute("SELECT DISTINCT kind FROM series")}
        return [k for k in ALL_KINDS if k in rows and k != "state"]

    def names(self, kind: str = "params") -> list[str]:
        """Names of the tensors of ``kind`` recorded at any step, in recording order."""
        self._check_kind(kind)
        names = [n for (n,) in self._con.execute("SELECT name FROM series WHERE kind = ? ORDER BY id", (kind,))]
        bad = next((n for n in names if not isinstance(n, str)), None)
        if bad is not None:
            raise CorruptDataError(f"the catalog of {self.path} has a {kind} tensor named {bad!r}, not a string")
        return names

    # -- tensors ---------------------------------------------------------------
    def tensor(self, name: str, step: int, kind: str = "params") -> torch.Tensor:
        """The tensor ``name`` of ``kind`` at ``step``, bit-exact as recorded."""
        step = _as_step(step)
        sid = self._series_id(kind, name)
        row = self._con.execute(
            "SELECT blob, dtype, shape, fingerprint FROM tensors WHERE series = ? AND step = ?", (sid, step)
        ).fetchone()
        if row is None or row[0] is None:
            replayed = self._replayed.get(step)
            if replayed is not None and (kind, name) in replayed.tensors:
                return replayed.tensors[(kind, name)]
            self._missing(name, step, kind, stats_only=row is not None)
        return self._blobs.tensor(row[0], row[1], row[2], _fingerprint(row[3]))

    def tensors(self, step: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """Every stored tensor of ``kind`` at ``step``, by name."""
        step = _as_step(step)
        self._check_kind(kind)
        self._require_full(step)
        rows = self._con.execute(
            "SELECT s.name, t.blob, t.dtype, t.shape, t.fingerprint FROM tensors t JOIN series s ON s.id = t.series "
            "WHERE t.step = ? AND s.kind = ? AND t.blob IS NOT NULL ORDER BY s.id",
            (step, kind),
        ).fetchall()
        self._check_series()
        with self._blobs.call():  # one budget, and rows naming one blob share its tensor memory
            return {n: self._blobs.tensor(b, d, sh, _fingerprint(fp)) for n, b, d, sh, fp in rows}

    def fingerprints(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], int]:
        """(kind, name) -> fingerprint of every tensor with stats at ``step``."""
        step = _as_step(step)
        rows = self._con.execute(
            "SELECT s.kind, s.name, t.fingerprint FROM tensors t JOIN series s ON s.id = t.series "
            "WHERE t.step = ? AND s.kind != 'state'",
            (step,),
        ).fetchall()
        self._check_series()
        wanted = None if kinds is None else set(kinds)
        return {(k, n): fp for k, n, fp in rows if wanted is None or k in wanted}

    # -- state -----------------------------------------------------------------
    def step_state(self, step: int) -> dict[str, Any]:
        """The decoded non-tensor state of a step: groups, scheduler, scaler, rng at full
        steps; rng and the batch skeleton at every step in keyframe mode."""
        step = _as_step(step)
        row = self._con.execute("SELECT state FROM steps WHERE step = ?", (step,)).fetchone()
        if row is None or row[0] is None:
            self._require_full(step)  # raises with the nearest steps
            raise StepNotFoundError(f"step {step} of {self.path} has no recorded state")
        try:
            with self._blobs.call():  # every $tensor of the state in one read budget
                state = tjson.decode(tjson.loads(row[0]), lambda ref: self.tensor(ref, step, kind="state"))
        except StepdumpError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as e:
            raise CorruptDataError(f"the recorded state of step {step} in {self.path} is malformed ({e})") from e
        if not isinstance(state, dict):
            raise CorruptDataError(f"the recorded state of step {step} in {self.path} is not an object")
        return state

    def state_dict(self, step: int) -> OrderedDict[str, torch.Tensor]:
        """``model.state_dict()`` as it was at the start of iteration ``step``."""
        step = _as_step(step)
        from stepdump.read.state import model_state_dict

        with self._blobs.call():
            return model_state_dict(self, step)

    def optimizer_state_dict(self, step: int) -> dict[str, Any]:
        """``optimizer.state_dict()`` as it was before update ``step``."""
        step = _as_step(step)
        from stepdump.read.state import optimizer_state_dict

        with self._blobs.call():
            return optimizer_state_dict(self, step)

    def scheduler_state_dict(self, step: int) -> dict[str, Any] | None:
        """The LR scheduler's state_dict before update ``step`` (None if none was given)."""
        self._require_full(step)
        return self.step_state(step).get("scheduler")

    def scaler_state_dict(self, step: int) -> dict[str, Any] | None:
        """The GradScaler's state_dict used in iteration ``step`` (None if none was given)."""
        self._require_full(step)
        return self.step_state(step).get("scaler")

    def rng_state(self, step: int) -> dict[str, Any]:
        """RNG state at the start of iteration ``step`` (torch, cuda, numpy, python)."""
        state = self.step_state(step)
        if "rng" not in state:
            raise StepNotFoundError(
                f"step {step} of {self.path} was stored in full without its RNG state: the Recorder's `every` "
                "said no at the start of that iteration and yes at its optimizer step (a callable whose answer "
                "changed), so the start-of-iteration state was never taken"
            )
        return state["rng"]

    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                *, rng: bool = True) -> None:
        """Load step ``step`` into live objects so training can continue from it.

        Everything is checked before anything is changed: on a mismatch
        (names, shapes, param groups) a RestoreMismatchError names the first
        difference and the objects are left untouched.
        """
        step = _as_step(step)
        from stepdump.read.restore import restore

        with self._blobs.call():
            restore(self, step, model, optimizer, scheduler, scaler, rng=rng)

    def export(self, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False) -> Path:
        """Write step ``step`` as a checkpoint file; see :func:`stepdump.read.export.export`."""
        from stepdump.read.export import export

        with self._blobs.call():
            return export(self, step, path, format=format, grads=grads)

    # -- frames ----------------------------------------------------------------
    def scalars(self, names: str | Iterable[str] | None = None, steps: StepRange = None) -> pd.DataFrame:
        """One row per step, one column per scalar, plus boolean ``skipped``.

        Args:
            names: Glob(s) over scalar names (default: all but the ``sys/*``
                profiling columns, which :meth:`profile` returns).
            steps: A step, range, slice or iterable of steps.
        """
        where, args = _step_filter("step", steps)
        pats = None if names is None else [names] if isinstance(names, str) else list(names)
        if pats is not None and not all(isinstance(p, str) for p in pats):
            raise ConfigError(f"names= takes glob strings, got {names!r}")
        rows = self.scalar_rows(steps)
        skipped = self._con.execute(f"SELECT step, skipped FROM steps WHERE {where}", args).fetchall()
        try:
            df = pd.DataFrame(rows, columns=["step", "name", "value"])
            wide = df.pivot_table(index="step", columns="name", values="value", aggfunc="last", dropna=False)
            wide.columns.name = None
            if pats is not None:
                wide = wide[[c for c in wide.columns if any(fnmatch.fnmatchcase(c, p) for p in pats)]]
            else:  # the recorder's own sys/* readings are in profile()
                wide = wide[[c for c in wide.columns if not str(c).startswith("sys/")]]
            sk = pd.Series({s: bool(v) for s, v in skipped}, dtype=bool, name="skipped")
            wide = wide.join(sk, how="outer") if len(wide.columns) else sk.to_frame()
            wide["skipped"] = wide["skipped"].fillna(False).astype(bool)
            wide.index.name = "step"
            return wide.sort_index()
        except (ValueError, TypeError) as e:  # rows of the wrong types: a damaged catalog
            raise CorruptDataError(f"the scalars in the catalog of {self.path} are malformed ({e})") from e

    def scalar_rows(self, steps: StepRange = None, *, nan_only: bool = False) -> list[tuple[int, str, float | None]]:
        """(step, name, value) of every logged scalar, by name then step, checked to be numbers.

        ``value`` is None for a logged NaN (SQLite stores a NaN as NULL), so unlike in
        :meth:`scalars` a logged NaN is told apart from a name not logged at a step.
        ``nan_only``: just those rows.
        """
        where, args = _step_filter("step", steps)
        rows = self._con.execute(f"SELECT step, name, value FROM scalars WHERE {where}"
                                 f"{' AND value IS NULL' if nan_only else ''} ORDER BY name, step", args)
        for step, name, value in rows:
            _check_scalar(step, name, value, self.path)
        return rows

    def profile(self, steps: StepRange = None) -> pd.DataFrame:
        """Per-step ``sys/iter_ms`` (iteration wall time), ``sys/recorder_ms`` (time the
        recorder spent on the training thread) and ``sys/peak_mem_mb``."""
        return self.scalars(names="sys/*", steps=steps)

    def stats(self, kind: str | None = None, name: str | None = None, steps: StepRange = None) -> pd.DataFrame:
        """Health stats, one row per (step, kind, name); filters run in SQLite.

        Args:
            kind: Only this kind (params, grads, optimizer, ...).
            name: Glob over tensor names (``"fc1.*"``).
            steps: A step, range, slice or iterable of steps.
        """
        self._check_series()
        series_where, series_args = ["s.kind != 'state'"], []
        if kind is not None:
            self._check_kind(kind)
            series_where.append("s.kind = ?")
            series_args.append(kind)
        if name is not None:
            series_where.append("s.name GLOB ?")
            series_args.append(name)
        columns = ["step", "kind", "name", "dtype", "shape", *STAT_COLUMNS, "fingerprint", "stored"]
        if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
            steps = list(steps)  # a generator would be used up by the first of two queries
        df = self._one_series_stats(" AND ".join(series_where), series_args, steps, columns)
        if df is None:
            where, args = _step_filter("t.step", steps)
            cols = ", ".join(f"t.{c}" for c in STAT_COLUMNS)
            sql = (
                f"SELECT t.step, s.kind, s.name, t.dtype, t.shape, {cols}, t.fingerprint, t.blob IS NOT NULL "
                f"FROM tensors t JOIN series s ON s.id = t.series WHERE {where} AND {' AND '.join(series_where)} "
                "ORDER BY t.step, s.id"
            )
            df = pd.DataFrame(self._con.execute(sql, [*args, *series_args]).fetchall(), columns=columns)
        try:
            df["stored"] = df["stored"].astype(bool)
            for c in ("step", "numel", "nan", "posinf", "neginf"):  # text here would fail in every analysis
                df[c] = pd.to_numeric(df[c])
            for c in ("min", "max", "mean", "std", "norm", "zero_frac"):
                df[c] = df[c].astype(float)
        except (ValueError, TypeError) as e:
            raise CorruptDataError(f"the catalog of {self.path} holds stats that are not numbers ({e})") from e
        return df

    def _one_series_stats(self, series_where: str, series_args: list[Any], steps: StepRange,
                          columns: list[str]) -> pd.DataFrame | None:
        """Stats of one tensor's history when the filters match exactly one series, else None.

        The query walks the (series, step) key in order: no join and no sort in
        SQLite, and kind and name are not fetched with every row (10,000 steps:
        34 -> 27 ms, best of 20, on the bench machine). No match: an empty frame."""
        where, args = _step_filter("step", steps)  # first: a bad steps= is an error even if nothing matches
        series = self._con.execute(f"SELECT s.id, s.kind, s.name FROM series s WHERE {series_where} LIMIT 2",
                                   series_args).fetchall()
        if not series:
            return pd.DataFrame([], columns=columns)
        if len(series) > 1:
            return None
        (sid, kind, name), = series
        rows = self._con.execute(
            f"SELECT step, dtype, shape, {', '.join(STAT_COLUMNS)}, fingerprint, blob IS NOT NULL FROM tensors "
            f"WHERE series = ? AND {where} ORDER BY step", [sid, *args]).fetchall()
        df = pd.DataFrame(rows, columns=[c for c in columns if c not in ("kind", "name")])
        df.insert(1, "kind", kind)
        df.insert(2, "name", name)
        return df

    # -- helpers ---------------------------------------------------------------
    def _check_series(self) -> None:
        """Series kinds and names must be text: they become dict keys, names in exported
        checkpoints and TensorBoard tags, where bytes or numbers would fail far from here.
        One query over the (small) series table, once per Run: a live writer adds only text."""
        if self._series_checked:
            return
        bad = self._con.execute(
            "SELECT kind, name FROM series WHERE typeof(kind) != 'text' OR typeof(name) != 'text' "
            "OR typeof(param) NOT IN ('text', 'null') OR typeof(key) NOT IN ('text', 'null') LIMIT 1")
        if bad:
            kind, name = bad[0]
            raise CorruptDataError(f"the catalog of {self.path} has a {kind!r} tensor named {name!r} (or with a "
                                   "param or key) which is not text: the catalog is damaged "
                                   "(`stepdump verify` checks a run)")
        self._series_checked = True

    def _ints(self, sql: str, args: tuple[Any, ...]) -> list[int]:
        return [r[0] for r in self._con.execute(sql, args)]

    def _check_kind(self, kind: str) -> None:
        if kind not in ALL_KINDS:
            raise TensorNotFoundError(f"unknown kind {kind!r}; kinds are {', '.join(ALL_KINDS)}")

    def _series_id(self, kind: str, name: str) -> int:
        self._check_kind(kind)
        row = self._con.execute("SELECT id FROM series WHERE kind = ? AND name = ?", (kind, name)).fetchone()
        if row is None:
            others = [k for (k,) in self._con.execute("SELECT DISTINCT kind FROM series WHERE name = ?", (name,))]
            hint = f"; it exists as kind {', '.join(map(repr, others))}" if others else ""
            raise TensorNotFoundError(
                f"no {kind} tensor named {name!r} in {self.path}{hint}; " + close_names(name, self.names(kind))
            )
        return int(row[0])

    def _require_full(self, step: int) -> None:
        step = _as_step(step)
        row = self._con.execute("SELECT level FROM steps WHERE step = ?", (step,)).fetchone()
        if row is not None:
            _check_level(row[0], step)
        if row is None or row[0] < LEVEL_FULL:
            what = "was not recorded" if row is None else "has only stats and fingerprints (not stored in full)"
            raise StepNotFoundError(f"step {step} {what} in {self.path}; {nearest_steps(step, self.steps)}")

    def _missing(self, name: str, step: int, kind: str, stats_only: bool) -> None:
        if stats_only:
            raise StepNotFoundError(
                f"{kind} {name!r} at step {step} has only stats and a fingerprint, its values were not stored; "
                f"{nearest_steps(step, self.steps)}"
            )
        level = self._con.execute("SELECT level FROM steps WHERE step = ?", (step,)).fetchone()
        if level is not None:
            _check_level(level[0], step)
        if level is None or level[0] < LEVEL_FULL:
            self._require_full(step)
        raise StepNotFoundError(
            f"{kind} {name!r} has no value at step {step} (e.g. a parameter with no gradient that step, or "
            "optimizer state not created yet)"
        )


def _check_level(level: Any, step: int) -> None:
    if not isinstance(level, int) or isinstance(level, bool):
        raise CorruptDataError(f"step {step} has level {level!r} in the catalog, not a number")


def _check_scalar(step: Any, name: Any, value: Any, path: Path) -> None:
    """A scalars row must be (integer step, text name, number or NULL); SQLite keeps whatever
    a damaged or hostile catalog put there, and a string would fail far from here."""
    what = None
    if not isinstance(name, str):
        what = f"a scalar at step {step!r} is named {name!r}, which is not text"
    elif not isinstance(step, int) or isinstance(step, bool):
        what = f"scalar {name!r} has step {step!r}, which is not an integer"
    elif value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        what = f"scalar {name!r} at step {step} is {value!r}, which is not a number"
    if what is not None:
        raise CorruptDataError(f"in the catalog of {path}, {what}: the catalog is damaged "
                               "(`stepdump verify` checks a run)")


def _fingerprint(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise CorruptDataError(f"a tensor row has fingerprint {v!r}, which is not a 64-bit hash")
    return v


def _as_step(step: Any) -> int:
    """Steps often come out of a DataFrame as numpy.int64, which SQLite would bind as a
    blob that equals no step; take anything that is an integer, refuse the rest."""
    if isinstance(step, bool):
        raise ConfigError(f"a step is an integer, got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise ConfigError(f"a step is an integer, got {type(step).__name__} {step!r}") from None


def _step_filter(col: str, steps: StepRange) -> tuple[str, list[Any]]:
    if steps is None:
        return "1", []
    if not isinstance(steps, (slice, range)) and hasattr(steps, "__index__"):
        return f"{col} = ?", [_as_step(steps)]
    if isinstance(steps, slice):
        steps = range(
            steps.start if steps.start is not None else 0,
            steps.stop if steps.stop is not None else 2**62,
            steps.step or 1,
        )
    if isinstance(steps, range):
        if steps.step <= 0:
            return _step_filter(col, list(steps))
        return f"{col} >= ? AND {col} < ? AND ({col} - ?) % ? = 0", [steps.start, steps.stop, steps.start, steps.step]
    lst = sorted({_as_step(s) for s in steps})
    if not lst:
        return "0", []
    return f"{col} IN ({','.join('?' * len(lst))})", lst


def open(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,  # noqa: A001
         cache_dir: str | os.PathLike[str] | None = None) -> Run | DistributedRun:
    """Open a recorded run for reading (it may still be being written).

    Args:
        path: A run directory, a multi-rank run directory (``ranks.json``: gives a
            :class:`~stepdump.read.ranked.DistributedRun`), or an fsspec URL
            (``s3://bucket/run``, ``gs://...``, ``memory://...``) of either.
        storage_options: fsspec options for a URL (endpoint, credentials).
        cache_dir: Local cache for a URL's catalog snapshot and fetched bytes.
    """
    from stepdump.read.opener import open_run

    return open_run(path, storage_options=storage_options, cache_dir=cache_dir)  # type: ignore[no-any-return]
