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
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring_ascii as _json_str
from operator import is_
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
    if tag not in _TENSOR_TAGS:
        raise ValueError(f"tag={tag!r}: one of {_TENSOR_TAGS}")
    return _encode(obj, _unique(put_tensor), path, tag)


def _unique(put_tensor: Callable[[str, torch.Tensor], None]) -> Callable[[str, torch.Tensor], str]:
    """``put_tensor`` under a ref no tensor of this tree has had yet (``#n`` added); returns the ref."""
    used: set[str] = set()

    def put_unique(ref: str, t: torch.Tensor) -> str:
        unique, n = ref, 1
        while unique in used:
            n += 1
            unique = f"{ref}#{n}"
        used.add(unique)
        put_tensor(unique, t)
        return unique
    return put_unique


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
    if kind is torch.Tensor:  # (the RNG state's, at every gradient-log step) as below, without the chain
        return _encode_tensor(obj, put_tensor, path, tag)
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
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, put_tensor, path, tag)
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


def _encode_tensor(obj: torch.Tensor, put_tensor: Callable[[str, torch.Tensor], str], path: str, tag: str) -> Any:
    if obj.layout == torch.sparse_coo:
        return {"$sparse_coo": {"indices": _encode(obj._indices(), put_tensor, f"{path}/indices", tag),
                                "values": _encode(obj._values(), put_tensor, f"{path}/values", tag),
                                "size": list(obj.shape), "coalesced": obj.is_coalesced()}}
    ref = put_tensor(path or "value", obj)
    return {tag: ref} if obj.device.type == "cpu" else {tag: ref, "$device": str(obj.device)}


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


# One encoder, made once (json.dumps makes one per call when given options); the same text.
_TEXT = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# json's C encoder under it, made once, without the check for cycles: for trees :func:`encode` just
# made (new containers all: no cycle), where JSONEncoder.encode's two Python frames and its
# C encoder made anew at each call were most of a small tree's cost.
_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_C_TEXT = None if _C_ENCODER is None else _C_ENCODER(
    None, json.JSONEncoder().default, _json_str, None, ":", ",", False, False, False)


def _fresh_text(tree: Any) -> str:
    """``dumps(tree)`` of a tree :func:`encode` just made."""
    return _TEXT(tree) if _C_TEXT is None else "".join(_C_TEXT(tree, 0))


def dumps(tree: Any) -> str:
    return _TEXT(tree)


# Plain values: these exact types, and lists, tuples and str-keyed dicts of them. Immutable leaves.
_LEAVES = frozenset({str, int, bool, type(None), float})


def _leaf_text(v: Any) -> str:
    """``dumps(encode(v))`` of an exact str, int, bool, None or float (what json writes for each)."""
    kind = type(v)
    if kind is str:
        return _json_str(v)
    if kind is float:
        return float.__repr__(v) if math.isfinite(v) else '{"$float":' + _json_str(repr(v)) + "}"
    if kind is bool:
        return "true" if v else "false"
    return "null" if v is None else int.__repr__(v)


_CHILD = object()  # a container item's place in _Plain.refs: its own node checks it (never a live item)


class _Plain:
    """A plain container's text as last encoded, and what decides whether a value now encodes the
    same: its dict keys, its items as they were (``refs``: a leaf, or a frozen tuple, i.e. one of
    leaves and frozen tuples alone, is immutable: the same object is the same value; a list's or
    dict's place holds ``_CHILD``), its items' exact types, the nodes of its items that are
    containers (``mutable``: those that are not frozen tuples) and each item's text."""

    __slots__ = ("kind", "keys", "keytexts", "refs", "expect", "types", "children", "mutable", "frozen",
                 "texts", "text", "dynamic")

    def __init__(self, kind: type, keys: list[str] | None, keytexts: list[str] | None, refs: list[Any],
                 types: list[type], children: dict[int, _Plain], texts: list[str]) -> None:
        self.kind, self.keys, self.keytexts, self.refs, self.types = kind, keys, keytexts, refs, types
        self.children, self.texts = children, texts
        self.expect = [r is not _CHILD for r in refs]  # the places where the same object is the same value
        tensors = [i for i, t in enumerate(types) if t is torch.Tensor]
        # The places written at every call, in order: tensors (handed out then) and the containers holding any.
        self.dynamic: list[int] = sorted(tensors + [i for i, c in children.items() if c.dynamic])
        # The places checked at every call: tensors (their type), containers but frozen tuples.
        self.mutable: list[int] = sorted(tensors + [i for i, c in children.items() if not c.frozen])
        self.frozen: bool = kind is tuple and not self.mutable
        self.text = "" if self.dynamic else _joined(kind, keytexts, texts)


def _joined(kind: type, keytexts: list[str] | None, texts: list[str]) -> str:
    if keytexts is not None:
        return "{" + ",".join(map(str.__add__, keytexts, texts)) + "}"
    body = "[" + ",".join(texts) + "]"
    return body if kind is list else '{"$tuple":' + body + "}"


def _written(node: _Plain, v: Any, put: Callable[[str, torch.Tensor], str], path: str) -> str:
    """The text of ``v``, which :func:`_refresh` found as ``node`` says, its tensors handed to ``put``
    in the order :func:`encode` hands them (``path``: ``v``'s, as there)."""
    keys = node.keys
    items = list(v.values()) if keys is not None else v
    texts = list(node.texts)
    for i in node.dynamic:
        x = items[i]
        at = f"{path}/{keys[i] if keys is not None else i}"
        child = node.children.get(i)
        if child is not None:
            texts[i] = _written(child, x, put, at)
        elif x.layout == torch.sparse_coo or x.device.type != "cpu":
            texts[i] = _fresh_text(_encode_tensor(x, put, at, "$tensor"))
        else:
            texts[i] = '{"$tensor":' + _json_str(put(at, x)) + "}"
    return _joined(node.kind, node.keytexts, texts)


def _refresh(node: _Plain | None, v: Any) -> _Plain | None:
    """``node`` where the container ``v`` encodes to its text, else ``v``'s node, made with those of
    ``node``'s items that still do; None: ``v`` is not plain. First by identity, pointers alone (a
    step's param groups are new dicts of the same objects); where an item is another object, by
    exact type (checked before any ``==``: the values compared are plain, never a tensor's
    elementwise ``==``), equal value and, for a float zero, sign (0.0 == -0.0, written apart)."""
    kind = type(v)
    if node is None or kind is not node.kind:
        return _build(v, None)
    if kind is dict:
        keys = node.keys or []
        if len(v) != len(keys) or (not all(map(is_, v, keys))  # exact str keys before ==: no other __eq__
                                   and (list(map(type, v)) != [str] * len(keys) or list(v) != keys)):
            return _build(v, node)
        items = list(v.values())
    else:
        if len(v) != len(node.refs):  # (map below stops at the shorter)
            return _build(v, node)
        items = v
    refs, types = node.refs, node.types
    flags = list(map(is_, items, refs))
    places = node.mutable if flags == node.expect else [i for i, same in enumerate(flags) if not same]
    changed: dict[int, Any] = {}
    for i in places:
        x, t = items[i], types[i]
        if type(x) is not t:
            return _build(v, node)
        if t is torch.Tensor:  # written at every call (_written)
            continue
        if t in _LEAVES:
            ref = refs[i]
            if x == ref and (t is not float or x != 0.0 or math.copysign(1.0, x) == math.copysign(1.0, ref)):
                continue
            changed[i] = x
            continue
        child = node.children[i]
        new = _refresh(child, x)
        if new is None:
            return None
        if new is not child:  # (a frozen tuple equal to the last, another object: its place keeps the last)
            changed[i] = new
    if not changed:
        return node
    refs, texts, children = list(refs), list(node.texts), dict(node.children)
    alike = True  # every place still what it was: a leaf, or a container as frozen and as dynamic
    for i, new in changed.items():
        if type(new) is _Plain:
            last = children[i]
            alike = alike and new.frozen is last.frozen and bool(new.dynamic) is bool(last.dynamic)
            children[i], texts[i] = new, new.text
            refs[i] = items[i] if new.frozen else _CHILD
        else:
            refs[i], texts[i] = new, _leaf_text(new)
    if not alike:
        return _Plain(kind, node.keys, node.keytexts, refs, types, children, texts)
    # A scheduler's new lr: the same places, so the same expect, dynamic, mutable and frozen.
    out = object.__new__(_Plain)
    out.kind, out.keys, out.keytexts, out.types = kind, node.keys, node.keytexts, types
    out.refs, out.texts, out.children = refs, texts, children
    out.expect, out.dynamic, out.mutable, out.frozen = node.expect, node.dynamic, node.mutable, node.frozen
    out.text = "" if node.dynamic else _joined(kind, node.keytexts, texts)
    return out


def _build(v: Any, old: _Plain | None) -> _Plain | None:
    """The node of the container ``v`` (None: ``v`` is not plain), made with ``old``'s nodes of its
    items where they still hold (``old``: the node this value had last, or None)."""
    kind = type(v)
    keys: list[str] | None = None
    keytexts: list[str] | None = None
    if kind is dict:
        keys = list(v)
        if any(type(k) is not str or k in _TAGS for k in keys):  # encoded as "$dict" pairs: not plain here
            return None
        keytexts = [_json_str(k) + ":" for k in keys]
        items = list(v.values())
    elif kind is list or kind is tuple:
        items = list(v)
    else:
        return None
    olds = old.children if old is not None and old.kind is kind else {}
    types = list(map(type, items))
    refs: list[Any] = []
    texts: list[str] = []
    children: dict[int, _Plain] = {}
    for i, (x, t) in enumerate(zip(items, types)):
        if t in _LEAVES:
            refs.append(x)
            texts.append(_leaf_text(x))
            continue
        if t is torch.Tensor:  # an exact tensor: its place written at every call (_written)
            refs.append(_CHILD)
            texts.append("")
            continue
        child = _refresh(olds.get(i), x)
        if child is None:
            return None
        children[i] = child
        refs.append(x if child.frozen else _CHILD)
        texts.append(child.text)
    return _Plain(kind, keys, keytexts, refs, types, children, texts)


_EMPTY: dict[type, str] = {dict: "{}", list: "[]", tuple: '{"$tuple":[]}'}


class Memo:
    """``dumps(encode(state))`` of a state made again at every step, where most of it is as it was
    (a gradient log's param groups, names and hyperparameters, at every step). Each part of the
    state that is plain (exact str, int, bool, None and float, and lists, tuples and str-keyed
    dicts of them) or plain but for exact tensors (the RNG state) keeps its text, taken again
    while the part encodes the same (:func:`_refresh`: the same objects, or equal by value and
    exact type; a scheduler's new lr shows at once, only that group's hyperparameters written
    anew); its tensors are handed out and written in their places at every call (:func:`_written`).
    A part holding anything else (a numpy scalar, a Counter, a dict with other keys) is encoded
    afresh. The text and the tensors handed out, in their order, are exactly those of
    :func:`encode` and :func:`dumps`. One per series of states (it holds the last one's parts);
    not shared between threads."""

    def __init__(self) -> None:
        self._parts: dict[str, _Plain | None] = {}
        self._keys: dict[str, str] = {}

    def dumps(self, obj: dict[str, Any], put_tensor: Callable[[str, torch.Tensor], None],
              tail: Mapping[str, Any] | None = None) -> str:
        """``dumps(tree)`` of ``tree = encode(obj, put_tensor)`` updated with ``tail`` (items
        already encoded, written as they are)."""
        if type(obj) is not dict or any(type(k) is not str or k in _TAGS for k in obj) \
                or (tail and any(k in obj for k in tail)):  # not a state's dict as always: no memo
            tree = encode(obj, put_tensor)
            if tail:
                tree.update(tail)
            return dumps(tree)
        put = _unique(put_tensor)
        last: dict[str, _Plain | None] = self._parts
        now: dict[str, _Plain | None] = {}
        out = []
        for k, v in obj.items():
            key = self._keys.get(k)
            if key is None:
                key = self._keys[k] = _json_str(k) + ":"
            kind = type(v)
            if kind in _LEAVES:
                out.append(key + _leaf_text(v))
                continue
            if kind in _EMPTY and not v:  # (a step's optimizer extras, its edits: mostly none)
                out.append(key + _EMPTY[kind])
                continue
            node = now[k] = _refresh(last.get(k), v)
            if node is None:
                out.append(key + _fresh_text(_encode(v, put, f"/{k}")))
            else:
                out.append(key + (_written(node, v, put, f"/{k}") if node.dynamic else node.text))
        for k, v in (tail or {}).items():
            out.append(_json_str(k) + ":" + _TEXT(v))
        self._parts = now
        return "{" + ",".join(out) + "}"


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
