"""Running rules over one store: the shared read-once view (:class:`CachedRun`) and the loop.

``stepdump.check`` (:mod:`stepdump.analysis.checks`) picks the rules and the kind of run;
:mod:`stepdump.analysis.multirank` and :mod:`stepdump.analysis.joint_checks` run them on
each rank's or pair's store. All three use what is here, so it sits below them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stepdump.analysis.findings import Finding
from stepdump.analysis.rules._frames import glob_literal
from stepdump.analysis.rules._roles import DECLARED_ATTR
from stepdump.analysis.rules._walk import shares_walk, walk_tensors
from stepdump.analysis.rules.base import RuleLike
from stepdump.errors import ConfigError
from stepdump.store.schema import STAT_COLUMNS

if TYPE_CHECKING:  # annotations only: importing pandas costs ~0.3 s
    import pandas as pd


#: Stats steps per frame of :meth:`CachedRun.stats_windows` (its memory: this x tensors rows).
WINDOW_STEPS = 256
#: Stats rows (steps x tensors) above which ``check`` walks the stats in windows and per tensor
#: instead of reading one frame for every rule (~200 bytes a row in a frame: about 0.4 GB).
STREAM_ROWS = 2_000_000


# Integer columns of a stats frame: int64 in a one-tensor read unless that tensor has a NULL there.
# The fingerprint too: a NULL one makes the column float (or object) in the frame holding it.
_COUNT_COLUMNS = ("step", "numel", "nan", "posinf", "neginf", "fingerprint")


def _share(df: pd.DataFrame) -> pd.DataFrame:
    """A frame the caller may change without changing ``df``: a view under pandas' copy-on-write
    (always on from pandas 3; what a rule changes is copied then), else a copy."""
    import pandas

    if int(pandas.__version__.split(".", 1)[0]) >= 3 or pandas.get_option("mode.copy_on_write") is True:
        return df.copy(deep=False)
    return df.copy()


def _row_bytes(stat_columns: int) -> int:
    """Bytes a stat row holds as arrays (``StatArrays``) with ``stat_columns`` stat columns: series,
    step, fingerprint, blob and the dtype and shape pointers, then 8 a stat."""
    return 8 * (6 + stat_columns)


def rule_name(rule: Any) -> str:
    """A rule's ``name`` attribute, else its ``__name__`` (a plain function), else ""."""
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        name = getattr(rule, "__name__", None)
    return name if isinstance(name, str) else ""


def run_rules(run: CachedRun, rules: list[RuleLike]) -> list[Finding]:
    """Every rule on ``run``, findings in :func:`sort_key` order; ConfigError if a rule returns something else.

    The rules that walk every tensor's history share one walk (:mod:`stepdump.analysis.rules._walk`).
    """
    walks = [rule.walk(run) if shares_walk(rule) else None for rule in rules]
    walk_tensors(run, [w for w in walks if w is not None])
    findings: list[Finding] = []
    for rule, walk in zip(rules, walks, strict=True):
        result = walk.finish() if walk is not None else rule(run)
        if result is None:
            continue
        for f in result:
            if not isinstance(f, Finding):
                raise ConfigError(
                    f"rule {rule_name(rule)!r} returned {type(f).__name__}; rules must return stepdump Finding objects"
                )
            findings.append(f)
    return sorted(findings, key=sort_key)


def sort_key(f: Finding) -> tuple[Any, ...]:
    """The order ``check`` returns findings in: by step (whole-run ones last), most severe first."""
    return (f.step is None, f.step or 0, -int(f.severity), f.rule, f.kind or "", f.tensor or "")


class CachedRun:
    """A read-only view of a Run for the rules of one ``check`` call.

    ``stats()``, ``scalars()``, ``scalar_rows()``, ``kinds()``, ``names()`` and the
    step lists are read once and shared (each call returns a copy, so a rule may modify what it
    gets); everything else is passed through to the Run. The view is a snapshot:
    steps a live recorder commits during the check are not seen halfway.
    ``declared_objective`` is ``check(objective=...)`` (None: not declared; see
    :mod:`stepdump.analysis.rules._roles`).
    """

    def __init__(self, run: Any, *, objective: str | bool | None = None, streaming: bool | None = None) -> None:
        self._run = run
        self._memo: dict[Any, Any] = {}
        self._streaming = streaming if hasattr(run, "catalog") else False
        setattr(self, DECLARED_ATTR, objective)

    @property
    def streaming(self) -> bool:
        """Whether the rules walk the stats in windows and per tensor (True) or share one frame.

        ``CachedRun(streaming=None)`` (what ``check`` uses) streams when the run holds more than
        :data:`STREAM_ROWS` stats rows (stats steps x tensors): the shared frame is faster, the
        windows bound the memory. Both give the same findings (tests/test_check_windows.py)."""
        if self._streaming is None:
            series = sum(len(self.names(k)) for k in self.kinds())
            self._streaming = len(self.stats_steps) * series > STREAM_ROWS
        return self._streaming

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._run, attr)

    def __repr__(self) -> str:
        return f"<CachedRun of {self._run!r}>"

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        try:
            hit = key in self._memo
        except TypeError:  # unhashable arguments: no caching
            return make()
        if not hit:
            self._memo[key] = make()
        return self._memo[key]

    def stats(self, kind: str | None = None, name: str | None = None, steps: Any = None) -> pd.DataFrame:
        if name is None and steps is None:
            full = self._cached(("stats",), lambda: self._run.stats())
            if kind is None:
                return _share(full)
            if kind not in self.kinds():
                return self._run.stats(kind)  # validates the kind, empty if merely absent
            if self.streaming:
                return full[full["kind"] == kind].reset_index(drop=True)
            return _share(self._cached(("stats", kind), lambda: full[full["kind"] == kind].reset_index(drop=True)))
        if self.streaming:  # one tensor or a few steps: a bounded read, kept by nobody
            return self._run.stats(kind, name, steps)
        key = ("stats", kind, name, tuple(steps) if isinstance(steps, (list, range)) else steps)
        return self._cached(key, lambda: self._run.stats(kind, name, steps)).copy()

    def name_rows(self, kind: str, name: str) -> pd.DataFrame:
        """One tensor's stats rows, by step: ``run.stats(kind, glob_literal(name))``.

        When the rules share one frame (not streaming), the rows are taken from it, grouped once
        per kind and name (a query and a frame build per tensor cost several ms each; a rule that
        looks at every tensor made dozens per store). The frame's columns then have the dtypes a
        one-tensor read gives them; where they may not (a count column that is not int64 in the
        shared frame: NULLs somewhere in the catalog), the tensor is read on its own as before.
        """
        if self.streaming and kind in self.kinds() and hasattr(self._run, "stats_by_tensor"):
            group = self._group_of(kind, name)
            if group is not None:
                return _share(group[name])
        if self.streaming or kind not in self.kinds():
            return self._run.stats(kind, glob_literal(name))
        groups, exact = self._cached(("name_rows",), self._name_groups)
        idx = groups.get((kind, name))
        if idx is None or not exact:
            return self._run.stats(kind, glob_literal(name))
        full = self._cached(("stats",), lambda: self._run.stats())
        return _share(self._cached(("name_rows", kind, name), lambda: full.take(idx).reset_index(drop=True)))

    def _name_groups(self) -> tuple[dict[tuple[str, str], Any], bool]:
        """(kind, name) -> positions of its rows in the shared frame, and whether the frame's
        columns have the dtypes a one-tensor read would give (see :meth:`name_rows`)."""
        full = self._cached(("stats",), lambda: self._run.stats())
        exact = all(str(full[c].dtype) == "int64" for c in _COUNT_COLUMNS)
        groups = {(str(k), str(n)): idx for (k, n), idx in full.groupby(["kind", "name"], sort=False).indices.items()}
        return groups, exact

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """A value computed once per check from what this view reads (``make()``; shared by the
        rules, so it must not be modified by them)."""
        return self._cached(("derived", key), make)

    def stats_windows(self, kind: str | None = None) -> Iterator[pd.DataFrame]:
        """The rows of ``stats(kind)``, in order, as frames of at most :data:`WINDOW_STEPS` stats steps.

        A rule that walks them holds one window at a time: ``check`` of a long run with many
        tensors then never holds the steps x tensors frame (``streaming=False``: one frame, read whole).
        """
        if not self.streaming or (kind is not None and kind not in self.kinds()):
            yield self.stats(kind)
            return
        steps = self.stats_steps
        if not steps:
            yield self._run.stats(kind, steps=[])
            return
        bounds = [0, *steps[WINDOW_STEPS::WINDOW_STEPS], 2**62]  # every row of a step in [lo, hi)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield self._run.stats(kind, steps=range(lo, hi))

    def tensor_series(self, kind: str) -> Iterator[tuple[str, pd.DataFrame]]:
        """Each ``kind`` tensor's rows of ``stats(kind)``, one tensor at a time, in the order the
        frame first shows them: what ``stats(kind).groupby("name", sort=False)`` yields, read per
        tensor when streaming (memory: one tensor's history, not every tensor's)."""
        if kind not in self.kinds():
            for name, rows in self.stats(kind).groupby("name", sort=False):
                yield str(name), rows
            return
        if not self.streaming:  # grouped once, shared by the rules that walk the tensors
            for name, rows in self._cached(("tensor_series", kind), lambda: self._groups(kind)):
                yield name, _share(rows)
            return
        if hasattr(self._run, "stats_by_tensor"):  # a group of tensors per pass over the stat chunks
            # The walk holds one group's rows as arrays (~140 bytes a row, half a frame's), each
            # tensor's frame made as it is yielded: twice the rows of a group of frames, half the passes.
            self._memo.pop(("group",), None)  # a rule before this walk is done with its one-tensor reads
            names = self.frame_names(kind)
            size = max(1, 2 * STREAM_ROWS // max(1, len(self.stats_steps)))
            for first in range(0, len(names), size):
                yield from self._run.stats_by_tensor(kind, names[first:first + size])
            return
        for name in self.frame_names(kind):
            yield str(name), self._run.stats(kind, glob_literal(str(name)))

    def tensor_walk(self, kinds: Sequence[str],
                    columns: Sequence[str] = STAT_COLUMNS) -> Iterator[tuple[str, str, pd.DataFrame]]:
        """``(kind, name, rows)`` pieces of the history of each tensor of ``kinds``: what the rules
        that walk the tensors read (:func:`stepdump.analysis.rules._walk.walk_tensors`). A kind the
        run lacks yields nothing.

        In a store with stat chunks (FORMAT.md "Stat chunks") a tensor's history is a share of
        every chunk: the walk reads the stats in windows of steps, one pass over the chunks for
        every tensor, and yields each tensor's rows of each window (``rows``: a piece; a tensor's
        pieces come in step order, and its rows of the window as its whole frame holds them). In a
        window the tensors come kind after kind, each kind's in the order :meth:`frame_names`
        gives, so the tensors' first pieces come in the order of a walk over whole histories.
        Elsewhere each tensor's whole history is one piece, as :meth:`tensor_series` yields it.

        ``columns``: the stat columns the walkers read; from stat chunks only those are decoded and
        held (the frames lack the others), and a window holds as many more steps as its rows are
        smaller (the memory of a window is that of :data:`STREAM_ROWS` rows with every column)."""
        if not self.streaming or not hasattr(self._run, "stats_by_series"):
            for kind in kinds:
                for name, rows in self.tensor_series(kind):
                    yield kind, name, rows
            return
        self._memo.pop(("group",), None)  # a rule before this walk is done with its one-tensor reads
        listed = [(kind, name) for kind in kinds if kind in self.kinds() for name in self.frame_names(kind)]
        columns = [c for c in STAT_COLUMNS if c in columns]
        rows = 2 * STREAM_ROWS * _row_bytes(len(STAT_COLUMNS)) // _row_bytes(len(columns))
        if getattr(self._run.catalog, "has_stat_chunks", False):
            # Windows of steps: every chunk decoded about once (a chunk across two windows twice,
            # unless the reader still holds it), however many tensors; the steps a window spans
            # are as many as its rows allow, never fewer than a stats window's.
            steps = self.stats_steps
            size = max(1, WINDOW_STEPS, rows // max(1, len(listed)))
            bounds = [0, *steps[size::size], 2**62]  # every row of a step in [lo, hi)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                yield from self._run.stats_by_series(listed, columns, steps=range(lo, hi))
            return
        # A store without chunks: a tensor's rows are one index range, read one by one.
        size = max(1, rows // max(1, len(self.stats_steps)))
        size = -(-len(listed) // -(-len(listed) // size)) if listed else 1  # as many passes, even groups
        for first in range(0, len(listed), size):
            yield from self._run.stats_by_series(listed[first:first + size], columns)

    def _group_of(self, kind: str, name: str) -> dict[str, pd.DataFrame] | None:
        """The frames of the group of ``kind`` tensors that holds ``name`` (None: not a ``kind``
        tensor of the frame): consecutive tensors of :meth:`frame_names`, at most
        :data:`STREAM_ROWS` rows in all (what a run below the threshold holds as one frame), read
        together by ``Run.stats_by_tensor``. In a store with stat chunks a tensor's history is a
        share of every chunk: read one by one, every chunk was decoded once per tensor and rule.
        The last group read is kept, so a rule that looks at the tensors in order, or at one
        tensor twice, reads a group once (:meth:`tensor_series` walks groups of its own)."""
        kept = self._memo.get(("group",))
        if kept is not None and kept[0] == kind and name in kept[1]:
            return kept[1]  # type: ignore[no-any-return]
        names = self.frame_names(kind)
        at = self._cached(("group_at", kind), lambda: {n: i for i, n in enumerate(names)}).get(name)
        if at is None:
            return None
        size = max(1, STREAM_ROWS // max(1, len(self.stats_steps)))
        first = at // size * size
        self._memo.pop(("group",), None)  # the old group goes before the new one is read
        group = dict(self._run.stats_by_tensor(kind, names[first:first + size]))
        self._memo[("group",)] = (kind, group)
        return group

    def _groups(self, kind: str) -> list[tuple[str, pd.DataFrame]]:
        """``stats(kind).groupby("name", sort=False)`` as a list (each group's rows keep their labels)."""
        import pandas

        frame = self.stats(kind)
        at = frame.groupby("name", sort=False).indices
        return [(str(n), frame.take(at[n])) for n in pandas.unique(frame["name"]) if n in at]

    def frame_names(self, kind: str) -> list[str]:
        """The ``kind`` tensors in the order ``stats(kind)`` first shows them."""
        if not self.streaming or kind not in self.kinds():
            import pandas

            return [str(n) for n in pandas.unique(self.stats(kind)["name"])]
        from stepdump.store.queries_scale import series_first_steps

        return list(self._cached(("frame_names", kind),
                                 lambda: [str(n) for _, n, _ in series_first_steps(self._run.catalog, kind)]))

    def scalars(self, names: Any = None, steps: Any = None) -> pd.DataFrame:
        key = ("scalars", tuple(names) if isinstance(names, list) else names,
               tuple(steps) if isinstance(steps, (list, range)) else steps)
        return self._cached(key, lambda: self._run.scalars(names, steps)).copy()

    def scalar_rows(self, steps: Any = None, *, nan_only: bool = False) -> list[tuple[int, str, float | None]]:
        # Several rules ask for the logged NaNs (nan_inf, and the damage a flagged step did).
        key = ("scalar_rows", tuple(steps) if isinstance(steps, (list, range)) else steps, nan_only)
        return list(self._cached(key, lambda: self._run.scalar_rows(steps, nan_only=nan_only)))

    def kinds(self) -> list[str]:
        return list(self._cached(("kinds",), self._run.kinds))

    def names(self, kind: str = "params") -> list[str]:
        return list(self._cached(("names", kind), lambda: self._run.names(kind)))

    @property
    def steps(self) -> list[int]:
        return list(self._cached(("steps",), lambda: self._run.steps))

    @property
    def stats_steps(self) -> list[int]:
        return list(self._cached(("stats_steps",), lambda: self._run.stats_steps))

    @property
    def all_steps(self) -> list[int]:
        return list(self._cached(("all_steps",), lambda: self._run.all_steps))

    @property
    def skipped_steps(self) -> list[int]:
        return list(self._cached(("skipped_steps",), lambda: self._run.skipped_steps))
