"""Rules that look at every tensor's history share one walk over the tensors.

A long lean run keeps its stats in stat chunks (FORMAT.md "Stat chunks"): a tensor's history is a
share of every chunk, so a walk over the tensors reads them in groups, one pass over the chunks per
group. ``update_ratio``, ``unchanged_tensor``, ``weight_norm_growth`` (the params) and
``dead_units`` (the grads, activations) each walked their own groups: every chunk was decoded once
per group and rule. A :class:`WalkingRule` instead says what it does with each tensor's rows
(:class:`TensorWalk`); :func:`walk_tensors` reads the stats once for all of them and hands each
tensor's rows to every walk that takes that kind. Alone (``rule(run)``), a walking rule walks by
itself.

In a store with stat chunks the rows come in pieces, a window of steps at a time (one pass over
the chunks, whatever the number of tensors): a walk keeps, per tensor, what its judgement needs
across the pieces (counts, first and last values, the run of flagged steps open at the end of a
piece) and judges in :meth:`TensorWalk.finish`, with the findings of a walk over whole histories.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from stepdump.analysis.findings import Finding
from stepdump.analysis.rules._frames import tensor_series
from stepdump.analysis.rules.base import Rule
from stepdump.store.schema import STAT_COLUMNS

if TYPE_CHECKING:
    import pandas as pd


class TensorWalk:
    """One rule's pass over the tensors' histories: the kinds it reads (``kinds``), what it does
    with each tensor's rows (:meth:`visit`), and its findings once every tensor was seen
    (:meth:`finish`). ``stat_columns``: the stat columns (``min``, ``norm``, ...) :meth:`visit`
    reads, None for every one; a frame may lack the others (its other columns, ``step``, ``name``,
    ``shape``, ``fingerprint``, ..., it always has)."""

    kinds: tuple[str, ...] = ()
    stat_columns: tuple[str, ...] | None = None

    def visit(self, kind: str, name: str, rows: pd.DataFrame) -> None:
        """Take a piece of one ``kind`` tensor's stats rows (``stats(kind).groupby("name")``'s
        group for ``name``): its whole history, or its rows of one window of steps, the pieces of a
        tensor in step order (a later piece's steps all above an earlier one's), the rows of a
        piece in the order the whole group holds them. The tensors of a kind come first in the
        order that frame first shows them. ``rows`` is shared with the other walks: read it,
        never change it in place."""
        raise NotImplementedError(f"{type(self).__name__} must implement visit()")

    def finish(self) -> list[Finding]:
        """The rule's findings, after the last tensor."""
        raise NotImplementedError(f"{type(self).__name__} must implement finish()")


@dataclass(frozen=True, kw_only=True)
class WalkingRule(Rule):
    """A rule that walks the tensors: it implements :meth:`walk`, not ``__call__``."""

    def walk(self, run: Any) -> TensorWalk:
        """This rule's walk over ``run`` (what it reads before the tensors is read here)."""
        raise NotImplementedError(f"{type(self).__name__} must implement walk(run)")

    def __call__(self, run: Any) -> list[Finding]:
        w = self.walk(run)
        walk_tensors(run, [w])
        return w.finish()


def shares_walk(rule: Any) -> TypeGuard[WalkingRule]:
    """Whether ``check`` may run ``rule`` as its walk (a :class:`WalkingRule` whose ``__call__``
    is the walk's own, not one a subclass replaced)."""
    return isinstance(rule, WalkingRule) and type(rule).__call__ is WalkingRule.__call__


def walk_tensors(run: Any, walks: Sequence[TensorWalk]) -> None:
    """Hand every tensor of the kinds ``walks`` take, and the run has, to each walk that takes
    its kind, in pieces (:meth:`TensorWalk.visit`): one read for all of them, of the stat columns they read (``run.tensor_walk`` where the run has it:
    :class:`~stepdump.analysis.rule_runner.CachedRun`), else kind by kind (:func:`tensor_series`)."""
    present = set(run.kinds())
    kinds = [k for k in dict.fromkeys(k for w in walks for k in w.kinds) if k in present]
    if not kinds:
        return
    takers = {k: [w for w in walks if k in w.kinds] for k in kinds}
    wanted = [w.stat_columns for w in walks]
    columns = STAT_COLUMNS if None in wanted else tuple(c for c in STAT_COLUMNS if any(c in w for w in wanted if w))
    source = getattr(run, "tensor_walk", None)
    if source is not None:
        for kind, name, rows in source(kinds, columns):
            for w in takers[kind]:
                w.visit(kind, name, rows)
        return
    for kind in kinds:
        for name, rows in tensor_series(run, kind):
            for w in takers[kind]:
                w.visit(kind, name, rows)
