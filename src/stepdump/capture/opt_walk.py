"""The optimizer's per-param state, walked once while it holds the very same objects.

A gradient-log step (and a lean step that reads the optimizer state) takes every tensor of
``optimizer.state`` as an entry, and a gradient-log step every other value as its record's
``optimizer_extra``. Walking that mapping cost several Python calls per param at every step (a
tensor's ``__hash__`` is Python code; a lookup, an ``items()``, an ``isinstance`` per value): on a
model of hundreds of tensors, hundreds of calls on the training thread.

:class:`OptStateWalker` keeps a walk's result and gives it again while the mapping, the state dict
of every param walked, and every key and value in those dicts are the very objects they were
(checked by identity in C-level passes over them, no Python call per param). An update that
changes its tensors in place (every ``torch.optim`` optimizer) keeps all of them; a value replaced
(an int counter, a tensor swapped), a key added or removed, a param's dict replaced, or a new
``optimizer.state`` (``load_state_dict``) walks again. The result is then what a fresh walk gives:
the same objects in the same order, as the walk holds references, not copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from operator import is_
from typing import Any, NamedTuple

import torch

from stepdump.capture.step_state import NO_OPT_STATE, StateWalk, walk

__all__ = ["OptStateWalker"]  # (the walk itself, and its StateWalk: step_state)


class _Proof(NamedTuple):
    """The objects a walk was made from: while each is the same object, so is the walk."""

    params: list[tuple[str, torch.Tensor]]
    state: Mapping[Any, Mapping[str, Any]]
    keys: list[Any]  # the mapping's keys (params) and values (their dicts), in order
    dicts: list[Any]
    mine: list[Mapping[str, Any]]  # the walked params' dicts
    inner_keys: list[str]  # their keys and values, in order
    inner_values: list[Any]


class OptStateWalker:
    """:func:`walk`, kept while the objects it read are the same ones (module docstring)."""

    def __init__(self) -> None:
        self._kept: tuple[_Proof, StateWalk] | None = None

    def __call__(self, params: list[tuple[str, torch.Tensor]], state: Mapping[Any, Mapping[str, Any]]) -> StateWalk:
        """:func:`walk` of ``params`` (a list the caller keeps unchanged while it passes it again) in ``state``."""
        kept = self._kept
        if kept is not None and self._same(kept[0], params, state):
            return kept[1]
        found = walk(params, state)
        try:
            mine = [state.get(p, NO_OPT_STATE) for _, p in params]
            self._kept = (_Proof(params, state, list(state.keys()), list(state.values()), mine,
                                 list(chain.from_iterable(map(dict.keys, mine))),  # type: ignore[arg-type]
                                 list(chain.from_iterable(map(dict.values, mine)))), found)  # type: ignore[arg-type]
        except TypeError:  # a mapping whose dicts are not dicts: walked at every step
            self._kept = None
        return found

    @staticmethod
    def _same(proof: _Proof, params: list[tuple[str, torch.Tensor]], state: Mapping[Any, Mapping[str, Any]]) -> bool:
        if proof.params is not params or proof.state is not state or len(state) != len(proof.keys):
            return False
        # The same params map to the same dicts (every key and every value the same object) ...
        if not (all(map(is_, state.keys(), proof.keys)) and all(map(is_, state.values(), proof.dicts))):
            return False
        # ... and those dicts hold the same keys and values (a count first: map() stops at the shorter).
        mine = proof.mine
        if sum(map(len, mine)) != len(proof.inner_values):
            return False
        return (all(map(is_, chain.from_iterable(map(dict.keys, mine)), proof.inner_keys))  # type: ignore[arg-type]
                and all(map(is_, chain.from_iterable(map(dict.values, mine)), proof.inner_values)))  # type: ignore[arg-type]
