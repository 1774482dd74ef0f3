"""What the framework callbacks share: a Recorder told when to record, resume checks, names."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepdump.capture.recorder import Recorder
from stepdump.core.layout import unwrap as unwrap_module
from stepdump.errors import ConfigError
from stepdump.store.format import CATALOG_FILE

log = logging.getLogger(__name__)


class ManualRecorder(Recorder):
    """A :class:`~stepdump.Recorder` that takes each record when told, not at the optimizer pre-hook.

    Lightning calls ``optimizer.step(closure)`` and the closure runs forward and
    backward *inside* ``step``, so the optimizer's step pre-hook fires before the
    last backward of the step. This Recorder hooks only the end of each update
    (the step post-hook: RNG and buffers for the next record); the caller calls
    :meth:`capture` at the moment the gradients are final and nothing is updated
    yet (Lightning's ``on_before_optimizer_step``).

    It is built on Recorder internals (``_attach``, ``_on_pre_step``,
    ``_on_step_done``); see docs/integrations.md for the public API this stands in for.
    """

    def _attach(self) -> None:
        # Only the post-hook: the pre-hook fires too early under a closure. No wrapping
        # of scaler.step either: a skipped step is reported through capture(skipped=True)
        # and finish_skipped().
        self._hooks.append(self.optimizer.register_step_post_hook(lambda o, a, k: self._on_step_done()))

    def capture(self, skipped: bool = False) -> int:
        """Record the current step now (grads final, params not yet updated); return its number."""
        t = self.step
        self._on_pre_step(skipped=skipped)
        return t

    def finish_skipped(self) -> None:
        """End a captured step whose ``optimizer.step()`` never ran (a GradScaler skip)."""
        self._on_step_done()


def found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a GradScaler that has unscaled ``optimizer`` found inf/NaN (so will skip its step).

    Reads the scaler's per-optimizer state, filled by ``scaler.unscale_``; False when
    there is no enabled scaler or it has not unscaled this optimizer yet.
    """
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return False
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
    found = state.get("found_inf_per_device") or {}
    return bool(sum(float(v.item()) for v in found.values()))


def check_resume(path: Path, start_step: int) -> None:
    """Refuse to append steps from ``start_step`` to a run that already has them, saying why."""
    if not (path / CATALOG_FILE).exists():
        return
    import stepdump

    with stepdump.open(path) as run:
        steps = run.all_steps
    if steps and steps[-1] >= start_step:
        raise ConfigError(
            f"{path} already holds steps up to {steps[-1]}, but training resumes from a checkpoint at step "
            f"{start_step}: steps {start_step}..{steps[-1]} were recorded after that checkpoint was saved. "
            "Record the resumed training into a new directory, or remove the old run first."
        )


def param_globs(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """fnmatch patterns that match exactly the parameters ``optimizer`` steps, by model name."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [_escape(n) for n, p in unwrap_module(model).named_parameters() if id(p) in mine]


def _escape(name: str) -> str:
    # fnmatch has no escape(); a special character inside brackets is literal.
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def scalar_items(logs: dict[str, Any], skip: Iterable[str] = ()) -> dict[str, float]:
    """The plain numbers in a framework's log dict (no bools, strings or nested values)."""
    skip = set(skip)
    return {
        k: float(v)
        for k, v in logs.items()
        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def unwrap(obj: Any, attr: str) -> Any:
    """Follow ``obj.<attr>`` through wrappers (Accelerate's optimizer/scheduler) to the torch object."""
    seen = 0
    while obj is not None and hasattr(obj, attr) and seen < 8:
        inner = getattr(obj, attr)
        if inner is None or inner is obj:
            break
        obj, seen = inner, seen + 1
    return obj
