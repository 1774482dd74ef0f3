"""The final record: what ``Recorder.close()`` writes after the last update.

Record *t* holds the params *before* update *t*, so after optimizer steps
0..N-1 no ordinary record holds the trained model. ``close()`` writes record
*N*: params, module buffers (as they are at close), optimizer state, scheduler /
scaler state and the RNG state right after the last update, and no gradients
(update *N* never ran). It is stored in full whatever the schedule (a lean or
tiered run, a gradient log: there it is also the last keyframe) and named by
the catalog's ``meta.final_step`` so readers know why it has no grads.
A Recorder resumed into the run replaces it (docs/reliability.md).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from stepdump.capture.assemble import Assembler
from stepdump.capture.extra import take as take_extra
from stepdump.capture.handoff import WriterLink
from stepdump.capture.step_state import full_state, state_json, tensor_entries
from stepdump.capture.staging import StagingPool
from stepdump.capture.writer import StepMessage
from stepdump.core import rng as _rng
from stepdump.store.format import LEVEL_FULL

log = logging.getLogger(__name__)

class NumpyMt(NamedTuple):
    """numpy's global MT19937 as read from its C structs (core/rng.py): words, position, and the
    legacy Gaussian cache of its ``RandomState``."""

    words: bytes
    pos: int
    has_gauss: int
    gauss: float


@dataclass
class RngAfterUpdate:
    """The RNG state right after the latest update, taken cheaply at every optimizer post-hook.

    Code between the last update and ``close()`` (an evaluation with dropout, a data
    loader's shuffle) may draw random numbers; the final record needs the state from
    before that, the one the next iteration would have started from.
    """

    torch_cpu: torch.Tensor | None = None
    numpy: NumpyMt | None = None  # numpy's default MT19937, read from its structs (about 1.5 us)
    numpy_state: dict[str, Any] | None = None  # else core.rng.numpy_state (PCG64: ~5 us, Philox ~8 us)
    python: Any = None
    cuda: list[torch.Tensor] | None = None
    # Or the whole state as get_rng_state() read it at this same moment (keep()), where the iteration's
    # start state was taken right after the update anyway: one reading, not two.
    kept: dict[str, Any] | None = None

    def keep(self, rng: dict[str, Any]) -> None:
        """The RNG right after the latest update is ``rng`` (a :func:`~stepdump.core.rng.get_rng_state`
        reading made now, which nobody changes afterwards: it is held, not copied)."""
        self.kept = rng

    def take(self) -> None:
        # Taken at every update, not lazily at close(): nothing tells a draw since then from none but
        # reading the state again (a few us: torch's 5 KB state, numpy's words, Python's tuple).
        self.kept = None
        self.torch_cpu = torch.default_generator.get_state()  # torch.get_rng_state(), without its wrapper
        # numpy_mt reads words only from an MT19937 (None for another bit generator, whose struct differs).
        mt = _rng.numpy_mt()
        read_gauss, legacy = _rng.NP_GAUSS, np.random.mtrand._rand  # type: ignore[attr-defined]
        gauss = read_gauss(legacy) if mt is not None and read_gauss is not None else None
        if mt is not None and gauss is not None:
            self.numpy, self.numpy_state = NumpyMt(mt[0], mt[1], gauss[0], gauss[1]), None
        else:
            self.numpy, self.numpy_state = None, _rng.numpy_state()
        # Python's: the struct's bytes where they can be read (state() makes getstate()'s tuple of them).
        self.python = _rng.PY_MT() if _rng.PY_MT is not None else random.getstate()
        # CUDA initialised implies available (and is_available() is three Python calls on a CPU-only run).
        self.cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None

    def state(self) -> dict[str, Any]:
        """In :func:`stepdump.core.rng.get_rng_state`'s form."""
        from stepdump.core.rng import get_rng_state

        if self.kept is not None:
            return dict(self.kept)
        now = get_rng_state()  # anything not taken
        if self.torch_cpu is None:
            return now
        now["torch"] = self.torch_cpu
        # Read from the struct (core.rng.python_mt_reader), or random.getstate()'s tuple.
        now["python"] = (_rng.python_state(*self.python) if isinstance(self.python[0], bytes)
                         else _rng.python_getstate(self.python))
        # numpy as it was at the update (it may have been drawn from since), its Gaussian cache included.
        if self.numpy is not None:
            mt = self.numpy
            now["numpy"] = {"alg": "MT19937", "keys": torch.frombuffer(bytearray(mt.words), dtype=torch.uint32),
                            "pos": mt.pos, "has_gauss": mt.has_gauss, "cached_gaussian": mt.gauss}
        elif self.numpy_state is not None:
            now["numpy"] = self.numpy_state
        if self.cuda is not None:
            now["cuda"] = self.cuda
        return now


@dataclass
class FinalRecord:
    """When the final record is due, and what it holds.

    Args:
        first: The step the Recorder started at.
        replaced: The Recorder was resumed into recorded steps and dropped them (the
            previous final record among them): close() records the state it was given
            even if no update ran, so the run still ends with its model.
    """

    first: int
    replaced: bool = False
    rng: RngAfterUpdate = field(default_factory=RngAfterUpdate)

    def __post_init__(self) -> None:
        self.rng.take()  # no update yet: the state the Recorder starts from

    def due(self, step: int, captured_at: int | None, kinds: tuple[str, ...]) -> bool:
        """Whether close() at iteration ``step`` writes a final record: an update ran since the
        start (or recorded steps were replaced), record ``step`` was not taken yet (an update in
        progress), and there is params or optimizer state to record."""
        return ((step > self.first or self.replaced) and captured_at != step
                and any(k in kinds for k in ("params", "optimizer")))

    def message(self, asm: Assembler, model: torch.nn.Module, step: int, pool: StagingPool,
                link: WriterLink) -> StepMessage:
        """The final record ``step``'s message, its tensors staged into a slot of ``pool`` (``link``:
        the writer's, whose failure ends a wait for a free slot)."""
        meta = asm.refresh_layout(model, step) or {}  # add_param_group after the last record
        kinds = tuple(k for k in asm.kinds if k in ("params", "optimizer"))
        buffers = {n: b for n, b in asm.layout.buffers.items() if asm.selected(n)} if "params" in kinds else {}
        entries = asm.frozen_entries(tensor_entries(asm.layout, asm.optimizer, kinds, asm.selected, True, buffers))
        extra = take_extra(asm.extra, True, entries) if asm.extra else None
        state = full_state(asm.layout, asm.optimizer, asm.scheduler, asm.scaler)
        _, outside = asm.outside(step)  # changed since the last update: verify takes them as stored
        state.update(asm.edits_state(outside))
        msg = StepMessage(step=step, level=LEVEL_FULL, meta={**meta, "final_step": step})
        msg.state_json = state_json(state, {"rng": self.rng.state()}, None, entries, extra)
        msg.slot = slot = pool.acquire(lambda: link.error)
        try:
            msg.items = asm.stager.stage(slot, entries)
        except BaseException:
            pool.release(slot)  # never sent: the writer will not hand it back
            raise
        log.debug("stepdump: final record %d (%d tensors)", step, len(msg.items))
        return msg
