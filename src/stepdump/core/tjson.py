"""Typed JSON: how non-tensor state (scheduler, scaler, RNG, param groups) is stored.

Plain JSON loses tuples, non-string dict keys and tensors. Typed JSON tags them:

* ``{"$tuple": [...]}`` a tuple,
* ``{"$dict": [[key, value], ...]}`` a dict whose keys are not all strings,
* ``{"$counter": [[key, count], ...]}`` a ``collections.Counter`` (``MultiStepLR.milestones``:
  a resumed scheduler calls ``.elements()`` on it),
* ``{"$tensor": "ref"}`` a tensor stored as a blob of kind ``state`` named ``ref``;
  ``{"$tensor": "ref", "$device": "cuda:0"}`` one that lived on another device than the CPU,
* ``{"$sparse_coo": {"indices": T, "values": T, "size": [...], "coalesced": bool}}`` a sparse
  COO tensor as it was, duplicates and order kept (SGD's momentum of sparse grads: the
  order in which duplicate rows are added decides the rounding of the next update),
* ``{"$repr": "..."}`` an object stepdump cannot store; kept for display only;
* ``{"$extra": "ref"}`` (inside a step state's ``extra_state``) a tensor stored as a blob of kind
  ``extra`` named ``ref``: extra state (an EMA) is stored like params, with stats (FORMAT.md).

Decoding never constructs anything but these plain types and tensors, so a store
from an untrusted source cannot run code.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_TAGS = ("$tuple", "$dict", "$counter", "$tensor", "$device", "$sparse_coo", "$repr", "$float", "$extra")
_TENSOR_TAGS = ("$tensor", "$extra")


def encode(obj: Any, put_tensor: Callable[[str, torch.Tensor], None], path: str = "", tag: str = "$tensor") -> Any:
    """Turn ``obj`` into a JSON-able tree, handing tensors to ``put_tensor(ref, t)``.

    ``tag``: how a tensor is marked in the tree, ``$tensor`` (a blob of kind ``state``) or
    ``$extra`` (a blob of kind ``extra``).

    Refs are the tensors' paths in ``obj``; where two paths read the same (a key
    ``"a/b"`` next to a key ``"a"`` holding ``"b"``, or keys ``0`` and ``"0"``)
    the later one gets a ``#n`` suffix, so every tensor has a ref of its own.
    """
    used: set[str] = set()

    def put_unique(ref: str, t: torch.Tensor) -> str:
        unique, n = ref, 1
        while unique in used:
            n += 1
            unique = f"{ref}#{n}"
        used.add(unique)
        put_tensor(unique, t)
        return unique

    if tag not in _TENSOR_TAGS:
        raise ValueError(f"tag={tag!r}: one of {_TENSOR_TAGS}")
    return _encode(obj, put_unique, path, tag)


# Exact types returned as they are (no isinstance chain: a gradient-log step encodes its optimizer's
# param groups, dozens of plain values, at every step).
_AS_IS = frozenset({str, bool, int, type(None)})


def _encode(obj: Any, put_tensor: Callable[[str, torch.Tensor], str], path: str, tag: str = "$tensor") -> Any:
    kind = type(obj)
    if kind in _AS_IS:
        return obj
    if kind is float:
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if kind is list and all(type(v) in _AS_IS for v in obj):  # a param group's indices, a list of names
        return list(obj)
    if kind is dict:
        return _encode_dict(obj, put_tensor, path, tag)
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        # JSON has no inf/nan; keep the spec strict and tag them. float(): np.float64
        # is a float whose repr is "np.float64(inf)".
        obj = float(obj)
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return _encode(float(obj), put_tensor, path, tag)
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
        return {"$sparse_coo": {"indices": _encode(obj._indices(), put_tensor, f"{path}/indices", tag),
                                "values": _encode(obj._values(), put_tensor, f"{path}/values", tag),
                                "size": list(obj.shape), "coalesced": obj.is_coalesced()}}
    if isinstance(obj, torch.Tensor):
        ref = put_tensor(path or "value", obj)
        return {tag: ref} if obj.device.type == "cpu" else {tag: ref, "$device": str(obj.device)}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, put_tensor, f"{path}/{i}", tag) for i, v in enumerate(obj)]
        return {"$tuple": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Counter):
        return {"$counter": [[_encode(k, put_tensor, f"{path}/key{i}", tag), _encode(v, put_tensor, f"{path}/{k}", tag)]
                             for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, dict):
        return _encode_dict(obj, put_tensor, path, tag)
    log.warning("stepdump cannot store %s at %r; only its repr is kept", type(obj).__name__, path)
    return {"$repr": repr(obj)[:200]}


def _encode_dict(obj: dict[Any, Any], put_tensor: Callable[[str, torch.Tensor], str], path: str, tag: str) -> Any:
    if all(isinstance(k, str) and k not in _TAGS for k in obj):
        return {k: _encode(v, put_tensor, f"{path}/{k}", tag) for k, v in obj.items()}
    return {
        "$dict": [
            [_encode(k, put_tensor, f"{path}/key{i}", tag), _encode(v, put_tensor, f"{path}/{k}", tag)]
            for i, (k, v) in enumerate(obj.items())
        ]
    }


def decode(tree: Any, get_tensor: Callable[[str], torch.Tensor],
           get_extra: Callable[[str], torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`encode`; ``get_tensor(ref)`` loads a tensor marked ``$tensor``,
    ``get_extra(ref)`` one marked ``$extra`` (None: such a tensor decodes as ``None``)."""

    def get(tag: str, ref: str) -> torch.Tensor | None:
        if tag == "$tensor":
            return get_tensor(ref)
        return None if get_extra is None else get_extra(ref)

    def dec(tree: Any) -> Any:
        if isinstance(tree, list):
            return [dec(v) for v in tree]
        if isinstance(tree, dict):
            if len(tree) == 1:
                (tag, val), = tree.items()
                if tag == "$tuple":
                    return tuple(dec(v) for v in val)
                if tag == "$dict":
                    return {_hashable(dec(k)): dec(v) for k, v in val}
                if tag == "$counter":
                    return Counter({_hashable(dec(k)): dec(v) for k, v in val})
                if tag in _TENSOR_TAGS:
                    return get(tag, str(val))
                if tag == "$float":
                    return float(val)
                if tag == "$sparse_coo":
                    return _sparse(val, dec)
                if tag == "$repr":
                    return None
            for tag in _TENSOR_TAGS:
                if set(tree) == {tag, "$device"}:
                    t = get(tag, str(tree[tag]))
                    return None if t is None else _on_device(t, tree["$device"])
            return {k: dec(v) for k, v in tree.items()}
        return tree

    return dec(tree)


def _sparse(val: Any, dec: Callable[[Any], Any]) -> torch.Tensor:
    """Rebuild a sparse COO tensor, checking what a hostile store could put there."""
    from stepdump.errors import CorruptDataError

    bad = CorruptDataError(f"a stored sparse tensor is malformed: {str(val)[:200]}")
    if not (isinstance(val, dict) and isinstance(val.get("size"), list) and isinstance(val.get("coalesced"), bool)):
        raise bad
    indices, values = dec(val.get("indices")), dec(val.get("values"))
    size = val["size"]
    if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size)):
        raise bad
    try:  # check_invariants: indices inside size, shapes consistent (never trusted blindly)
        return torch.sparse_coo_tensor(indices, values, tuple(size), is_coalesced=val["coalesced"],
                                       check_invariants=True)
    except (RuntimeError, TypeError, ValueError) as e:
        raise CorruptDataError(f"a stored sparse tensor is malformed: {e}") from None


def _on_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """Move a state tensor back to the device it was recorded on, when this machine has it."""
    try:
        dev = torch.device(str(device))
    except (RuntimeError, ValueError):
        return t  # a damaged device name: the values are still right on the CPU
    if dev.type == "cuda" and torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
        return t.to(dev)
    return t


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dumps(tree: Any) -> str:
    return json.dumps(tree, separators=(",", ":"), allow_nan=False)


def loads(text: str | bytes, where: str = "a recorded state") -> Any:
    """Parse stored typed JSON with size and depth bounds (store/bounded_json.py): a tree nested
    too deep for :func:`decode` is a CorruptDataError, never a RecursionError."""
    from stepdump.errors import CorruptDataError
    from stepdump.store import bounded_json

    if not isinstance(text, (str, bytes)):
        raise CorruptDataError(f"{where} is not JSON text but {type(text).__name__}; `stepdump verify` lists "
                               "every step whose state is damaged")
    try:
        return bounded_json.loads(text, where)
    except CorruptDataError as e:
        raise CorruptDataError(f"{e}; `stepdump verify` lists every step whose state is damaged") from None
