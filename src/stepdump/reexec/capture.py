"""Retroactive capture: activations and activation grads of modules picked by glob, taken while a
recorded step is re-executed (``reexecute(..., activations=[...], activation_grads=[...])``).

The hooks, the glob matching and the names are the Recorder's own
(:class:`stepdump.capture.activations.ModuleCapture`): ``fc1``, ``block/0`` for a tuple output,
``block#1`` for a module's second call in the iteration (micro-batches), so a re-executed
activation has the name the Recorder would have given it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from stepdump.capture.activations import ModuleCapture
from stepdump.core.layout import unwrap
from stepdump.errors import ConfigError

Captured = dict[str, dict[str, torch.Tensor]]  # kind ("activations", "activation_grads") -> name -> tensor


def module_globs(value: str | Iterable[str] | None, what: str) -> list[str]:
    """``activations=`` / ``activation_grads=`` as a list of globs (None: none)."""
    if value is None:
        return []
    globs = [value] if isinstance(value, str) else list(value)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ConfigError(f"{what}={value!r}: give a module-name glob or a list of them (e.g. 'blocks.*.attn')")
    return globs


@contextmanager
def capturing(model: torch.nn.Module, activations: list[str], activation_grads: list[str]) -> Iterator[Captured]:
    """Hook the modules matching the globs while the block runs; the dict yielded is filled with
    what they saw when the block ends (copies taken inside the hooks, as the Recorder takes them)."""
    out: Captured = {"activations": {}, "activation_grads": {}}
    caps: list[ModuleCapture] = []
    try:
        for kind, globs in (("activations", activations), ("activation_grads", activation_grads)):
            if not globs:
                continue
            # on_error None: a failing hook raises; a re-execution is not the user's training.
            cap = ModuleCapture(model, (kind,), globs, active=lambda: True)
            caps.append(cap)
            if cap.unsupported:
                raise ConfigError(f"cannot capture {kind} during re-execution: {cap.unsupported}")
            if not cap.matched:
                names = [n for n, _ in unwrap(model).named_modules() if n]
                raise ConfigError(f"{kind.replace('_', ' ')}={globs!r} match no module of the model (its modules: "
                                  f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
        yield out
        for cap in caps:
            for kind, name, t in cap.take():
                out[kind][name] = t
    finally:
        for cap in caps:
            cap.remove()
