"""What goes into one step's message: which tensors are copied, written live, or read lean.

The Recorder decides *when* (its hooks, the schedule); this decides *what* a
record of a given level holds and how each tensor travels to the writer:

* a full record: every tensor, through the staging budget (copied while it
  lasts, the rest written live while the training thread waits);
* a stats-only record on the CPU: stats and fingerprints of the live tensors
  from the lean worker (capture/lean.py), no copy; a gradient log's grads and
  the small ``state`` tensors still travel in full;
* the ring and CUDA devices (no lean worker): the stats-only record is copied
  like a full one (the ring may keep it; a CUDA tensor's bytes are on the device).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stepdump.capture.carried import CarriedGrads
from stepdump.capture.extra import take as take_extra
from stepdump.capture.hooks import group_sizes
from stepdump.capture import lean as lean_mod
from stepdump.capture.lean import LeanCapture, lean_rows
from stepdump.capture.step_state import Entry, StateBefore, full_state, state_json, stored_in_full, tensor_entries
from stepdump.capture.opt_walk import OptStateWalker
from stepdump.capture.outside import STATE_KEY, ParamWatch, fingerprints
from stepdump.store.format import LEVEL_FULL, LEVEL_NONE, STATE_AFTER_UPDATE, STATE_CARRIED_GRADS
from stepdump.store.records import as_records
from stepdump.capture.selection import NameFilter
from stepdump.capture.staging import Item, OwnedCopier, Slot, Stager
from stepdump.capture.structure import StructureWatch, structure_change
from stepdump.capture.writer import StepMessage
from stepdump.core import tjson
from stepdump.core.layout import Layout, build_layout

log = logging.getLogger(__name__)

_LEAN_KINDS = ("params", "grads", "optimizer")


@dataclass
class Assembler:
    """Fills StepMessages for one Recorder (its ``layout`` follows ``add_param_group``)."""

    layout: Layout
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    kinds: tuple[str, ...]
    selected: NameFilter
    lean: LeanCapture
    keyframes: bool = False  # KeyframeSchedule: RNG state and batch at every step, for replay
    gradlog: bool = False  # GradientLogSchedule: grads in full and the param groups at every step
    # The optimizer state as step() began, for the next fill() only: a record taken after a closure's first call.
    state_before: StateBefore | None = None
    stager: Stager = field(default_factory=Stager)
    extra: Mapping[str, Any] | None = None  # Recorder(extra_state=): objects recorded beside the model (extra.py)
    frozen: str = "once"  # RecordOptions.frozen: "fingerprint" stores no bytes of requires_grad=False params

    def __post_init__(self) -> None:
        self._group_sizes = group_sizes(self.optimizer)
        if self.gradlog:
            self.lean.optimizer_every = 1
        # A param changed outside the optimizer is stored where it changed: a gradient log derives
        # params from the updates, and a re-execution compares an update's output with it (outside.py).
        self.watch = ParamWatch(strict=self.gradlog) if "params" in self.kinds else None
        # The selected params of a layout and their stats-only entries, made once per layout (_stats_entries).
        self._selected_of: tuple[Layout | None, list[tuple[str, torch.Tensor]], list[Entry]] = (None, [], [])
        # The optimizer state's walks (opt_walk.py): a stats-only step's entries of the selected params,
        # and a record's optimizer extras of every param (its list made once per layout).
        self._opt_walk, self._extra_walk = OptStateWalker(), OptStateWalker()
        self._all_params_of: tuple[Layout | None, list[tuple[str, torch.Tensor]]] = (None, [])
        self._copier = OwnedCopier()  # a small gradient-log step's bytes out of its slot (fill)
        # The last record's state text (state_json): the parts that did not change are not encoded again.
        self._state_memo = tjson.Memo()
        # A slot's staging budget (StagingPool.slot_budget; None: none): a step copied without a slot
        # is one whose bytes would all be copies in one, as the user's staging_bytes allows.
        self.slot_budget: int | None = None
        # The kinds a steady stats-only step records (fill: LeanCapture.steady): params and grads, nothing else.
        self._steady_kinds = "params" in self.kinds and "grads" in self.kinds
        self.carried = CarriedGrads()
        # The model's structure: a watch on registrations (set by the Recorder, which removes its hooks),
        # the earlier layouts (meta ``layouts``), the meta for the next record, the step of the last change.
        self.structure: StructureWatch | None = None
        self._earlier: list[dict[str, Any]] = []
        self._pending_meta: dict[str, Any] | None = None
        self.changed_at: int | None = None
        # A joint run's params of this pair's model that another pair's optimizer updates:
        # name -> (that pair, its name there). Not outside edits (share()).
        self.foreign: dict[str, tuple[str, str]] = {}

    def _watched(self) -> dict[str, torch.Tensor]:
        """The selected params, made once per layout (a name match per param at every step added
        a Python call per param to both hashing moments)."""
        layout, watched = getattr(self, "_watched_of", (None, {}))
        if layout is not self.layout:
            watched = {n: p for n, p in self.layout.params.items() if self.selected(n) and n not in self.foreign}
            self._watched_of = (self.layout, watched)
        return watched

    def resumed(self, earlier: list[dict[str, Any]]) -> None:
        """A resumed run's earlier layouts (meta ``layouts``, cut at the step resumed at): a structure
        change recorded from here adds to them."""
        self._earlier = list(earlier)

    def share(self, foreign: dict[str, tuple[str, str]]) -> None:
        """A joint run: ``foreign`` params of this pair's model are updated by another pair's optimizer
        (name -> (pair, its name there)). Their changes between this pair's updates are that pair's
        updates, not edits outside the optimizer: not watched, not stored for it; a reader takes them
        from that pair's record (meta ``joint_foreign``, FORMAT.md), checked against this record's
        fingerprints."""
        self.foreign = dict(foreign)
        if hasattr(self, "_watched_of"):  # made for the watch without this pair's foreign params
            del self._watched_of
        self._pending_meta = {**(self._pending_meta or {}),
                              "joint_foreign": {n: list(ref) for n, ref in sorted(foreign.items())}}

    def after_update(self, next_level: int = LEVEL_FULL) -> None:
        """The update is over (optimizer post-hook): note what it left in the params (outside.py),
        where the next record (of level ``next_level``) is compared with it: a gradient log's and a
        keyframe run's every record (their rebuild and replay redo the edit), else a full one (a
        lean step's two hashes on the training thread would cost what lean exists to save)."""
        if self.watch is not None:
            watched = next_level == LEVEL_FULL or (next_level != LEVEL_NONE and self.keyframes) or self.gradlog
            self.watch.after_update(self._watched() if watched else None)
        if "grads" in self.kinds:  # grads carried into the next iteration: a full record names them (carried.py)
            self.carried.after_update(self.layout.params if next_level == LEVEL_FULL else None)

    def outside(self, step: int) -> tuple[dict[str, int], list[str]]:
        """Before update ``step``: the recorded params' fingerprints, and the names of those changed
        outside the optimizer since the previous update (outside.py; nothing without a watch)."""
        if self.watch is None:
            return {}, []
        fps, changed = self.watch.before_update(step, self._watched())
        if self.foreign:  # their fingerprints now too: a lean row read at the forward may be stale (_as_now)
            fps = {**fps, **fingerprints({n: p for n, p in self.layout.params.items()
                                          if n in self.foreign and self.selected(n)})}
        return fps, changed

    def edits_state(self, outside: list[str]) -> dict[str, Any]:
        """A record's state keys for the params ``outside`` changed since the last update: their
        names, and what the update left in them (FORMAT.md); ``after_update`` is there, empty when
        nothing changed, wherever the record was compared with the last update's output."""
        out: dict[str, Any] = {STATE_KEY: outside} if outside else {}
        if self.watch is not None and self.watch.watched:  # present (maybe empty): the evidence it was watched
            out[STATE_AFTER_UPDATE] = self.watch.left(outside)
        return out

    def refresh_layout(self, model: torch.nn.Module, step: int,
                       begin: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The layout changes seen since the last record (:meth:`follow`), as the catalog meta that
        says so, to commit with record ``step`` (None: no change)."""
        self.follow(model, step, begin)
        meta, self._pending_meta = self._pending_meta, None
        return meta

    def follow(self, model: torch.nn.Module, step: int, begin: dict[str, Any] | None = None) -> None:
        """Follow ``optimizer.add_param_group`` and the model's structure (structure.py) in iteration
        ``step``: record ``step`` and on are named as the model and optimizer are now.

        A structure change keeps the earlier layout in meta ``layouts`` (until ``step``), completes
        ``begin``'s buffers with those the change added (their value now: the iteration's start, for
        a change made before its forward), and makes ``step`` a full record in a gradient log.
        """
        sizes = group_sizes(self.optimizer)
        moved = self.structure is not None and self.structure.take()
        if sizes == self._group_sizes and not moved:
            return
        old, self.layout = self.layout, build_layout(model, self.optimizer)  # fresh tensors either way
        change = structure_change(old, self.layout)
        if sizes != self._group_sizes:
            self._group_sizes = sizes
            log.info("stepdump: the optimizer's param groups changed at step %d; recording %d groups from here",
                     step, len(sizes))
        elif not change:
            return  # the same names (a buffer reassigned): nothing for the catalog
        if change:
            if not self._earlier or self._earlier[-1]["until"] != step:
                self._earlier.append({"until": step, **old.to_meta()})
            self.changed_at = step
            log.info("stepdump: the model's structure changed at step %d (%s); recording it as it is from here",
                     step, change.describe())
            if begin is not None and isinstance(begin.get("buffers"), dict) and "params" in self.kinds:
                kept = begin["buffers"]
                with torch.no_grad():
                    begin["buffers"] = {n: kept[n] if n in kept else b.detach().clone()
                                        for n, b in self.layout.buffers.items() if self.selected(n)}
            if self.watch is not None:
                # The previous update's fingerprints are by the old names: nothing is compared at this
                # step (a gradient log stores it in full; prune.remove's write is no update's output).
                self.watch.after_update(None)
        self._pending_meta = {**(self._pending_meta or {}), "layout": self.layout.to_meta(),
                              **({"layouts": list(self._earlier)} if self._earlier else {})}

    def entries(self, full: bool, buffers: dict[str, torch.Tensor] | None = None,
                state: dict[Any, dict[str, Any]] | None = None, step: int | None = None) -> list[Entry]:
        """The step's live tensors as entries (``state``: the optimizer's per-param state to read,
        None: ``optimizer.state`` now). ``step``: the lean
        step they are for, whose optimizer state is left out where the lean path will not read it."""
        if not full and not buffers and state is None:
            return self._stats_entries(step is None or not self.lean.enabled or self.lean.reads_optimizer(step))
        return tensor_entries(self.layout, self.optimizer, self.kinds, self.selected, full, buffers or {}, state)

    def _stats_entries(self, optimizer: bool = True) -> list[Entry]:
        """:func:`tensor_entries` of a stats-only step (nothing full, no buffers, the optimizer's state
        now), the same list, with the selected params and their entries made once per layout (a step
        of a small model paid a name match and a tuple per param for them). Not ``optimizer``: without
        the optimizer state (a lean step reads it every ``OPTIMIZER_EVERY`` steps; walking it cost a
        dict lookup through ``Tensor.__hash__`` and a tuple per tensor at every step). The entries
        made at every step are made by :func:`as_records` (no Python call per entry)."""
        layout, params, param_entries = self._selected_of
        if layout is not self.layout:
            params = [(n, p) for n, p in self.layout.params.items() if self.selected(n)]
            param_entries = [Entry("params", n, p, False) for n, p in params]
            self._selected_of = (self.layout, params, param_entries)
        out = list(param_entries) if "params" in self.kinds else []
        if "grads" in self.kinds:
            out += as_records(Entry, [("grads", n, g, False, None, None)
                                      for n, p in params if (g := p.grad) is not None])
        if optimizer and "optimizer" in self.kinds:  # walked again only where its objects changed (opt_walk.py)
            out += self._opt_walk(params, self.optimizer.state).entries
        return out

    def _full_state(self, opt_state: Mapping[Any, Mapping[str, Any]] | None) -> dict[str, Any]:
        """:func:`full_state` now, its optimizer extras walked again only where their objects changed."""
        layout, params = self._all_params_of
        if layout is not self.layout:
            params = list(self.layout.params.items())
            self._all_params_of = (self.layout, params)
        state = self.optimizer.state if opt_state is None else opt_state
        return full_state(self.layout, self.optimizer, self.scheduler, self.scaler, opt_state,
                          extra=self._extra_walk(params, state).extra)

    def fill(self, msg: StepMessage, acquire: Callable[[], Slot], full: bool, begin: dict[str, Any] | None,
             batch: Any, captured: list[tuple[str, str, torch.Tensor]]) -> bool:
        """Fill ``msg`` (tensors staged into the slot ``acquire`` gives, which sets ``msg.slot``; a
        stats-only step that stages nothing takes none): everything (``full``), or a stats-only
        record. True: the message waits for its grads' lean rows (``LeanCapture.finish``)."""
        before, self.state_before = self.state_before, None
        opt_state = before.state(msg.step) if before is not None else None
        fps, outside = self.outside(msg.step) if msg.step is not None else ({}, [])
        # A stats-only step of params and grads alone, as plain as the last (LeanCapture.steady).
        steady = (not full and not fps and not outside and opt_state is None and self._steady_kinds
                  and not self.gradlog and not self.keyframes and self.lean.enabled and msg.step is not None
                  and not self.lean.reads_optimizer(msg.step))
        if steady and self._lean_again(msg):
            msg.items = self._captured_items(captured, full)
            return False
        entries = self.entries(full, begin["buffers"] if (full or self.gradlog) and begin is not None else None,
                               opt_state, msg.step)
        if outside and not full:  # what replay cannot derive: stored at this step
            entries = [e._replace(full=True) if e.kind == "params" and e.name in outside else e for e in entries]
        if full:
            entries = self.frozen_entries(entries)
        if full or self.keyframes or self.gradlog or outside:
            state = self._full_state(opt_state) if full or self.gradlog else {}
            state.update(self.edits_state(outside))
            if full and "grads" in self.kinds:
                carried = [n for n in self.carried.before_update(self.layout.params) if self.selected(n)]
                if carried:  # their grads are this record's grads: restore sets them (carried.py)
                    state[STATE_CARRIED_GRADS] = carried
            # Extra state at full steps; a gradient log's other steps get its stats and fingerprints.
            extra = take_extra(self.extra, full, entries) if self.extra and (full or self.gradlog) else None
            msg.state_json = state_json(state, begin, batch, entries, extra, memo=self._state_memo)
        held = False
        if self.lean.enabled and not full:
            if self.gradlog or outside:
                # Stored in full: a gradient log's grads, and params marked full (changed outside the
                # optimizer). Tested inline, once per entry (a function call per entry and list cost a
                # gradient-log step of a small model a few hundred Python calls).
                gl = self.gradlog
                full_at = [(e.kind == "grads" and gl) or (e.kind == "params" and e.full) for e in entries]
                stored = stored_in_full([e for e, f in zip(entries, full_at) if f])
                lean = [e for e, f in zip(entries, full_at) if not f and e.kind in _LEAN_KINDS]
            else:  # nothing stored in full (no entry is full at a stats-only step): no call per tensor
                stored, lean = [], [e for e in entries if e.kind in _LEAN_KINDS]
            held = self.lean.take(msg, lean, fps, steady=self.layout if steady else None)
            if fps:
                self._as_now(msg, fps, entries)
            entries = stored + [e for e in entries if e.kind not in _LEAN_KINDS]
        else:
            self.lean.drop()  # a full step after all (a callable schedule): the early reads are not needed
        # A small gradient-log step: its bytes copied straight from the live tensors into memory of
        # their own (no slot: the step waits for the writer's next wake-up, capture/mailbox.py).
        # (lean.INLINE_BYTES read now, not bound at import: one knob, as lean.py reads it)
        limit = lean_mod.INLINE_BYTES if self.slot_budget is None else min(lean_mod.INLINE_BYTES, self.slot_budget)
        if entries and self.gradlog and not full and (copied := self._copier.direct(entries, limit)) is not None:
            msg.copied = copied
            msg.items = []
        # A gradient log's grads are written from the live tensors while the update runs.
        elif entries:
            slot = acquire()
            msg.items = self.stager.stage(slot, entries, defer=("grads",) if self.gradlog and not full else ())
            if self.gradlog and not full and slot.event is None:
                # A small gradient-log step: its bytes in memory of its own, so that the slot goes back
                # and the step waits for the writer's next wake-up (capture/mailbox.py) instead of waking it.
                # (lean.INLINE_BYTES read now, not bound at import: one knob, as lean.py reads it)
                msg.copied = self._copier(msg.items, lean_mod.INLINE_BYTES)
                if msg.copied is not None:
                    msg.items = []
        else:  # nothing to stage (a lean step's rows are read or copied already): no slot to take and give back
            msg.items = []
        msg.items.extend(self._captured_items(captured, full))
        return held

    def _captured_items(self, captured: list[tuple[str, str, torch.Tensor]], full: bool) -> list[Item]:
        """The items of the hooks' values (activations, the batch) at a step."""
        # Hook values are private copies already; no second staging copy. Keyframe and gradient-log
        # runs store the batch at every step, so any step can be replayed or re-executed.
        return [Item(kind, name, tensor, full or ((self.keyframes or self.gradlog) and kind == "inputs"))
                for kind, name, tensor in captured]

    def _lean_again(self, msg: StepMessage) -> bool:
        """Copy a stats-only step's params and grads at once where they are laid out as at the last
        step the lean path took whole (the layout's selected params, each with its grad, of the same
        types, dtypes, shapes and devices: LeanCapture.steady); False: take the general path."""
        layout, params, _ = self._selected_of
        if layout is not self.layout:
            return False
        ps = [p for _, p in params]
        gs = [g for p in ps if (g := p.grad) is not None]
        return len(gs) == len(ps) and self.lean.steady(msg, layout, ps + gs)

    def frozen_entries(self, entries: list[Entry]) -> list[Entry]:
        """A full record's entries with ``frozen="fingerprint"``: the params with ``requires_grad=False``
        get stats and a fingerprint, no bytes (``"once"``: the writer stores unchanged bytes once)."""
        if self.frozen != "fingerprint":
            return entries
        return [e._replace(full=False) if e.kind == "params" and not e.tensor.requires_grad else e for e in entries]

    def _as_now(self, msg: StepMessage, fps: dict[str, int], entries: list[Entry]) -> None:
        """Lean param rows read at the iteration's first forward that describe other bytes than the
        params entering the update (``fps``: theirs now) are computed again, from the params now."""
        # (xxh3 rows only: ``fps`` are xxh3; a dmix64 row was read at the pre-hook, from the params now.)
        stale = {r.name for r in msg.lean
                 if r.kind == "params" and r.fp_kind is None and r.name in fps and r.fp != fps[r.name]}
        if stale:
            msg.lean[:] = [r for r in msg.lean if not (r.kind == "params" and r.name in stale)]
            msg.lean.extend(lean_rows([e for e in entries if e.kind == "params" and e.name in stale], set()))
