"""``JointRun``: one view of a run recorded over several (model, optimizer) pairs.

The run is a directory with ``joint.json`` and one ordinary store per pair
(:mod:`stepdump.store.joint`, written by ``Recorder(path, models=, optimizers=)``);
:meth:`JointRun.pair` opens one pair's store as a plain :class:`~stepdump.read.run.Run`.
Step *t* is loop iteration *t* in every pair. The whole run answers:

* names, tensors, fingerprints and stats with each pair's names prefixed: ``G/fc.weight``;
* :meth:`~JointRun.state_dict` / :meth:`~JointRun.optimizer_state_dict` (and scheduler,
  scaler) of one pair: ``model="D"``, ``optimizer="D"``. A module two pairs share comes from
  the pair that updates first in the iteration (``joint.json`` ``model_of``);
* :meth:`~JointRun.scalars`: what ``rec.log`` received, unprefixed, and each pair's own
  recorded scalars (``lr``, ``grad_scale``, ``sys/*``) as ``<pair>/lr``;
* the RNG (the same in every pair: the loop iteration's start) and steps common to all pairs;
* :meth:`~JointRun.restore` of every pair at once, all checked before anything is changed.

``stores()`` yields ``(None, store)`` for each pair (so ``verify`` walks them all);
``stepdump.diff``, ``check`` and the report go pair by pair through :meth:`JointRun.pair_stores`.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from stepdump.errors import ConfigError, RestoreMismatchError, TensorNotFoundError
from stepdump.read.run import Run, StepRange, _as_step
from stepdump.store import joint as joint_file

if TYPE_CHECKING:
    import pandas as pd

#: Scalars a pair's Recorder logs by itself (capture/scalars.py); the reader prefixes them with the pair.
_OWN = re.compile(r"lr(/\d+)?|grad_scale|sys/.*")


def is_joint(run: Any) -> TypeGuard[JointRun]:
    """True for a run recorded over several (model, optimizer) pairs."""
    return isinstance(run, JointRun)


def _by_name_then_step(row: tuple[int, str, float | None]) -> tuple[str, int]:
    """The order of ``scalar_rows``: by name, then step."""
    step, name, _value = row
    return name, step


class JointRun:
    """A run recorded over named (model, optimizer) pairs; open with :func:`stepdump.open`.

    Attributes:
        path: The run directory.
        pair_names: The pairs, in the order the Recorder was given them.
        order: The order the pairs update in within an iteration (None: no full iteration recorded).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.doc = joint_file.read_local(self.path)
        self.pair_names: list[str] = list(self.doc["pairs"])
        self.order: list[str] | None = self.doc["order"]
        self._runs: dict[str, Run] = {}

    # -- pairs -------------------------------------------------------------------
    def pair(self, name: str) -> Run:
        """Pair ``name``'s store as a plain Run (its names unprefixed)."""
        if name not in self.pair_names:
            raise TensorNotFoundError(f"{self.path} has no pair {name!r}; its pairs are {self.pair_names}")
        run = self._runs.get(name)
        if run is None:
            run = self._runs[name] = Run(joint_file.pair_dir(self.path, name))
            run.foreign_source = lambda param, step: self._foreign(name, param, step)
        return run

    def _foreign(self, name: str, param: str, step: int) -> torch.Tensor:
        """Param ``param`` of pair ``name``'s record ``step`` that another pair's optimizer updates
        (meta ``joint_foreign``): that pair's record of it at the same moment. Nothing else changes it
        between the two records: the one after that pair's update of the iteration where that pair
        steps before ``name`` (the critic sees the trunk the actor just updated), else the same step."""
        owner, there = self.pair(name).meta["joint_foreign"][param]
        order = self.order or self.pair_names
        later = order.index(owner) < order.index(name) if owner in order and name in order else False
        return self.pair(owner).tensor(there, step + 1 if later else step, kind="params")

    def pair_stores(self) -> list[tuple[str, Run]]:
        """``(name, store)`` of every pair, in the Recorder's order."""
        return [(n, self.pair(n)) for n in self.pair_names]

    def stores(self) -> Iterator[tuple[int | None, Run]]:
        for _, run in self.pair_stores():
            yield None, run

    def _one(self, name: str | None, what: str) -> str:
        if name is None:
            if len(self.pair_names) == 1:
                return self.pair_names[0]
            raise ConfigError(f"this joint run holds {what}s {', '.join(self.pair_names)}: name one, "
                              f"e.g. {what}={self.pair_names[-1]!r}")
        self.pair(name)
        return name

    def _split(self, name: str) -> tuple[Run, str]:
        pair, sep, rest = name.partition("/")
        if not sep or pair not in self.pair_names:
            raise TensorNotFoundError(f"{name!r}: a joint run names tensors '<pair>/<name>' with a pair of "
                                      f"{self.pair_names} (e.g. {self.pair_names[0]!r}/fc.weight)")
        return self.pair(pair), rest

    # -- identity ---------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """The first pair's meta (how the run was recorded), less its layout, plus ``joint``:
        the pairs, their order and each pair's model and optimizer class."""
        meta = {k: v for k, v in self.pair(self.pair_names[0]).meta.items() if k != "layout"}
        meta["joint"] = {**self.doc, "classes": {n: {k: r.meta.get(k) for k in ("model_class", "optimizer_class",
                                                                            "scheduler_class")}
                                             for n, r in self.pair_stores()}}
        return meta

    @property
    def format_version(self) -> int:
        return self.pair(self.pair_names[0]).format_version

    # -- steps and names ----------------------------------------------------------
    def _common(self, attr: str) -> list[int]:
        sets = [set(getattr(r, attr)) for _, r in self.pair_stores()]
        return sorted(set.intersection(*sets))

    @property
    def steps(self) -> list[int]:
        """Steps every pair stored in full."""
        return self._common("steps")

    @property
    def stats_steps(self) -> list[int]:
        return self._common("stats_steps")

    @property
    def all_steps(self) -> list[int]:
        return self._common("all_steps")

    @property
    def skipped_steps(self) -> list[int]:
        """Steps where any pair's GradScaler skipped its update."""
        return sorted({s for _, r in self.pair_stores() for s in r.skipped_steps})

    @property
    def live(self) -> bool:
        return any(r.live for _, r in self.pair_stores())

    def kinds(self) -> list[str]:
        seen: dict[str, None] = {}
        for _, r in self.pair_stores():
            seen.update(dict.fromkeys(r.kinds()))
        return list(seen)

    def names(self, kind: str = "params") -> list[str]:
        return [f"{n}/{x}" for n, r in self.pair_stores() if kind in r.kinds() for x in r.names(kind)]

    # -- tensors and state ----------------------------------------------------------
    def tensor(self, name: str, step: int, kind: str = "params") -> torch.Tensor:
        run, rest = self._split(name)
        return run.tensor(rest, step, kind)

    def tensors(self, step: int, kind: str = "params") -> dict[str, torch.Tensor]:
        return {f"{n}/{k}": v for n, r in self.pair_stores() for k, v in r.tensors(step, kind).items()}

    def fingerprints(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], int]:
        wanted = None if kinds is None else list(kinds)
        return {(k, f"{n}/{x}"): fp for n, r in self.pair_stores() for (k, x), fp in r.fingerprints(step, wanted).items()}

    def fingerprint_kinds(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], str]:
        """Each pair's :meth:`Run.fingerprint_kinds`, names prefixed by the pair (as :meth:`fingerprints`)."""
        wanted = None if kinds is None else list(kinds)
        return {(k, f"{n}/{x}"): fk for n, r in self.pair_stores()
                for (k, x), fk in r.fingerprint_kinds(step, wanted).items()}

    def step_state(self, step: int) -> dict[str, Any]:
        """Each pair's recorded state at ``step``, by pair name."""
        return {n: r.step_state(step) for n, r in self.pair_stores()}

    def state_dict(self, step: int, model: str | None = None) -> OrderedDict[str, torch.Tensor]:
        """Pair ``model``'s ``model.state_dict()`` at the start of iteration ``step`` (a module two
        pairs share: as the first of them to update saw it, before any update of the iteration)."""
        name = self._one(model, "model")
        return self.pair(self.doc["model_of"][name]).state_dict(step)

    def optimizer_state_dict(self, step: int, optimizer: str | None = None) -> dict[str, Any]:
        """Pair ``optimizer``'s optimizer state before its update ``step``."""
        return self.pair(self._one(optimizer, "optimizer")).optimizer_state_dict(step)

    def scheduler_state_dict(self, step: int, scheduler: str | None = None) -> dict[str, Any] | None:
        return self.pair(self._one(scheduler, "scheduler")).scheduler_state_dict(step)

    def scaler_state_dict(self, step: int, scaler: str | None = None) -> dict[str, Any] | None:
        return self.pair(self._one(scaler, "scaler")).scaler_state_dict(step)

    def rng_state(self, step: int) -> dict[str, Any]:
        """The RNG at the start of loop iteration ``step`` (every pair holds the same)."""
        return self.pair(self.pair_names[0]).rng_state(step)

    # -- frames ---------------------------------------------------------------------
    def _rename(self, pair: str, scalar: str) -> str:
        return f"{pair}/{scalar}" if _OWN.fullmatch(scalar) else scalar

    def scalar_rows(self, steps: StepRange = None, *, nan_only: bool = False) -> list[tuple[int, str, float | None]]:
        """(step, name, value) of every scalar: logged ones as logged, each pair's own prefixed."""
        rows = [(s, self._rename(n, k), v) for n, r in self.pair_stores() for s, k, v in r.scalar_rows(
            steps, nan_only=nan_only) if n == self.pair_names[0] or _OWN.fullmatch(k)]
        return sorted(rows, key=_by_name_then_step)

    def scalars(self, names: str | Iterable[str] | None = None, steps: StepRange = None) -> pd.DataFrame:
        """One row per step, one column per scalar (see the module docstring), plus ``skipped``."""
        import pandas as pd

        pats = None if names is None else [names] if isinstance(names, str) else list(names)
        if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
            steps = list(steps)
        df = pd.DataFrame(self.scalar_rows(steps), columns=["step", "name", "value"])
        wide = df.pivot_table(index="step", columns="name", values="value", aggfunc="last", dropna=False)
        wide.columns.name = None
        keep = [c for c in wide.columns if (any(fnmatch.fnmatchcase(c, p) for p in pats) if pats is not None
                                            else "/sys/" not in f"/{c}")]
        wide = wide[keep]
        skipped = set(self.skipped_steps)
        index = sorted(set(wide.index) | set(self.all_steps))
        wide = wide.reindex(index)
        wide["skipped"] = [s in skipped for s in index]
        wide.index.name = "step"
        return wide

    def profile(self, steps: StepRange = None) -> pd.DataFrame:
        """Each pair's ``<pair>/sys/*`` timings and memory."""
        return self.scalars(names="*sys/*", steps=steps)

    def stats(self, kind: str | None = None, name: str | None = None, steps: StepRange = None) -> pd.DataFrame:
        """Every pair's stat rows, names prefixed with the pair."""
        import pandas as pd

        if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
            steps = list(steps)
        frames = []
        for n, r in self.pair_stores():
            if kind is not None and kind not in r.kinds():
                continue
            df = r.stats(kind, None, steps)
            df["name"] = n + "/" + df["name"].astype(str)
            frames.append(df if name is None else df[[fnmatch.fnmatchcase(x, name) for x in df["name"]]])
        return pd.concat(frames, ignore_index=True) if frames else self.pair(self.pair_names[0]).stats(kind, "", steps)

    def blob_bytes(self) -> tuple[int, int]:
        sizes = [r.blob_bytes() for _, r in self.pair_stores()]
        return sum(s for s, _ in sizes), sum(r for _, r in sizes)

    # -- acting on it -----------------------------------------------------------------
    def restore(self, step: int, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                *, rng: bool = True, extra_state: Any = None, models: Mapping[str, Any] | None = None,
                optimizers: Mapping[str, Any] | None = None, schedulers: Mapping[str, Any] | None = None,
                scalers: Mapping[str, Any] | None = None) -> None:
        """Load loop iteration ``step`` into every pair's live objects, by pair name.

        ``models`` must name every pair's model (a module two pairs share: the same object under
        both names); ``optimizers``, ``schedulers``, ``scalers`` the ones to restore. Every pair is
        checked before anything is changed (:func:`stepdump.read.restore.restore`); the RNG is set once.
        """
        if model is not None or optimizer is not None or scheduler is not None or scaler is not None:
            raise ConfigError("a joint run restores by pair name: run.restore(step, models={...}, optimizers={...})")
        if extra_state is not None:
            raise ConfigError("extra_state= is not recorded with a joint run yet; restore it from its own Recorder")
        step = _as_step(step)
        given = {"models": models or {}, "optimizers": optimizers or {}, "schedulers": schedulers or {},
                 "scalers": scalers or {}}
        for what, objs in given.items():
            if not isinstance(objs, Mapping):
                raise ConfigError(f"{what}= takes a dict by pair name, got {type(objs).__name__}")
            unknown = sorted(set(objs) - set(self.pair_names))
            if unknown:
                raise ConfigError(f"{what}= names {unknown}, which this run does not hold (pairs: {self.pair_names})")
        missing = [n for n in self.pair_names if n not in given["models"]]
        if missing:
            raise ConfigError(f"restore needs every pair's model: models= lacks {missing} (a module two pairs "
                              "share: give it under both names)")
        from stepdump.read.restore import prepare

        # A module two pairs share is loaded last from the pair whose record is its state (model_of).
        source = self.doc["model_of"]
        names = sorted(self.pair_names, key=lambda n: source[n] == n)
        loads = []
        for n in names:
            try:  # each read the pair's Run makes opens its own read scope
                loads.append(prepare(self.pair(n), step, given["models"][n], given["optimizers"].get(n),
                                     given["schedulers"].get(n), given["scalers"].get(n),
                                     rng=rng and n == self.pair_names[0]))
            except RestoreMismatchError as e:
                raise RestoreMismatchError(f"pair {n!r}: {e} (nothing was restored)") from e
        for load in loads:
            load()

    def export(self, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False,
               trainer: Mapping[str, Any] | None = None, rank: int | None = None, model: str | None = None) -> Path:
        """Write pair ``model``'s record of ``step`` as a checkpoint (see :meth:`Run.export`)."""
        return self.pair(self._one(model, "model")).export(step, path, format=format, grads=grads, trainer=trainer,
                                                           rank=rank)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        for run in self._runs.values():
            run.close()
        self._runs.clear()

    def __enter__(self) -> JointRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<stepdump.JointRun {self.path!s} pairs={self.pair_names}>"
