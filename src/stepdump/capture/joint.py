"""One run over several named (model, optimizer) pairs: ``Recorder(path, models=, optimizers=)``.

A GAN's generator and discriminator, actor-critic with two optimizers, teacher-student: one
Recorder, one run directory, one step counter. The run is the joint layout of
:mod:`stepdump.store.joint`: one ordinary store per pair under ``path/<name>``, each written
by a Recorder of its own (everything a single-model run does, each pair's store does), and
``joint.json`` naming the pairs. Record *t* of every pair is loop iteration *t*:

* each pair's params, grads and optimizer state are taken at its own optimizer's step
  pre-hook (the grads that update used, the params and state before it);
* the RNG and buffers are the loop iteration's start for every pair (capture/iteration.py:
  the Recorders of one loop take their start state again until the loop's first optimizer
  opens the next iteration), so every pair's record *t* holds the same RNG;
* scalars given to :meth:`JointRecorder.log` go to the iteration they were logged in,
  stored in the first pair's store (the reader shows them unprefixed, each pair's own ``lr``
  as ``<pair>/lr``).

**One update per optimizer per iteration, in one order.** The order is learned in iteration
0; the iteration advances when the loop's first optimizer steps again. An optimizer that
steps twice in one iteration (a WGAN critic's extra updates) or one that misses an iteration
is refused: recording stops with one warning naming it (``on_error="raise"``: a
:class:`stepdump.ConfigError` out of ``step()``); training goes on untouched. Record such a
loop with one Recorder per optimizer (each run counts its own updates).

**A param in two optimizers is refused** when the Recorder is built: its two records (before
each update) could not both be "the param at the start of the iteration". Two pairs may share
one module (actor-critic heads on one trunk, each head's params in one optimizer): its state
is restored from the pair that updates first in the iteration (``joint.json`` ``model_of``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stepdump.capture.recorder import Recorder
from stepdump.core.layout import unwrap
from stepdump.errors import ConfigError, RunExistsError
from stepdump.store import joint as joint_file
from stepdump.store.format import CATALOG_FILE
from stepdump.store.fsspec_storage import is_url

log = logging.getLogger(__name__)

REFUSED = ("a joint run records each optimizer's update once per loop iteration, in one order; record a loop "
           "whose optimizers step a different number of times (a WGAN critic's k updates per generator "
           "update) with one Recorder per optimizer (docs/recipes/gan-and-multi-model-loops.md)")


def _pairs(models: Any, optimizers: Any, schedulers: Any, scalers: Any) -> list[tuple[str, Any, Any, Any, Any]]:
    """(name, model, optimizer, scheduler, scaler) of each pair, checked; in the order of ``models``."""
    for what, value in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers),
                        ("scalers", scalers)):
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{what}= takes a dict by pair name, e.g. {what}={{'G': ..., 'D': ...}}; "
                              f"got {type(value).__name__}")
    if not models or not optimizers:
        raise ConfigError("a joint run needs models= and optimizers=, dicts with the same names "
                          "(models={'G': netG, 'D': netD}, optimizers={'G': opt_g, 'D': opt_d})")
    names = [joint_file.check_pair_name(n) for n in models]
    if set(optimizers) != set(names):
        raise ConfigError(f"models= names {sorted(names)} and optimizers= names {sorted(optimizers)} differ; "
                          "give one optimizer per model, under the same name")
    for what, value in (("schedulers", schedulers), ("scalers", scalers)):
        unknown = sorted(set(value or {}) - set(names))
        if unknown:
            raise ConfigError(f"{what}= names {unknown} are not pairs of this run (pairs: {names})")
    owner: dict[int, str] = {}
    for name in names:
        for group in getattr(optimizers[name], "param_groups", []):
            for p in group["params"]:
                other = owner.setdefault(id(p), name)
                if other != name:
                    raise ConfigError(
                        f"a parameter of shape {tuple(p.shape)} is in the optimizers of both {other!r} and {name!r}; "
                        "a joint run records each param with the one optimizer that updates it (its two records, "
                        "before each update, cannot both be its state at the start of the iteration). Give each "
                        "param to one optimizer, or record the two optimizers with one Recorder each")
    return [(n, models[n], optimizers[n], (schedulers or {}).get(n), (scalers or {}).get(n)) for n in names]


class JointRecorder(Recorder):
    """The Recorder of a joint run; built by ``stepdump.Recorder(path, models=..., optimizers=...)``.

    ``pairs``: each pair's own Recorder (into ``path/<name>``), by name. Every other option of
    :class:`~stepdump.Recorder` applies to each pair alike, except ``ranks=`` and a URL path
    (a joint run is recorded by one process into a local directory) and ``auto_capture=False``.
    """

    def __init__(self, path: str | os.PathLike[str], model: Any = None, optimizer: Any = None,
                 scheduler: Any = None, scaler: Any = None, *, models: Mapping[str, Any] | None = None,
                 optimizers: Mapping[str, Any] | None = None, schedulers: Mapping[str, Any] | None = None,
                 scalers: Mapping[str, Any] | None = None, **options: Any) -> None:
        if any(x is not None for x in (model, optimizer, scheduler, scaler)):
            raise ConfigError("give either model/optimizer (one pair) or models=/optimizers= (a joint run), not both")
        if is_url(path):
            raise ConfigError(f"a joint run is recorded into a local directory, not {os.fspath(path)!r}; record "
                              "locally and upload the directory")
        if options.get("ranks", "all") != "all" or (torch.distributed.is_available()
                                                    and torch.distributed.is_initialized()):
            raise ConfigError("a joint run is recorded by one process; under torch.distributed record one "
                              "Recorder per optimizer")
        if options.get("auto_capture", True) is not True:
            raise ConfigError("a joint run takes its records at each optimizer's step hooks: leave auto_capture out")
        pairs = _pairs(models, optimizers, schedulers, scalers)
        self.path = Path(path)
        self._names = [p[0] for p in pairs]
        doc = self._check_dir(bool(options.get("resume", False)), self._names)
        self._module_ids = {n: id(unwrap(m)) for n, m, *_ in pairs}
        self._order: list[str] | None = doc["order"] if doc is not None else None
        self._done: list[str] = []
        self._closed = False
        self.pairs: dict[str, Recorder] = {}
        # Each pair's store is a directory of the run, never a link planted there (it would build
        # or append to a store elsewhere); checked before joint.json is written.
        dirs = {name: joint_file.pair_dir(self.path, name) for name in self._names}
        self._write_doc()
        try:
            for name, m, opt, sched, scal in pairs:
                rec = Recorder(dirs[name], m, opt, sched, scal, **options)
                rec._joint = self
                self.pairs[name] = rec
        except BaseException:
            for rec in self.pairs.values():
                rec.close()
            raise
        self._share()
        first = self.pairs[self._names[0]]
        self.options, self.recording, self.kinds = first.options, first.recording, first.kinds

    def _share(self) -> None:
        """Tell each pair which params of its model another pair's optimizer updates (pairs sharing a
        module): their changes between its updates are not edits outside the optimizer (assemble.py)."""
        owner: dict[int, tuple[str, str]] = {}  # id(param) -> (pair whose optimizer steps it, its name there)
        for name, rec in self.pairs.items():
            layout = rec._asm.layout
            for group in layout.groups:
                for n in group:
                    owner.setdefault(id(layout.params[n]), (name, n))
        for name, rec in self.pairs.items():
            foreign = {n: owner[id(p)] for n, p in rec._asm.layout.params.items()
                       if id(p) in owner and owner[id(p)][0] != name}
            if foreign:
                rec._asm.share(foreign)

    def _check_dir(self, resume: bool, names: list[str]) -> dict[str, Any] | None:
        if (self.path / CATALOG_FILE).exists():
            raise RunExistsError(f"{self.path} holds a single-model run; record the joint run into another directory")
        if os.path.lexists(self.path / joint_file.JOINT_FILE):  # a link there is refused (read_local)
            doc = joint_file.read_local(self.path)
            if not resume:
                raise RunExistsError(f"{self.path} already holds a joint run; pass resume=True to record on into it, "
                                     "or use another directory")
            if doc["pairs"] != names:
                raise ConfigError(f"{self.path} holds a joint run of pairs {doc['pairs']}; this Recorder has {names}. "
                                  "Give the same pairs, in the same order")
            return doc
        return None

    def _write_doc(self) -> None:
        # Pairs sharing one module: its state is the one the first to update saw (before any update).
        firsts: dict[int, str] = {}
        for n in self._order or self._names:
            firsts.setdefault(self._module_ids[n], n)
        model_of = {n: firsts[self._module_ids[n]] for n in self._names}
        joint_file.write_local(self.path, joint_file.joint_document(self._names, self._order, model_of))

    # -- public API --------------------------------------------------------
    @property
    def step(self) -> int:
        """The loop iteration in progress (the pair that has updated least is still in it)."""
        return min(r.step for r in self.pairs.values())

    def log(self, **scalars: Any) -> None:
        """Record scalars for the loop iteration in progress (stored with the first pair's record)."""
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        self.pairs[self._names[0]].log(**scalars)

    def log_batch(self, batch: Any) -> None:
        """Record the batch of the iteration (kept with the first pair's record)."""
        if self._closed:
            raise ConfigError("this Recorder is closed; create a new one to record more")
        self.pairs[self._names[0]].log_batch(batch)

    def begin_iteration(self, rng: dict[str, Any] | None = None) -> None:
        """Take every pair's start-of-iteration state again (see :meth:`Recorder.begin_iteration`)."""
        for rec in self.pairs.values():
            rec.begin_iteration(rng)

    def capture(self, *, skipped: bool = False, optimizer_state: Any = None) -> int:
        raise ConfigError("a joint run takes each pair's record at its optimizer's step hooks; call capture() on "
                          "one pair's Recorder (rec.pairs[name]) only if you built it with auto_capture=False")

    def end_step(self) -> None:
        raise ConfigError("a joint run ends each pair's update at its optimizer's step post-hook")

    def close(self) -> None:
        """Close every pair's Recorder (each writes its final record)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for rec in self.pairs.values():
            try:
                rec.close()
            except BaseException as e:  # close the others before raising the first failure
                errors.append(e)
        if errors:
            raise errors[0]

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.pairs.values())

    def __repr__(self) -> str:
        where = "closed" if self._closed else f"at step {self.step}"
        return f"<stepdump.Recorder {self.path!s} (joint: {', '.join(self._names)}) {where}>"

    # -- called by a pair's Recorder as its update begins --------------------
    def update_starting(self, rec: Recorder) -> None:
        """Pair ``rec`` takes its record: check it is the pair due next in this iteration."""
        name = next(n for n, r in self.pairs.items() if r is rec)
        if self._order is not None:
            due = self._order[len(self._done)]
            if name != due:
                self._refuse(f"optimizer {name!r} stepped where {due!r} was due (iteration {rec.step}; "
                             f"the order learned in iteration 0 is {self._order})")
        elif name in self._done:
            missing = [n for n in self._names if n not in self._done]
            self._refuse(f"optimizer {name!r} stepped again in iteration {rec.step - 1 if rec.step else 0} before "
                         f"{', '.join(map(repr, missing))} stepped")
        self._done.append(name)
        if len(self._done) == len(self._names):
            if self._order is None:
                self._order = list(self._done)
                self._write_doc()
            self._done = []

    def _refuse(self, what: str) -> None:
        err = ConfigError(f"{what}: {REFUSED}")
        if not self.options.on_error == "raise":
            for r in self.pairs.values():
                if not r._guard.stopped:
                    r._guard.fail(err, "joint run", r.step, r._link.last_step)
        raise err
