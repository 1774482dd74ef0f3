"""Grads an update uses that no backward of its iteration wrote: state restore must put back.

Record *t* is the state iteration *t* starts from, and a restore normally leaves every grad
None (the loop's backward makes them). Two ordinary loops carry a grad *into* an iteration
instead, and the optimizer steps from it:

* ``zero_grad(set_to_none=False)`` (torch before 2.0): a param that iteration *t* does not
  use (a mixture of experts' idle expert) keeps a zero grad, and AdamW decays it and moves its
  moments; restored with no grad, AdamW would skip it;
* a grad nobody zeroes (``model.zero_grad()`` after a module was replaced: the old module's
  params are still in the optimizer): the same stale grad is applied at every step.

Seen without a hook per param: right after update *t-1* (the post-hook, only when record *t*
is stored in full) each param's grad object and version counter are noted; at the pre-hook of
update *t* a param whose grad is the same object and either unchanged (nobody wrote it) or
zeroed in place and still all zero (``set_to_none=False`` and unused) was carried in. Record
*t* names them (state ``carried_grads``) and stores their grads as usual; restore sets them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

__all__ = ["CarriedGrads"]


class CarriedGrads:
    """Notes the grads after an update and names, at the next pre-hook, those carried in."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[weakref.ref[torch.Tensor], int]] | None = None

    def after_update(self, params: Mapping[str, torch.Tensor] | None) -> None:
        """The post-hook: each grad's object and version (None: the next record is not compared)."""
        if params is None:
            self._seen = None
            return
        seen = {}
        for n, p in params.items():
            g = p.grad
            if g is not None and type(g) is torch.Tensor and g.layout == torch.strided:
                seen[n] = (weakref.ref(g), g._version)
        self._seen = seen

    def before_update(self, params: Mapping[str, torch.Tensor]) -> list[str]:
        """The pre-hook: names of the params whose grad was carried into this iteration."""
        seen, self._seen = self._seen, None
        if not seen:
            return []
        out: list[str] = []
        zeroed: list[tuple[str, torch.Tensor]] = []  # written in place since: carried if still all zero
        for n, p in params.items():
            g, s = p.grad, seen.get(n)
            if g is None or s is None or s[0]() is not g:
                continue  # a new grad: made by this iteration's backward (or None)
            if g._version == s[1]:
                out.append(n)  # untouched since the last update
            else:
                zeroed.append((n, g))
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for n, g in zeroed:
            by_device.setdefault(g.device, []).append((n, g))
        with torch.no_grad():
            for group in by_device.values():  # one host read per device (a CUDA any() apiece would sync each)
                nonzero = torch.stack([g.any() for _, g in group]).tolist()
                out += [n for (n, _), nz in zip(group, nonzero) if not nz]
        carried = set(out)
        return [n for n in params if n in carried]  # in the layout's order
