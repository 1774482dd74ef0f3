"""Why a gradient-log rebuild fails: why a run's updates cannot be re-applied here at all
(:func:`refusal_of`), and why re-applied updates do not reproduce their record
(:func:`mismatch_cause`: the cause the run and this host point at, said once, instead of a list
of everything that could ever do it).

Re-applying recorded updates reproduces the record bit for bit when (1) the same kernels run the
update (torch version, CPU capability, BLAS: a difference rounds differently), (2) the params
entering each update are the previous update's output or stored at that step (a recorder that
watches them stores those changed outside the optimizer, meta ``outside_edits``), and (3) the
optimizer state is only changed by ``optimizer.step()`` (the recorder does not watch it between
updates), and the records are the ones training wrote. Which of these the run and this process
rule out decides what the error says.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.classes import described, torch_optimizer
from stepdump.core.host import kernel_difference, kernels_meta
from stepdump.errors import RebuildError
from stepdump.store.format import SPARSE_COO_PREFIX

if TYPE_CHECKING:
    from stepdump.read.run import Run

# Optimizers that take sparse gradients only (SparseAdam refuses dense ones): a run recorded
# before stepdump stored sparse grads as sparse (FORMAT.md, "Sparse tensors") cannot drive them.
_NEEDS_SPARSE_GRADS = ("SparseAdam",)


def refusal_of(run: Run) -> RebuildError | None:
    """Why ``run``'s optimizer cannot be re-run at all (None: it can)."""
    cls = torch_optimizer(run.meta)  # by module and qualified name (core/classes.py), never imported
    where = f"{run.path} (a gradient log)"
    if cls is None:
        return RebuildError(f"{where} was recorded with optimizer {described(run.meta, 'optimizer')}, which is not "
                            "a torch.optim class, so its updates cannot be re-applied here; only keyframes are "
                            "readable")
    name = cls.__name__
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return RebuildError(f"{where} was recorded with {name}, which re-evaluates the loss inside step() (a "
                            "closure), so its updates cannot be re-applied from recorded gradients; only "
                            "keyframes are readable (record with keyframe_every=K and use stepdump.replay, or "
                            "record every step in full)")
    if name in _NEEDS_SPARSE_GRADS and not run.catalog.has_dtype_prefix("grads", SPARSE_COO_PREFIX):
        return RebuildError(f"{where} was recorded with {name}, which needs sparse gradients, and its gradients "
                            "are stored dense (recorded by a stepdump from before sparse gradients were stored "
                            "sparse), so its updates cannot be re-applied; only keyframes are readable")
    device = run.meta.get("device")
    if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
        return RebuildError(f"{where} was recorded on {device}; its updates must be re-applied by the same "
                            "kernels, and this machine has no CUDA device; only keyframes are readable here")
    return None


def host_difference(meta: dict[str, Any]) -> str | None:
    """How the kernels that re-apply an update here differ from the recording's, in words (None:
    they do not, as far as the run says)."""
    parts = []
    then = meta.get("torch_version")
    if isinstance(then, str) and then != torch.__version__:
        parts.append(f"torch {then} when recorded, {torch.__version__} here")
    kernels = kernel_difference(meta)
    if kernels:
        parts.append(kernels)
    return "; ".join(parts) or None


def mismatch_cause(meta: dict[str, Any], kind: str | None) -> str:
    """The sentence a RebuildError adds when re-applied updates give other values than recorded
    (``kind``: of the first tensor that differs)."""
    diff = host_difference(meta)
    if diff is not None:
        cap = meta.get("cpu_capability")
        hint = (f" (ATEN_CPU_CAPABILITY={str(cap).lower()} selects the recorded CPU kernels where this CPU has them)"
                if isinstance(cap, str) and "CPU capability" in diff else "")
        return (f"This host differs from the recording's: {diff}; the re-applied update may round differently "
                f"here. Rebuild it on a host like the recording's{hint}, or read a step stored in full")
    if kind == "params" and meta.get("outside_edits") != "stored":
        return ("This log was recorded by a stepdump that did not look for params changed outside the optimizer: "
                "a clamp or projection after optimizer.step(), or a pruning mask or other write through .data, "
                "gives exactly this. Recorded again with this version, such params are stored where they change")
    kernels = kernels_meta()
    same = (f"this host runs the recording's kernels (torch {torch.__version__}, CPU capability "
            f"{kernels['cpu_capability']}, BLAS {kernels['blas']})" if "cpu_capability" in meta else
            f"this host runs the recording's torch {torch.__version__} (the run does not name its CPU kernels: "
            "another CPU capability or BLAS than the recording's would do this too)")
    if kind == "optimizer":
        return (f"The params reproduce and {same}. The recorder does not follow the optimizer state between "
                "updates: a change to it outside optimizer.step() (optimizer.load_state_dict, moments reset by "
                "hand) gives this; otherwise a gradient or hyperparameter record was replaced together with its "
                "checksum (`stepdump verify` re-applies every segment)")
    return (f"The recorder checked that the params entering every update were the previous update's output (or "
            f"stored them), and {same}, so the record itself is inconsistent: a gradient or hyperparameter "
            "record replaced together with its checksum (`stepdump verify` re-applies every segment)")
