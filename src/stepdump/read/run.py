"""``Run``: read access to a recorded run, also while it is still being written."""

from __future__ import annotations

import fnmatch
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

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
from stepdump.read.columnar import fp_kind_column
from stepdump.read.gradlog import GradientLog
from stepdump.read.rows import (
    as_step,
    check_fingerprint,
    check_kind,
    check_level,
    check_scalar,
    require_full,
)
from stepdump.read.state import check_meta
from stepdump.store.format import ALL_KINDS, LEVEL_FULL, STATE_EXTRA
from stepdump.store.lock import is_locked
from stepdump.store.queries import STAT_ROW_COLUMNS, CatalogReader, StepRange
from stepdump.store.schema import DEFAULT_FP_KIND, STAT_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from stepdump.read.activations import Activations
    from stepdump.store.stat_chunk import StatArrays
    from stepdump.store.storage import ReadStorage

_as_step = as_step  # the name ranked.py and older callers import


class Run:
    """A recorded run. Every query sees all steps committed so far.

    Open with :func:`stepdump.open`. Tensors are read lazily, one blob at a
    time, and checked against their checksum.
    """

    def __init__(self, path: str | os.PathLike[str], *, storage: ReadStorage | None = None) -> None:
        # ``storage``: where segment bytes are read from (default: the files under ``path``);
        # the Run closes it.
        self.path = Path(path)
        self._catalog = CatalogReader(self.path)
        try:
            self.meta: dict[str, Any] = self._catalog.meta()
            check_meta(self.meta, self.path)
        except BaseException:
            self._catalog.close()
            raise
        self.format_version: int = int(self.meta["format_version"])
        self._blobs = BlobReader(self.path, self._catalog, storage)
        self._series_checked = False  # see _check_series
        # A gradient log (docs/gradient-log.md) rebuilds params and optimizer state between keyframes.
        self._gradlog: GradientLog | None = GradientLog(self, self._blobs) if self.meta.get("gradient_log") else None
        # A pair of a joint run: (name, step) -> a param another pair's optimizer updates, as this
        # pair's record saw it (set by JointRun; a gradient log takes those from there).
        self.foreign_source: Callable[[str, int], torch.Tensor] | None = None

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        if self._gradlog is not None:  # its cached rebuild holds a copy of the model and optimizer state
            self._gradlog.close()
        self._blobs.close()
        self._catalog.close()

    @property
    def catalog(self) -> CatalogReader:
        """The run's catalog queries (:class:`~stepdump.store.queries.CatalogReader`).

        Typed rows for analysis that needs more than the frames (``diff``,
        ``verify``, the report's stat matrices); read-only, and not a stable API."""
        return self._catalog

    @property
    def gradient_log(self) -> GradientLog | None:
        """The rebuild engine of a gradient-log run (docs/gradient-log.md); None for other runs.
        ``stepdump verify`` re-runs its segments (:meth:`GradientLog.verify_segments`)."""
        return self._gradlog

    @property
    def _con(self) -> Any:
        # The raw read-only connection, for tests that look at or plant rows; code asks self.catalog.
        return self._catalog.connection

    def stores(self) -> Iterator[tuple[int | None, Run]]:
        """The run's stores: this one, with no rank (a multi-rank run yields one per rank)."""
        yield None, self

    def read_blob(self, blob_id: int) -> bytes | bytearray | memoryview:
        """The decoded bytes of one blob, its checksum verified (what ``verify`` checks blob by blob)."""
        return self._blobs.raw(blob_id)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<stepdump.types.Run {str(self.path)!r}: {len(self.all_steps)} steps>"

    @property
    def live(self) -> bool:
        """True while a Recorder still holds this run open for writing."""
        return is_locked(self.path)

    # -- steps and names -----------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Steps whose tensors are stored in full (what :meth:`tensor` can read); in a gradient
        log also the steps whose params and optimizer state are rebuilt from its keyframes."""
        if self._gradlog is not None:
            return self._gradlog.readable_steps()
        return self._catalog.steps(LEVEL_FULL)

    @property
    def stats_steps(self) -> list[int]:
        """Steps with stats and fingerprints (a superset of :attr:`steps`)."""
        return self._catalog.steps(1)

    @property
    def all_steps(self) -> list[int]:
        """Every optimizer step the recorder saw, recorded in full or not."""
        return self._catalog.steps()

    @property
    def skipped_steps(self) -> list[int]:
        """Steps the GradScaler skipped (inf/NaN gradients, no update)."""
        return self._catalog.skipped_steps()

    def blob_bytes(self) -> tuple[int, int]:
        """(stored, raw): bytes of tensor data in the segments, and what they decode to.

        Their ratio is what the run's codec saved (1.0 for ``raw``)."""
        stored, raw = self._catalog.blob_sizes()
        try:
            return int(stored), int(raw)
        except (TypeError, ValueError, OverflowError):
            raise CorruptDataError(f"the blob sizes in the catalog of {self.path} are not numbers") from None

    def kinds(self) -> list[str]:
        """Kinds of tensors present in the run (params, grads, optimizer, ...)."""
        rows = self._catalog.kinds()
        return [k for k in ALL_KINDS if k in rows and k != "state"]

    def names(self, kind: str = "params") -> list[str]:
        """Names of the tensors of ``kind`` recorded at any step, in recording order."""
        self._check_kind(kind)
        names = self._catalog.names(kind)
        bad = next((n for n in names if not isinstance(n, str)), None)
        if bad is not None:
            raise CorruptDataError(f"the catalog of {self.path} has a {kind} tensor named {bad!r}, not a string")
        return names

    # -- tensors ---------------------------------------------------------------
    def tensor(self, name: str, step: int, kind: str = "params") -> torch.Tensor:
        """The tensor ``name`` of ``kind`` at ``step``, bit-exact as recorded."""
        step = _as_step(step)
        sid = self._series_id(kind, name)
        row = self._catalog.tensor_row(sid, step)
        if row is None or row.blob is None:
            if self._gradlog is not None and self._gradlog.rebuilds(step, kind):
                with self._blobs.call():
                    return self._gradlog.tensor(name, step, kind)
            self._missing(name, step, kind, stats_only=row is not None)
        fp_kind = self._catalog.fp_kinds().get(sid, DEFAULT_FP_KIND)  # the row's fingerprint is of its series' kind
        return self._blobs.tensor(row.blob, row.dtype, row.shape, check_fingerprint(row.fingerprint, self.path),
                                  fp_kind)

    def tensors(self, step: int, kind: str = "params") -> dict[str, torch.Tensor]:
        """Every stored tensor of ``kind`` at ``step``, by name."""
        step = _as_step(step)
        self._check_kind(kind)
        self._require_full(step, kind)
        if self._gradlog is not None and self._gradlog.rebuilds(step, kind):
            with self._blobs.call():
                return self._gradlog.tensors(step, kind)
        rows = self._catalog.stored_tensors(step, (kind,))
        self._check_series()
        fp_kinds = self._catalog.fp_kinds_by_name()  # each row's fingerprint is of its series' kind
        with self._blobs.call():  # one budget, and rows naming one blob share its tensor memory
            return {r.name: self._blobs.tensor(r.blob, r.dtype, r.shape, check_fingerprint(r.fingerprint, self.path),
                                               fp_kinds.get((kind, r.name), DEFAULT_FP_KIND))
                    for r in rows}

    def stored_names(self, step: int, kind: str = "params") -> list[str]:
        """Names of the ``kind`` tensors stored in full at ``step`` (what :meth:`tensors` returns)."""
        step = _as_step(step)
        self._check_kind(kind)
        self._require_full(step, kind)
        self._check_series()
        if self._gradlog is not None and self._gradlog.rebuilds(step, kind):
            with self._blobs.call():
                return self._gradlog.names(step, kind)
        return self._catalog.stored_names(step, kind)

    def activations(self, step: int, *, grads: bool = False, reexecuted: bool | None = None) -> Activations:
        """The module outputs (``grads=True``: the grads flowing into them) stored at ``step``, by
        module name: those the recording captured, else those a re-execution captured and wrote
        back (``stepdump.reexecute(..., write_back=True)``). The result is a dict with ``.reexecuted``
        (which of the two) and ``.verdict`` (the re-execution's, as stored); ``reexecuted=True`` /
        ``False`` asks for one source only. Empty when the step holds none."""
        from stepdump.read.activations import activations

        return activations(self, _as_step(step), grads=grads, reexecuted=reexecuted)

    def fingerprints(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], int]:
        """(kind, name) -> fingerprint of every tensor with stats at ``step``."""
        step = _as_step(step)
        rows = self._catalog.fingerprints(step)
        self._check_series()
        wanted = None if kinds is None else set(kinds)
        return {(k, n): fp for k, n, fp in rows if wanted is None or k in wanted}

    def fingerprint_kinds(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], str]:
        """(kind, name) -> the fingerprint kind (``"xxh3"`` or ``"dmix64"``) of every tensor with
        stats at ``step``: the keys of :meth:`fingerprints`, and what their values are (FORMAT.md,
        "Fingerprint kinds"). Two fingerprints of different kinds never compare."""
        other = self._catalog.fp_kinds_by_name()
        return {key: other.get(key, DEFAULT_FP_KIND) for key in self.fingerprints(step, kinds)}

    # -- state -----------------------------------------------------------------
    def step_state(self, step: int) -> dict[str, Any]:
        """The decoded non-tensor state of a step: groups, scheduler, scaler, rng at full
        steps; rng and the batch skeleton at every step in keyframe mode."""
        step = _as_step(step)
        text = self._catalog.step_state(step)
        if text is None:
            self._require_full(step)  # raises with the nearest steps
            raise StepNotFoundError(f"step {step} of {self.path} has no recorded state")
        try:
            tree = tjson.loads(text, f"the recorded state of step {step} in {self.path}")
            if isinstance(tree, dict):  # read on its own, by extra_state_dict: no need to decode its tensors here
                tree.pop(STATE_EXTRA, None)
            with self._blobs.call():  # every $tensor of the state in one read budget
                state = tjson.decode(tree, lambda ref: self.tensor(ref, step, kind="state"))
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
            if self._gradlog is not None and self._gradlog.rebuilds(step, None):
                return self._gradlog.state_dict(step)
            return model_state_dict(self, self._blobs, step)

    def optimizer_state_dict(self, step: int) -> dict[str, Any]:
        """``optimizer.state_dict()`` as it was before update ``step``."""
        step = _as_step(step)
        from stepdump.read.state import optimizer_state_dict

        with self._blobs.call():
            if self._gradlog is not None and self._gradlog.rebuilds(step, None):
                return self._gradlog.optimizer_state_dict(step)
            return optimizer_state_dict(self, self._blobs, step)

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

    def extra_state_dict(self, step: int, name: str) -> Any:
        """``state_dict()`` of the object recorded as ``Recorder(extra_state={name: obj})``, as it was
        when update ``step`` began (an EMA: docs/recipes/ema.md)."""
        step = _as_step(step)
        from stepdump.read.extra import extra_state_dict

        self._require_full(step)
        with self._blobs.call():
            return extra_state_dict(self, step, name)

    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                *, rng: bool = True, extra_state: Mapping[str, Any] | None = None) -> None:
        """Load step ``step`` into live objects so training can continue from it.

        Atomic: every part (model, optimizer, scheduler, scaler, RNG, extra state) is checked,
        or loaded into a copy, before anything is changed; on a mismatch a
        RestoreMismatchError names the part and the fix, and the objects are left untouched.
        ``extra_state``: the objects recorded with ``Recorder(extra_state=)``, by the same names
        (a name the run does not hold is an error; one it holds that is not given is logged as
        a warning and left as it is).
        """
        step = _as_step(step)
        from stepdump.read.restore import restore

        with self._blobs.call():
            restore(self, step, model, optimizer, scheduler, scaler, rng=rng, extra_state=extra_state)

    def export(self, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False,
               trainer: Mapping[str, Any] | None = None, rank: int | None = None) -> Path:
        """Write step ``step`` as a checkpoint (``format``: torch, safetensors, hf-trainer,
        lightning); the arguments of :func:`stepdump.export.export_checkpoint`, which says more."""
        from stepdump.read.export import export

        with self._blobs.call():
            return export(self, step, path, format=format, grads=grads, trainer=trainer, rank=rank)

    # -- frames ----------------------------------------------------------------
    def scalars(self, names: str | Iterable[str] | None = None, steps: StepRange = None) -> pd.DataFrame:
        """One row per step, one column per scalar, plus boolean ``skipped``.

        Args:
            names: Glob(s) over scalar names (default: all but the ``sys/*``
                profiling columns, which :meth:`profile` returns).
            steps: A step, range, slice or iterable of steps.
        """
        pats = None if names is None else [names] if isinstance(names, str) else list(names)
        if pats is not None and not all(isinstance(p, str) for p in pats):
            raise ConfigError(f"names= takes glob strings, got {names!r}")
        if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
            steps = list(steps)  # a generator would be used up by the first of two queries
        import pandas as pd  # lazily: see the TYPE_CHECKING import

        rows = self.scalar_rows(steps)
        skipped = self._catalog.skipped_flags(steps)
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
        rows = self._catalog.scalar_rows(steps, nan_only=nan_only)
        for step, name, value in rows:
            check_scalar(step, name, value, self.path)
        return rows

    def profile(self, steps: StepRange = None) -> pd.DataFrame:
        """Per-step ``sys/iter_ms`` (iteration wall time), ``sys/recorder_ms`` (what the recorder
        cost the iteration: ``sys/recorder_hooks_ms``, its hooks' wall time, plus the larger of
        ``sys/recorder_wait_ms``, the training thread's waits on the recorder's threads outside the
        hooks, and the recorder threads' CPU time, less what the hooks' time holds of it already),
        ``sys/recorder_bg_ms`` (those threads' CPU time), on CUDA ``sys/recorder_gpu_wait_ms`` (the
        hooks' waits for a writer that waited for the GPU, not counted) and ``sys/peak_mem_mb``
        (docs/performance.md, "The pipeline")."""
        return self.scalars(names="sys/*", steps=steps)

    def stats(self, kind: str | None = None, name: str | None = None, steps: StepRange = None, *,
              dtype_backend: str = "numpy") -> pd.DataFrame:
        """Health stats, one row per (step, kind, name); filters run in SQLite.

        Args:
            kind: Only this kind (params, grads, optimizer, ...).
            name: Glob over tensor names (``"fc1.*"``).
            steps: A step, range, slice or iterable of steps.
            dtype_backend: ``"numpy"`` (NaN where a stat is NULL) or ``"pyarrow"``: the same
                columns and rows as Arrow-backed columns (``pd.ArrowDtype``, null where a stat is
                NULL), built from the catalog rows with no numpy step (needs pyarrow;
                :mod:`stepdump.read.columnar`).
        """
        import pandas as pd  # lazily: see the TYPE_CHECKING import

        if dtype_backend == "pyarrow":
            from stepdump.read import columnar

            return columnar.frame(self, kind, name, steps)
        if dtype_backend != "numpy":
            raise ConfigError(f"dtype_backend={dtype_backend!r}: choose 'numpy' or 'pyarrow'")
        self._check_series()
        if kind is not None:
            self._check_kind(kind)
        columns = list(STAT_ROW_COLUMNS)
        if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
            steps = list(steps)  # a generator would be used up by the first of two queries
        # One series (a tensor's history): its own query, with no join or sort in SQLite.
        series = self._catalog.matching_series(kind, name, limit=2)
        if self._catalog.has_stat_chunks:  # stats as columns: the frame is built from arrays
            df = self._stats_from_arrays(kind, name, steps)
        elif len(series) == 1:
            (sid, skind, sname), = series
            df = pd.DataFrame(self._catalog.series_stat_rows(sid, steps),
                              columns=[c for c in columns if c not in ("kind", "name")])
            df.insert(1, "kind", skind)
            df.insert(2, "name", sname)
        else:
            df = pd.DataFrame(self._catalog.stat_rows(kind, name, steps), columns=columns)
        return self._typed_stats(df)

    def _typed_stats(self, df: pd.DataFrame) -> pd.DataFrame:
        """:meth:`stats`' frame with its columns' types checked and made, and ``fp_kind`` added."""
        import pandas as pd

        try:
            df["stored"] = df["stored"].astype(bool)
            for c in ("step", "numel", "nan", "posinf", "neginf"):  # text here would fail in every analysis
                if c in df.columns:  # (stats_by_series may be asked for some stat columns only)
                    df[c] = pd.to_numeric(df[c])
            for c in ("min", "max", "mean", "std", "norm", "zero_frac"):
                if c in df.columns:
                    df[c] = df[c].astype(float)
        except (ValueError, TypeError) as e:
            raise CorruptDataError(f"the catalog of {self.path} holds stats that are not numbers ({e})") from e
        # The kind of each row's fingerprint (FORMAT.md "Fingerprint kinds"), right after it.
        other = self._catalog.fp_kinds_by_name()
        at = df.columns.get_loc("fingerprint") + 1
        if other or not len(df):
            df.insert(at, "fp_kind", fp_kind_column(other, df["kind"], df["name"]))
        else:  # every row xxh3: one value, broadcast (the same column as the list of it, built ~10x faster)
            df.insert(at, "fp_kind", DEFAULT_FP_KIND)
        return df

    def _stats_from_arrays(self, kind: str | None, name: str | None, steps: StepRange) -> pd.DataFrame:
        """:meth:`stats`' columns (before their types are checked) from the catalog's stat arrays
        (FORMAT.md "Stat chunks"): a column per stat, no Python object per value."""
        a = self._catalog.stat_arrays(kind, name, steps)
        info = {int(i): (k, n) for i, k, n in self._catalog.matching_series(kind, name)}
        return self._frame_of_arrays(a, info)

    @staticmethod
    def _frame_of_arrays(a: StatArrays, info: Mapping[int, tuple[str, str]],
                         columns: Sequence[str] = STAT_COLUMNS) -> pd.DataFrame:
        """Stat arrays as :meth:`stats`' columns (before their types are checked), of the stat
        columns only ``columns``; ``info``: series id -> (kind, name)."""
        import numpy as np
        import pandas as pd

        ids = np.unique(a.series)
        codes = np.searchsorted(ids, a.series)
        kinds = np.asarray([info.get(int(i), (None, None))[0] for i in ids], dtype=object)
        names = np.asarray([info.get(int(i), (None, None))[1] for i in ids], dtype=object)
        cols: dict[str, Any] = {"step": a.step, "kind": kinds[codes], "name": names[codes], "dtype": a.dtype,
                                "shape": a.shape}
        for c in columns:
            v = a.stats[c]
            if v.dtype.kind == "i" and (v < 0).any():  # a NULL count: NaN, as pandas makes of None
                v = np.where(v < 0, np.nan, v)
            cols[c] = v
        cols["fingerprint"] = a.fingerprint
        cols["stored"] = a.blob >= 0
        return pd.DataFrame(cols)

    def stats_by_tensor(self, kind: str, names: Iterable[str]) -> Iterator[tuple[str, pd.DataFrame]]:
        """``(name, self.stats(kind, glob_literal(name)))`` for each of ``names`` (of ``kind``), in
        that order, the same frames, but read together: in a store with stat chunks (FORMAT.md
        "Stat chunks") a tensor's history is a share of every chunk, so reading tensors one by one
        decodes every chunk once per tensor; here once for all of ``names`` (memory: their rows).
        A name the run does not have yields an empty frame, as ``stats`` gives one."""
        for _, name, rows in self.stats_by_series([(kind, str(n)) for n in names]):
            yield name, rows

    def stats_by_series(self, series: Iterable[tuple[str, str]], columns: Sequence[str] = STAT_COLUMNS,
                        steps: StepRange = None) -> Iterator[tuple[str, str, pd.DataFrame]]:
        """``(kind, name, self.stats(kind, glob_literal(name)))`` for each ``(kind, name)`` of
        ``series``, in that order: :meth:`stats_by_tensor` for tensors of several kinds at once, one
        pass over the stat chunks for all of them (a chunk holds every kind's rows of its steps).

        ``columns``: the stat columns (:data:`~stepdump.store.schema.STAT_COLUMNS`) wanted; from
        stat chunks only those are decoded and held, the frames' other stat columns left out (a
        store without chunks gives whole frames). ``steps``: only the rows of these steps
        (``self.stats(kind, glob_literal(name), steps)``), and only the series that have one there
        (None: every row, and every series, an empty frame for one the run lacks)."""
        wanted_series = [(str(k), str(n)) for k, n in series]
        if not self._catalog.has_stat_chunks:  # a tensor's rows are one index range: read each alone
            for k, n in wanted_series:  # the name as a GLOB matching only itself
                df = self.stats(k, "".join(f"[{c}]" if c in "*?[" else c for c in n), steps)
                if steps is None or len(df):
                    yield k, n, df
            return
        import numpy as np

        self._check_series()
        info: dict[int, tuple[str, str]] = {}
        ids: dict[tuple[str, str], int] = {}
        for kind in dict.fromkeys(k for k, _ in wanted_series):
            self._check_kind(kind)
            for i, k, n in self._catalog.matching_series(kind, None):
                info[int(i)] = (k, n)
                ids[(kind, str(n))] = int(i)
        wanted = [ids[kn] for kn in dict.fromkeys(wanted_series) if kn in ids]
        columns = [c for c in STAT_COLUMNS if c in columns]
        a = self._catalog.stat_arrays(None, steps=steps, columns=columns, series=wanted)
        order = np.argsort(a.series, kind="stable")  # by series, each series' rows by step as read
        by_series, keys = a.series[order], np.asarray(wanted, dtype=np.int64)
        bounds, ends = np.searchsorted(by_series, keys), np.searchsorted(by_series, keys, side="right")
        at = {sid: order[lo:hi] for sid, lo, hi in zip(wanted, bounds.tolist(), ends.tolist(), strict=True)}
        for k, n in wanted_series:
            sid = ids.get((k, n))
            if steps is not None and (sid is None or not len(at[sid])):
                continue
            rows = a.take(at[sid]) if sid is not None else a.take(np.zeros(0, np.int64))
            yield k, n, self._typed_stats(self._frame_of_arrays(rows, {sid: info[sid]} if sid is not None else {},
                                                                columns))

    # -- helpers ---------------------------------------------------------------
    def _check_series(self) -> None:
        """Series kinds and names must be text: they become dict keys, names in exported
        checkpoints and TensorBoard tags, where bytes or numbers would fail far from here.
        One query over the (small) series table, once per Run: a live writer adds only text."""
        if self._series_checked:
            return
        bad = self._catalog.non_text_series()
        if bad is not None:
            kind, name = bad
            raise CorruptDataError(f"the catalog of {self.path} has a {kind!r} tensor named {name!r} (or with a "
                                   "param or key) which is not text: the catalog is damaged "
                                   "(`stepdump verify` checks a run)")
        self._series_checked = True

    def _check_kind(self, kind: str) -> None:
        check_kind(kind)

    def _series_id(self, kind: str, name: str) -> int:
        self._check_kind(kind)
        sid = self._catalog.series_id(kind, name)
        if sid is None:
            others = self._catalog.kinds_named(name)
            hint = f"; it exists as kind {', '.join(map(repr, others))}" if others else ""
            raise TensorNotFoundError(
                f"no {kind} tensor named {name!r} in {self.path}{hint}; " + close_names(name, self.names(kind))
            )
        return sid

    def _require_full(self, step: int, kind: str | None = None) -> None:
        """Refuse a step not stored in full; ``kind`` (None: the step's non-tensor state) is
        readable at every step of a gradient log."""
        if self._gradlog is not None and self._gradlog.readable(_as_step(step), kind):
            return
        require_full(self._catalog, step, self.path)

    def _missing(self, name: str, step: int, kind: str, stats_only: bool) -> NoReturn:
        if stats_only:
            raise StepNotFoundError(
                f"{kind} {name!r} at step {step} has only stats and a fingerprint, its values were not stored; "
                f"{nearest_steps(step, self.steps)}"
            )
        level = self._catalog.level(step)
        if level is not None:
            check_level(level, step)
        if level is None or level < LEVEL_FULL:
            self._require_full(step, kind)
        raise StepNotFoundError(
            f"{kind} {name!r} has no value at step {step} (e.g. a parameter with no gradient that step, or "
            "optimizer state not created yet)"
        )
