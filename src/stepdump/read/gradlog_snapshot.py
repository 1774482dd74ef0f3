"""The verified state of one rebuilt step, as the gradient-log engine (read/gradlog.py) caches it
and hands it out.

A read that ends at the chain's step takes the chain's own tensors (no copy): copying the whole
model and optimizer state at every step of a read in order cost a third of an update. The
engine drops such a snapshot before the chain moves on (``GradientLog._release``), and copies
it only when the chain must run on past it (a target step verified by a later one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stepdump.store.format import Key

if TYPE_CHECKING:
    from stepdump.read.gradlog_chain import Chain


@dataclass
class Snapshot:
    """The verified state of one step, handed out as clones. While ``chain`` is set the tensors
    are that chain's own (no copy for a read that ends there); ``GradientLog._release``
    drops the snapshot before the chain moves on."""

    step: int
    tensors: dict[Key, torch.Tensor]
    per_param: dict[str, dict[str, torch.Tensor]]
    verified: set[str]  # the kinds checked against fingerprints (at this step or, run on, a later one)
    chain: Chain | None = None


def take(chain: Chain) -> Snapshot:
    """The chain's state as a snapshot of its own tensors (no copy; see ``GradientLog._release``)."""
    tensors: dict[Key, torch.Tensor] = {}
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in chain.params.items():
        tensors[("params", n)] = p.detach()
    for n, p in chain.params.items():
        for k, v in chain.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                tensors[("optimizer", f"{n}.{k}")] = per_param.setdefault(n, {})[k] = v.detach()
            elif isinstance(v, torch.Tensor):  # sparse state (SGD momentum of sparse grads): its series is
                tensors[("optimizer", f"{n}.{k}")] = v.detach().to_dense()  # dense; the state JSON has it exact
    return Snapshot(chain.step, tensors, per_param, set(chain.checked), chain)


def copied(snap: Snapshot) -> Snapshot:
    """``snap`` in private copies (a tensor in both maps stays one tensor)."""
    copies = {id(t): t.clone() for t in snap.tensors.values()}
    for st in snap.per_param.values():
        copies.update({id(t): t.clone() for t in st.values() if id(t) not in copies})
    return Snapshot(snap.step, {key: copies[id(t)] for key, t in snap.tensors.items()},
                    {n: {k: copies[id(t)] for k, t in st.items()} for n, st in snap.per_param.items()},
                    set(snap.verified))
