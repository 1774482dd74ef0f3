"""An op-level tracer: every ATen op one iteration runs, with fingerprints of its inputs and outputs.

Used by re-execution (:mod:`stepdump.reexec`) to name the op that makes two executions of the
same step part (nondeterminism, a port that differs from its reference) and the first op whose
output holds a NaN or an Inf.

Why a small ``TorchDispatchMode`` of our own and not ``torch.utils._debug_mode.DebugMode``
(docs/reexecute.md): DebugMode is private (its name, hooks and log format changed in each of the
releases that have it), it hashes tensors with a float norm (``norm_hash_fn``), which two tensors
that differ in one low bit can share, and it keeps strings of every call. Here a verdict needs
bitwise fingerprints (the same xxh3 as the store's, :mod:`stepdump.core.hashing`), the module
path and the user's source line of each op, and the first non-finite output with its inputs'
stats; that is ~150 lines on the public ``torch.utils._python_dispatch.TorchDispatchMode``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stepdump.core.hashing import fingerprint

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/stepdump


@dataclass
class OpRecord:
    """One op as it ran: its name, where (module path, phase, source line), and fingerprints."""

    index: int
    op: str  # "aten.addmm.default"
    module: str  # the innermost module running it ("" at the top level); in backward, the autograd node
    phase: str  # "forward" (autograd recording or not) or "backward"
    source: str  # "file.py:123" of the first frame outside torch and stepdump; "" if none
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    nonfinite: bool = False  # an output holds a NaN or an Inf
    input_stats: list[dict[str, Any]] = field(default_factory=list)  # for the first non-finite op only

    def where(self) -> str:
        place = f"module {self.module!r}" if self.module else "the top level"
        if self.phase == "backward":
            place = f"backward ({self.module})" if self.module else "backward"
        return f"{self.op} in {place}" + (f" at {self.source}" if self.source else "")


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _fp(t: torch.Tensor) -> int:
    try:
        return fingerprint(t)
    except Exception:  # a tensor without plain bytes (meta, nested): its shape stands in
        return hash((tuple(t.shape), str(t.dtype)))


def _nonfinite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.layout != torch.strided:
        return False
    return not bool(torch.isfinite(t).all())


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and (for floating tensors) min / max / mean of the finite values and the
    NaN / Inf counts: what an op's inputs looked like."""
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    if t.is_floating_point() and t.layout == torch.strided and t.numel():
        x = t.detach().float()
        finite = x[torch.isfinite(x)]
        out.update(nan=int(torch.isnan(x).sum()), inf=int(torch.isinf(x).sum()))
        if finite.numel():
            out.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()))
    return out


def _source() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _OWN_DIR)) and "<frozen" not in name:
            return f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return ""


class OpTracer(TorchDispatchMode):
    """Record every ATen op run inside ``with tracer.tracing(model):`` (``source``: also the user's
    source line of each op, a walk up the Python stack per op)."""

    def __init__(self, *, source: bool = True) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self.first_nonfinite: OpRecord | None = None
        self._stack: list[str] = []
        self._source = source

    @contextmanager
    def tracing(self, model: nn.Module | None = None) -> Iterator[OpTracer]:
        """Trace while the block runs, with ``model``'s module paths (hooks removed after)."""
        handles = []
        if model is not None:
            for name, mod in model.named_modules():
                handles.append(mod.register_forward_pre_hook(self._enter(name or "<root>")))
                handles.append(mod.register_forward_hook(self._leave, always_call=True))
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ins = _tensors((args, kwargs))
        in_fps = tuple(_fp(t) for t in ins)
        out = func(*args, **kwargs)
        outs = _tensors(out)
        node = torch._C._current_autograd_node()
        if node is not None:
            phase, module = "backward", node.name()
        else:
            phase, module = "forward", self._stack[-1] if self._stack else ""
        name = str(func)
        # Uninitialised memory (empty, empty_like, new_empty, empty_strided) holds whatever was
        # there: its shape and dtype are the op's output; the bytes are filled by a later op.
        blank = name.startswith(("aten.empty", "aten.new_empty"))
        rec = OpRecord(index=len(self.records), op=name, module=module, phase=phase,
                       source=_source() if self._source else "", inputs=in_fps,
                       outputs=tuple(hash((tuple(t.shape), str(t.dtype))) if blank else _fp(t) for t in outs))
        if self.first_nonfinite is None and not blank and any(_nonfinite(t) for t in outs):
            rec.nonfinite = True
            rec.input_stats = [tensor_stats(t) for t in ins]
            self.first_nonfinite = rec
        self.records.append(rec)
        return out


def first_op_difference(a: list[OpRecord], b: list[OpRecord]) -> tuple[OpRecord, OpRecord, str] | None:
    """The first op whose output differs between two traces of the same step while its inputs are
    equal, with a reason; None when every op agrees. Where the op sequences part (another op at
    the same index), that op is named instead."""
    first_out: tuple[OpRecord, OpRecord, str] | None = None
    for ra, rb in zip(a, b):
        if ra.op != rb.op:
            return ra, rb, f"the op sequences part at op #{ra.index}: {ra.op} here, {rb.op} there"
        if ra.outputs != rb.outputs:
            if ra.inputs == rb.inputs:
                return ra, rb, "same inputs, different output"
            first_out = first_out or (ra, rb, "different inputs and output (no op with equal inputs differs)")
    if first_out is None and len(a) != len(b):
        n = min(len(a), len(b))
        longer = a if len(a) > n else b
        return longer[n], longer[n], f"one trace has {len(a)} ops, the other {len(b)}"
    return first_out
