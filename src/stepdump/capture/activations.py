"""Module hooks: activations, their gradients and the inputs of the root module.

Names:
* ``activations`` / ``activation_grads``: the module's name (``encoder.0.attn``);
  outputs that are tuples, lists or dicts are flattened with stable paths
  (``encoder.0.attn/0``, ``head/logits``); a module called several times in
  one step gets ``#1``, ``#2``, ... on its later calls (``block#1/0``).
* ``inputs``: ``args/0``, ``kwargs/mask`` for what the root module received
  (``#k`` on later calls, e.g. micro-batches), ``batch/...`` for ``log_batch``.

Values are copied inside the hook, so in-place ops after it do not change what
is recorded. Forward passes with autograd off (``torch.no_grad()``, evaluation)
are not part of a training step and are ignored.

A forward run under a ``torch.func`` transform (``vmap``, ``grad``: MAML's inner loop) hands
the hooks functorch's wrapped tensors, which have no storage of their own to copy: such a call
is skipped (one warning for the run) and takes no ``#k`` index; plain forwards of the same
step are captured as usual.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stepdump.capture.handles import Hook
from stepdump.capture.profiling import span
from stepdump.core.layout import unwrap
from stepdump.core.nested import flatten

log = logging.getLogger(__name__)

Captured = tuple[str, str, torch.Tensor]  # kind, name, tensor (a private copy)


class ModuleCapture:
    """Forward hooks on the selected modules and the root; collects one step's entries."""

    def __init__(self, model: nn.Module, kinds: tuple[str, ...], modules: str | list[str],
                 active: Callable[[], bool], on_error: Callable[[Exception, str], None] | None = None) -> None:
        self.kinds = kinds
        self._active = active
        # Do no harm: a failure inside a hook goes to the Recorder's policy, not out of forward/backward.
        self._on_error = on_error
        self._entries: list[Captured] = []
        self._calls: dict[tuple[str, str], int] = {}
        self._handles: list[Any] = []
        self.unsupported: str | None = None
        self.matched: list[str] = []  # the modules whose outputs are hooked (re-execution refuses none)
        self._skipped_wrapped = False  # a torch.func-transformed call was skipped (warned once)
        patterns = [modules] if isinstance(modules, str) else list(modules)
        root = unwrap(model)  # torch.compile wraps the module
        if isinstance(root, torch.jit.ScriptModule):
            self.unsupported = (
                "activation and input capture need Python forward hooks, which TorchScript modules do not run; "
                "recording params, grads and optimizer state only"
            )
            log.warning("stepdump: %s", self.unsupported)
            return
        if "activations" in kinds or "activation_grads" in kinds:
            for name, mod in root.named_modules():
                if name and any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    self.matched.append(name)
                    self._handles.append(mod.register_forward_hook(Hook(self._make_hook(name))))
        if "inputs" in kinds:
            # Hooks: a deepcopy or pickle of the model never carries this capture along (handles.py).
            self._handles.append(root.register_forward_pre_hook(Hook(self._on_root_input), with_kwargs=True))

    # -- hooks -----------------------------------------------------------------
    def _indexed(self, kind: str, name: str) -> str:
        n = self._calls.get((kind, name), 0)
        self._calls[(kind, name)] = n + 1
        return name if n == 0 else f"{name}#{n}"

    def _make_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or not self._handles or not self._active():
                return
            try:
                with span("stepdump.activations"):  # a no-op unless a torch profiler is on
                    if self._wrapped(flatten(output, name), f"module {name!r}"):
                        return
                    base = self._indexed("activations", name)
                    for path, t in flatten(output, base):
                        if "activations" in self.kinds:
                            self._keep("activations", path, t)
                        if "activation_grads" in self.kinds and t.requires_grad:
                            t.register_hook(Hook(self._grad_hook(path)))
            except Exception as e:  # noqa: BLE001 - do no harm
                self._failed(e, f"forward hook of module {name!r}")

        return hook

    def _wrapped(self, tensors: Any, where: str) -> bool:
        """True when any of ``tensors`` (``(path, tensor)`` pairs) is a torch.func wrapper: the call is
        skipped, with one warning for the run (the rest of the record goes on)."""
        if not any(_is_wrapped(t) for _, t in tensors):
            return False
        if not self._skipped_wrapped:
            self._skipped_wrapped = True
            log.warning("stepdump: the %s ran under a torch.func transform (vmap / grad / jvp): its tensors are "
                        "functorch wrappers with no storage to copy, so activations and inputs of such calls are "
                        "not recorded; plain forwards, params, grads and optimizer state are", where)
        return True

    def _failed(self, err: Exception, where: str) -> None:
        if self._on_error is None:
            raise err
        self._on_error(err, where)

    def _grad_hook(self, path: str) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            # None keeps the gradient as it is: a tensor hook's return value replaces it.
            if not self._handles or not self._active():
                return
            try:
                self._keep("activation_grads", path, grad)
            except Exception as e:  # noqa: BLE001 - do no harm
                self._failed(e, f"gradient hook of {path!r}")

        return on_grad

    def _on_root_input(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled() or not self._handles or not self._active():
            return
        try:
            self._root_input(args, kwargs)
        except Exception as e:  # noqa: BLE001 - do no harm
            self._failed(e, "forward pre-hook of the model")

    def _root_input(self, args: Any, kwargs: Any) -> None:
        if self._wrapped([*flatten(args, "args"), *flatten(kwargs, "kwargs")], "model's forward"):
            return
        call = self._indexed("inputs", "root")
        suffix = "" if call == "root" else call[len("root"):]
        for path, t in flatten(args, "args"):
            self.add_input(path + suffix, t)
        for path, t in flatten(kwargs, "kwargs"):
            self.add_input(path + suffix, t)

    # -- used by the Recorder ------------------------------------------------
    def add_input(self, name: str, t: torch.Tensor) -> None:
        self._keep("inputs", name, t)

    def _keep(self, kind: str, name: str, t: torch.Tensor) -> None:
        # A private copy now: the training may change the tensor in place before the record is taken.
        self._entries.append((kind, name, t.detach().clone()))

    def log_batch(self, batch: Any) -> Any:
        """Record ``batch`` under ``batch/<path>``; return its skeleton for replay on the first call.

        The skeleton is the batch's structure with tensors as ``$tensor`` references
        to their ``inputs`` names; later calls (micro-batches) get ``#k`` and no skeleton.
        """
        from stepdump.core import tjson
        from stepdump.errors import ConfigError

        call = self._indexed("inputs", "batch")
        suffix = "" if call == "batch" else call[len("batch"):]
        names: list[str] = []

        def put(ref: str, t: torch.Tensor) -> None:
            names.append(input_name(ref) + suffix)
            self.add_input(names[-1], t)

        skeleton = tjson.encode(batch, put)
        if not names:
            raise ConfigError("log_batch() found no tensors in what it was given (tuples, lists, dicts of tensors)")
        return None if suffix else rename_refs(skeleton)

    def take(self) -> list[Captured]:
        """Hand over what this iteration captured and start the next one."""
        entries, self._entries = self._entries, []
        self._calls.clear()
        return entries

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._entries = []


def _is_wrapped(t: torch.Tensor) -> bool:
    """A functorch wrapper (BatchedTensor, GradTrackingTensor): what a module sees under ``torch.func``."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def input_name(ref: str) -> str:
    """tjson ref of a tensor inside a batch -> its ``inputs`` name (``batch``, ``batch/0``, ``batch/x``)."""
    return "batch" if ref == "value" else "batch" + ref


def rename_refs(tree: Any) -> Any:
    """Point a batch skeleton's ``$tensor`` refs at the ``inputs`` names log_batch used."""
    if isinstance(tree, list):
        return [rename_refs(v) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$tensor"}:
            return {"$tensor": input_name(tree["$tensor"])}
        return {k: rename_refs(v) for k, v in tree.items()}
    return tree
