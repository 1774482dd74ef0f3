"""What stepdump is compared with: no recording, the seeds' hand-written ways, the floor.

Every way of recording is a *Recording*: it is built (outside the timed region)
for a workload and a directory, its ``hook`` (or None) is called by the
training step after backward and before ``optimizer.step()`` -- the moment
stepdump's optimizer pre-hook fires -- and ``close()`` ends it (inside the timed
region, so deferred work is counted).
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from workloads import Workload


class Recording(Protocol):
    hook: Callable[[], None] | None

    def close(self) -> None: ...


def _clone_all(w: Workload) -> dict[str, torch.Tensor]:
    """What the hand-written loops do: detach and clone every tensor."""
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in w.tensors()}


def _raw_view(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class NoRecording:
    hook: Callable[[], None] | None = None

    def __init__(self, w: Workload, out: Path) -> None:
        pass

    def close(self) -> None:
        pass


class _PerStepFile:
    """Base of the seeds' ways: one file per step, written synchronously in the hook."""

    suffix = ".bin"

    def __init__(self, w: Workload, out: Path) -> None:
        self.w, self.out, self.i = w, out, 0
        out.mkdir(parents=True, exist_ok=True)
        self.hook = self._hook

    def _hook(self) -> None:
        self.save(self.out / f"step{self.i:06d}{self.suffix}")
        self.i += 1

    def save(self, path: Path) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PickleDump(_PerStepFile):
    """clone everything, ``pickle.dump`` a dict per step."""

    suffix = ".pkl"

    def save(self, path: Path) -> None:
        sd = _clone_all(self.w)
        with open(path, "wb") as f:
            pickle.dump(sd, f, protocol=pickle.HIGHEST_PROTOCOL)


class TorchSave(_PerStepFile):
    """clone everything, ``torch.save`` the dict per step."""

    suffix = ".pt"

    def save(self, path: Path) -> None:
        torch.save(_clone_all(self.w), path)


class SafetensorsSave(_PerStepFile):
    """clone everything, ``safetensors.torch.save_file`` per step (names flattened)."""

    suffix = ".safetensors"

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(_clone_all(self.w), str(path))


class JsonTolist(_PerStepFile):
    """clone everything, ``tolist()`` each tensor, JSON per step (C encoder: json.dumps)."""

    suffix = ".json"

    def save(self, path: Path) -> None:
        sd = _clone_all(self.w)
        text = json.dumps({k: v.tolist() for k, v in sd.items()})
        with open(path, "w") as f:
            f.write(text)


def _quiet_dcp() -> None:
    # Without a process group DCP warns once per call that it assumes one process.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


class DcpSave(_PerStepFile):
    """``torch.distributed.checkpoint.save`` of the live tensors per step (synchronous, no clone needed)."""

    suffix = ".dcp"

    def __init__(self, w: Workload, out: Path) -> None:
        super().__init__(w, out)
        _quiet_dcp()

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(self.w.tensors()), checkpoint_id=str(path))


class DcpAsyncSave(_PerStepFile):
    """``torch.distributed.checkpoint.async_save`` per step: stages a CPU copy, writes on a thread.

    A new save waits for the previous one (as the DCP docs advise), and close()
    waits for the last, so the background writes are counted.
    """

    suffix = ".dcp"

    def __init__(self, w: Workload, out: Path) -> None:
        super().__init__(w, out)
        _quiet_dcp()
        self._pending = None

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:
            self._pending.result()
        self._pending = dcp.async_save(dict(self.w.tensors()), checkpoint_id=str(path))

    def close(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None


# -- the physical floor --------------------------------------------------------------------
class CopyIntoBuffers:
    """``copy_`` every tensor into buffers allocated once: the least a snapshot can cost."""

    def __init__(self, w: Workload, out: Path) -> None:
        self.w = w
        self.bufs: dict[str, torch.Tensor] = {}
        self.hook = self._hook

    def _hook(self) -> None:
        with torch.no_grad():
            for k, v in self.w.tensors():
                b = self.bufs.get(k)
                if b is None:
                    b = self.bufs[k] = torch.empty_like(v, memory_format=torch.contiguous_format)
                b.copy_(v)

    def close(self) -> None:
        pass


class PlainWrite:
    """Append the raw bytes of every tensor to one open file per step, synchronously.

    ``bytes_per_step`` (what stepdump's raw codec wrote per step) is matched by
    padding with zeros, so this writes exactly the same number of bytes.
    """

    def __init__(self, w: Workload, out: Path, bytes_per_step: int | None = None) -> None:
        self.w = w
        out.mkdir(parents=True, exist_ok=True)
        self.f = open(out / "data.bin", "ab", buffering=0)  # noqa: SIM115
        tensor_bytes = sum(v.numel() * v.element_size() for _, v in w.tensors())
        pad = max(0, (bytes_per_step or tensor_bytes) - tensor_bytes)
        self.pad = memoryview(bytearray(pad))
        self.hook = self._hook

    def _hook(self) -> None:
        for _, v in self.w.tensors():
            _write_all(self.f, _raw_view(v))
        if len(self.pad):
            _write_all(self.f, self.pad)

    def close(self) -> None:
        self.f.flush()
        self.f.close()


def _write_all(f: object, view: memoryview) -> None:
    n = 0
    while n < len(view):
        n += f.write(view[n:])  # type: ignore[attr-defined]


def write_only(out: Path, bytes_per_step: int, steps: int, chunk: int = 4 << 20) -> float:
    """Seconds to append ``bytes_per_step`` bytes ``steps`` times to a file, no training.

    Written in ``chunk``-sized writes from memory that is already there: the pure
    I/O cost a perfectly overlapped writer would have to hide behind training.
    """
    import time

    out.mkdir(parents=True, exist_ok=True)
    src = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20))
    t0 = time.perf_counter()
    with open(out / "data.bin", "ab", buffering=0) as f:
        for _ in range(steps):
            left = bytes_per_step
            while left > 0:
                n = min(left, len(src))
                _write_all(f, src[:n])
                left -= n
    return time.perf_counter() - t0


SEED_WAYS: dict[str, type] = {
    "pickle.dump": PickleDump,
    "torch.save": TorchSave,
    "safetensors": SafetensorsSave,
    "json tolist": JsonTolist,
    "dcp.save": DcpSave,
    "dcp.async_save": DcpAsyncSave,
}
