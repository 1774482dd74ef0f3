"""What the gradient-log rebuild (read/gradlog.py) reads from the catalog, a window of steps at a time.

Re-applying update *t* needs four facts from the catalog: step *t*'s tensor rows (the grads'
blobs and the fingerprints the result is checked against), its param groups (the
hyperparameters update *t* used), whether it was skipped, and where its grads' blobs lie. Asked
step by step that was ~16 queries per update on a 16-param model (one per grad blob, and the
step's whole state decoded, its RNG tensors read from their blobs too, though the rebuild never
uses them): a few percent of an update's time, on the thread that runs the updates. Here each
fact comes from one query per :data:`WINDOW` steps, and a step's state is decoded only as far
as its param groups.

A run may be read while it is written: only steps whose row existed when the window was read
are taken from it (a step's rows commit with it, so those are complete); any other step is
read again when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from stepdump.core import tjson
from stepdump.core.hashing import XXH3
from stepdump.errors import CorruptDataError, StepdumpError
from stepdump.read.rows import Recorded, fp_kind_map
from stepdump.read.state import recorded_groups
from stepdump.store.format import Key
from stepdump.store.records import as_records

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.run import Run
    from stepdump.store.schema import BlobRow

#: Steps read per catalog query: enough to make the queries negligible next to the updates, few
#: enough that a window's rows stay small (rows of WINDOW steps of every tensor).
WINDOW = 16


class _Step(NamedTuple):
    """A step's row: whether its update was skipped, and its state's typed-JSON text."""

    skipped: Any
    state: Any


class Window:
    """Catalog facts of the steps ``first .. first + WINDOW - 1`` of one run (see the module docstring)."""

    def __init__(self, run: Run, blobs: BlobReader) -> None:
        self._run = run
        self._blobs = blobs
        self._steps: dict[int, _Step] = {}
        self._rows: dict[int, dict[Key, Recorded]] = {}
        self._blob_rows: dict[int, BlobRow] = {}
        self._groups: dict[int, list[dict[str, Any]]] = {}
        self._fp_kinds: dict[Key, str] | None = None  # series not fingerprinted with xxh3, read once

    def fp_kind(self, key: Key) -> str:
        """The fingerprint kind of series ``key`` (FORMAT.md "Fingerprint kinds"; one query per reader)."""
        if self._fp_kinds is None:
            self._fp_kinds = fp_kind_map(self._run.catalog)
        return self._fp_kinds.get(key, XXH3)

    def clear(self) -> None:
        self._steps, self._rows, self._blob_rows, self._groups = {}, {}, {}, {}

    def _load(self, step: int) -> None:
        if step in self._steps:
            return
        first, last = step, step + WINDOW - 1
        cat = self._run.catalog
        # Steps first: a step listed here has committed, so its tensor rows below are complete.
        steps = {s: _Step(skipped, state) for s, skipped, state in cat.step_block(first, last) if isinstance(s, int)}
        rows: dict[int, dict[Key, Recorded]] = {s: {} for s in steps}
        self.fp_kind(("", ""))  # the kinds, read once per reader
        kinds = self._fp_kinds or {}
        block = [r for r in cat.fingerprint_block(first, last) if r.step in rows]
        facts = as_records(Recorded, [(r.dtype, r.shape, r.fingerprint, r.blob,
                                       kinds.get((r.kind, r.name), XXH3) if kinds else XXH3) for r in block])
        for r, fact in zip(block, facts, strict=True):
            rows[r.step][(r.kind, r.name)] = fact
        # The two steps before ``first`` stay: an update asks for its own step's facts after the
        # next step's (the grads read ahead), and the windows must not take turns.
        kept = [s for s in self._steps if step - 2 <= s < step]
        blob_rows = self._blobs.blob_rows_of("grads", first, last)
        for s in kept:
            steps[s], rows[s] = self._steps[s], self._rows[s]
            blob_rows.update({row.blob: self._blob_rows[row.blob] for (kind, _), row in rows[s].items()
                              if kind == "grads" and row.blob in self._blob_rows})
        self._steps, self._rows, self._blob_rows = steps, rows, blob_rows
        self._groups = {s: g for s, g in self._groups.items() if s in kept}

    def rows(self, step: int) -> dict[Key, Recorded]:
        """(kind, name) -> what the record says of each tensor at ``step``."""
        self._load(step)
        rows = self._rows.get(step)
        if rows is None:  # not recorded (yet): asked directly
            block = self._run.catalog.fingerprint_block(step, step)
            facts = as_records(Recorded, [(r.dtype, r.shape, r.fingerprint, r.blob, self.fp_kind((r.kind, r.name)))
                                          for r in block])
            return {(r.kind, r.name): fact for r, fact in zip(block, facts, strict=True)}
        return rows

    def skipped(self, step: int) -> bool:
        """Whether update ``step`` was skipped (a GradScaler found inf/NaN)."""
        self._load(step)
        if step not in self._steps:
            return any(bool(v) for _, v in self._run.catalog.skipped_flags(step))
        return bool(self._steps[step].skipped)

    def blob_row(self, blob_id: Any) -> BlobRow:
        """The checked catalog row of a grad's blob (:meth:`BlobReader.blob_row`)."""
        b = self._blob_rows.get(blob_id) if isinstance(blob_id, int) else None
        return b if b is not None else self._blobs.blob_row(blob_id)

    def groups(self, step: int) -> list[dict[str, Any]]:
        """The param groups recorded at ``step`` (``{"hyper": {...}, "params": [names]}``), checked."""
        self._load(step)
        got = self._groups.get(step)
        if got is not None:
            return got
        entry = self._steps.get(step)
        if entry is None or not isinstance(entry.state, str):  # not recorded or no state: the usual error
            return recorded_groups(self._run, step, self._run.step_state(step))
        try:  # only the groups: the rest of the state (RNG tensors, extras) is not the rebuild's
            tree = tjson.loads(entry.state, f"the recorded state of step {step} in {self._run.path}")
            raw = tree.get("groups") if isinstance(tree, dict) else None
            with self._blobs.call():  # a hyperparameter stored as a tensor (a tensor lr) is read as step_state reads it
                decoded = tjson.decode(raw, lambda ref: self._run.tensor(ref, step, kind="state"))
        except StepdumpError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as e:
            raise CorruptDataError(f"the recorded state of step {step} in {self._run.path} is malformed ({e})") from e
        got = self._groups[step] = recorded_groups(self._run, step, {"groups": decoded})
        return got
