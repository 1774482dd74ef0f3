"""The joint layout: one run over several named (model, optimizer) pairs (a GAN's G and D).

A run recorded by ``Recorder(path, models={...}, optimizers={...})`` is::

    RUN/
      joint.json   {"format": "stepdump-joint", "format_version": 1, "pairs": ["G", "D"],
                    "order": ["D", "G"] | null, "model_of": {"G": "G", "D": "D"}}
      G/           a complete single-process store (FORMAT.md): pair G's model and optimizer
      D/           ... one per pair

Step *t* of every pair's store is loop iteration *t* (each optimizer updates once per
iteration). ``order``: the order the pairs updated in, learned in iteration 0 (null until
then). ``model_of``: for each pair, the pair whose record gives its model's state (pairs that
share one module take it from the one that updates first: its record is taken before any
update of the iteration). A reader that does not know this file finds no catalog at ``RUN``
and refuses it; each pair's store is an ordinary run on its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from stepdump.errors import ConfigError, CorruptDataError, FormatVersionError
from stepdump.store import bounded_json, inside

JOINT_FILE = "joint.json"
JOINT_FORMAT = "stepdump-joint"
JOINT_FORMAT_VERSION = 1
_MAX_BYTES = 1 << 20
_ROLE = "the joint run's joint.json"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_pair_name(name: Any) -> str:
    """A pair name is its store's directory name: letters, digits, ``_ . -`` (not ``rank*``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("rank"):
        raise ConfigError(f"pair name {name!r}: use letters, digits, '_', '.', '-' (up to 64, not starting "
                          "with 'rank' or '.'), e.g. models={'G': netG, 'D': netD}")
    return name


def joint_document(pairs: list[str], order: list[str] | None, model_of: dict[str, str]) -> dict[str, Any]:
    return {"format": JOINT_FORMAT, "format_version": JOINT_FORMAT_VERSION, "pairs": list(pairs),
            "order": None if order is None else list(order), "model_of": dict(model_of)}


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check a ``joint.json``; ``where`` names it in error messages."""
    doc = bounded_json.loads(data, where, max_bytes=_MAX_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != JOINT_FORMAT:
        raise CorruptDataError(f"{where} is not a stepdump joint.json (no \"format\": \"{JOINT_FORMAT}\")")
    if doc.get("format_version") != JOINT_FORMAT_VERSION:
        raise FormatVersionError(f"{where} uses joint layout version {doc.get('format_version')!r}; this stepdump "
                                 f"reads version {JOINT_FORMAT_VERSION}. Install a stepdump release that reads it.")
    pairs, order, model_of = doc.get("pairs"), doc.get("order"), doc.get("model_of")
    try:
        ok = (isinstance(pairs, list) and pairs and len(set(pairs)) == len(pairs)
              and all(check_pair_name(p) for p in pairs)
              and (order is None or (isinstance(order, list) and sorted(order) == sorted(pairs)))
              and isinstance(model_of, dict) and set(model_of) == set(pairs) and set(model_of.values()) <= set(pairs))
    except ConfigError:
        ok = False
    if not ok:
        raise CorruptDataError(f"{where} has an invalid pairs, order or model_of entry")
    return doc


def read_local(root: Path) -> dict[str, Any]:
    """``root/joint.json``, parsed and checked (a link or a FIFO there is refused: store/inside.py)."""
    data = inside.read_file(root, JOINT_FILE, _ROLE, _MAX_BYTES)
    return parse(data, str(root / JOINT_FILE))


def pair_dir(root: Path, name: str) -> Path:
    """Pair ``name``'s store under ``root``: a directory of the run, never a link out of it."""
    return inside.inside(root, check_pair_name(name), f"pair {name!r}'s store (a joint run's pair directory)")


def write_local(root: Path, doc: dict[str, Any]) -> None:
    """Write ``root/joint.json`` atomically (a fresh temporary file, then rename: store/inside.py)."""
    inside.write_atomic(root, JOINT_FILE, (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode(), _ROLE)
