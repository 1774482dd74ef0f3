"""Typed records (NamedTuples) made from rows in bulk, without a Python call per row.

``Record(...)`` and ``Record._make(row)`` run Python code per record (NamedTuple's generated
``__new__``); where records are made per tensor on a hot path (the recorder's entries at every
step, a gradient-log window's rows) that is most of their cost. :func:`as_records` makes them by
C calls only: ``tuple.__new__`` over the rows, which must hold the record's fields in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import Any, TypeVar

R = TypeVar("R", bound=tuple)  # a NamedTuple class


def as_records(record: type[R], rows: Iterable[Any]) -> list[R]:
    """``rows`` (tuples of ``record``'s fields, in order, all of them) as ``record`` instances."""
    return list(map(tuple.__new__, repeat(record), rows))
