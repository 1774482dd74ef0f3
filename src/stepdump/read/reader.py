"""``RunReader``: what every kind of opened run answers, local, remote or multi-rank.

:func:`stepdump.open` returns one of :class:`~stepdump.read.run.Run` (a local
store), :class:`~stepdump.read.remote.RemoteRun` (a store at a URL) or
:class:`~stepdump.read.ranked.DistributedRun` (one store per rank). Code that
reads a run (the analyses, the CLI) takes a ``RunReader`` and never asks which
kind it has. What is about one store (``verify``, the ``check`` rules, ``diff``)
iterates :meth:`RunReader.stores`: one ``(None, run)`` for a single store,
``(rank, run)`` for each rank of a multi-rank run.

A multi-rank run answers for the whole job: full (unsharded) tensors and state
dicts, every rank's stats with a ``rank`` column, the primary rank's steps,
names and scalars; its methods take ``rank=`` to ask one rank.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from stepdump.store.queries import StepRange

if TYPE_CHECKING:  # only in annotations; importing pandas costs ~0.3 s
    import pandas as pd

    from stepdump.read.run import Run

__all__ = ["RunReader", "ranked_stores"]


@runtime_checkable
class RunReader(Protocol):
    """The public reading interface of a recorded run (see the module docstring).

    ``isinstance(x, RunReader)`` works (the Protocol is runtime-checkable), and
    mypy checks that Run, RemoteRun and DistributedRun each satisfy it.
    """

    @property
    def path(self) -> Path | str:
        """Where the run is (a directory; a URL for a multi-rank run read remotely)."""

    @property
    def meta(self) -> dict[str, Any]:
        """The catalog's meta: how the run was recorded (FORMAT.md)."""

    @property
    def format_version(self) -> int:
        """The store format the run is written in."""

    # -- steps and names ------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Steps stored in full."""

    @property
    def stats_steps(self) -> list[int]:
        """Steps with stats and fingerprints."""

    @property
    def all_steps(self) -> list[int]:
        """Every optimizer step recorded."""

    @property
    def skipped_steps(self) -> list[int]:
        """Steps the GradScaler skipped."""

    @property
    def live(self) -> bool:
        """True while a Recorder is still writing the run (False for a URL: unknown)."""

    def kinds(self) -> list[str]: ...

    def names(self, kind: str = "params") -> list[str]: ...

    # -- tensors and state ----------------------------------------------------
    def tensor(self, name: str, step: int, kind: str = "params") -> torch.Tensor: ...

    def tensors(self, step: int, kind: str = "params") -> dict[str, torch.Tensor]: ...

    def fingerprints(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], int]: ...

    def fingerprint_kinds(self, step: int, kinds: Iterable[str] | None = None) -> dict[tuple[str, str], str]: ...

    def step_state(self, step: int) -> dict[str, Any]: ...

    def state_dict(self, step: int) -> OrderedDict[str, torch.Tensor]: ...

    def optimizer_state_dict(self, step: int) -> dict[str, Any]: ...

    def scheduler_state_dict(self, step: int) -> dict[str, Any] | None: ...

    def scaler_state_dict(self, step: int) -> dict[str, Any] | None: ...

    def rng_state(self, step: int) -> dict[str, Any]: ...

    # -- frames ---------------------------------------------------------------
    def scalars(self, names: str | Iterable[str] | None = None, steps: StepRange = None) -> pd.DataFrame: ...

    def scalar_rows(self, steps: StepRange = None, *,
                    nan_only: bool = False) -> list[tuple[int, str, float | None]]: ...

    def stats(self, kind: str | None = None, name: str | None = None, steps: StepRange = None) -> pd.DataFrame: ...

    def profile(self, steps: StepRange = None) -> pd.DataFrame: ...

    def blob_bytes(self) -> tuple[int, int]:
        """(stored, raw) bytes of tensor data, over every store of the run."""

    # -- acting on it ---------------------------------------------------------
    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                *, rng: bool = True, extra_state: Any = None) -> None: ...

    def export(self, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False,
               trainer: Mapping[str, Any] | None = None, rank: int | None = None) -> Path: ...

    def stores(self) -> Iterator[tuple[int | None, Run]]:
        """The run's stores as ``(rank, run)``: ``(None, self)`` for a single store, one per
        recorded rank (each a plain Run) for a multi-rank run."""

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> None: ...


def ranked_stores(run: RunReader) -> list[tuple[int, Run]]:
    """``(rank, store)`` of each rank of a multi-rank run, in rank order; empty for a single store."""
    return [(r, store) for r, store in run.stores() if r is not None]
