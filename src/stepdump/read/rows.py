"""Checks on catalog rows that readers use: a damaged or hostile catalog is named here,
as a :class:`~stepdump.errors.CorruptDataError`, not deep inside an analysis.

The queries themselves are :class:`~stepdump.store.queries.CatalogReader`'s; these
functions take its answers (and it, where the check needs another query).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from stepdump.errors import (
    CorruptDataError,
    StepNotFoundError,
    TensorNotFoundError,
    nearest_steps,
)
from stepdump.core.dtypes import DTYPE_NAMES
from stepdump.core.hashing import XXH3, fingerprint, fingerprint_as
from stepdump.store.format import ALL_KINDS, LEVEL_FULL, format_shape
from stepdump.store.queries import CatalogReader, FingerprintRow, TensorRow, as_step

__all__ = ["Recorded", "as_step", "check_fingerprint", "check_kind", "check_level", "check_scalar",
           "differs_from_row", "fp_kind_map", "require_full"]


class Recorded(NamedTuple):
    """What the record says of one tensor at one step, as a rebuild reads and checks it: its dtype,
    shape and fingerprint (of ``fp_kind``, its series'), and its blob (None: not stored)."""

    dtype: Any
    shape: Any
    fingerprint: Any
    blob: Any = None
    fp_kind: str = XXH3


def check_level(level: Any, step: int) -> None:
    if not isinstance(level, int) or isinstance(level, bool):
        raise CorruptDataError(f"step {step} has level {level!r} in the catalog, not a number")


def require_full(catalog: CatalogReader, step: int, path: Path | str) -> None:
    """Raise StepNotFoundError (naming the nearest full steps) unless ``step`` is stored in full."""
    step = as_step(step)
    level = catalog.level(step)
    if level is not None:
        check_level(level, step)
    if level is None or level < LEVEL_FULL:
        what = "was not recorded" if level is None else "has only stats and fingerprints (not stored in full)"
        raise StepNotFoundError(f"step {step} {what} in {path}; {nearest_steps(step, catalog.steps(LEVEL_FULL))}")


def check_fingerprint(v: Any, path: Path | str) -> int:
    """A tensor row's fingerprint: a 64-bit integer hash."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise CorruptDataError(f"a tensor row of {path} has fingerprint {v!r}, which is not a 64-bit hash")
    return v


def check_scalar(step: Any, name: Any, value: Any, path: Path | str) -> None:
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


def check_kind(kind: str) -> None:
    """Refuse a kind that no run can have (TensorNotFoundError listing the kinds)."""
    if kind not in ALL_KINDS:
        raise TensorNotFoundError(f"unknown kind {kind!r}; kinds are {', '.join(ALL_KINDS)}")


def fp_kind_map(catalog: CatalogReader) -> dict[tuple[str, str], str]:
    """(kind, name) -> fingerprint kind of every series whose fingerprints are not xxh3 (FORMAT.md,
    "Fingerprint kinds"); a series absent from it is xxh3. One query for a store of xxh3 series
    only (every format-1 store), so the xxh3 paths cost what they did; callers keep the answer
    for the operation they run (a diff, a replay, a gradient-log reader)."""
    return catalog.fp_kinds_by_name()


def differs_from_row(t: Any, row: Recorded | FingerprintRow | TensorRow, fp: int | None = None,
                     fp_kind: str = XXH3) -> str | None:
    """How a rebuilt tensor differs from its recorded row (its dtype, shape and fingerprint), or None
    when it is the recorded tensor (a rebuild returns only what this says is exact). ``fp``: the
    tensor's fingerprint under ``fp_kind`` (the row's), when the caller has it already (hashed on
    another thread)."""
    if DTYPE_NAMES.get(t.dtype) != row.dtype or format_shape(t.shape) != row.shape:
        return f"is {t.dtype} {tuple(t.shape)} in the rebuild, {row.dtype} {row.shape} in the record"
    if fp is None:
        fp = fingerprint(t) if fp_kind == XXH3 else fingerprint_as(fp_kind, t)
    if fp != row.fingerprint:
        return "differs from its recorded fingerprint" + ("" if fp_kind == XXH3 else f" ({fp_kind})")
    return None
