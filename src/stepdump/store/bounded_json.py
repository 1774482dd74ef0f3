"""Parsing the JSON a store holds, with size and depth bounds.

Every JSON document of a store (``joint.json``, ``ranks.json``, catalog meta values, a step's
typed-JSON state, extra state, marks) is untrusted input. Python's parser recurses once per
nesting level, so a document nested 100,000 deep raises ``RecursionError`` (a traceback from
every command), and whatever walks the parsed tree recursively (typed-JSON decoding) would do
the same at a depth the parser let through. :func:`loads` refuses both, as a corrupt store:
more than ``max_bytes``, or nested deeper than :data:`MAX_DEPTH` (far beyond any state stepdump
writes: an optimizer's state dict nests about six deep).
"""

from __future__ import annotations

import json
from typing import Any

from stepdump.errors import CorruptDataError

#: Nesting levels of arrays and objects a stored JSON document may have.
MAX_DEPTH = 200
#: Bytes a stored JSON document may have unless its reader says otherwise.
MAX_BYTES = 256 << 20


def depth(obj: Any, limit: int) -> int:
    """The nesting depth of parsed JSON ``obj`` (a scalar: 0), counted without recursion and
    only up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        level += 1
        if level > deepest:
            deepest = level
            if deepest > limit:
                return deepest
        stack.extend((c, level) for c in children if isinstance(c, (dict, list)))
    return deepest


def loads(data: str | bytes | bytearray, where: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Parse stored JSON ``data``; ``where`` names it in errors (a file, "the state of step 3").

    Raises:
        CorruptDataError: larger than ``max_bytes``, not JSON, or nested deeper than ``max_depth``.
    """
    if len(data) > max_bytes:
        raise CorruptDataError(f"{where} is {len(data)} bytes, more than the {max_bytes} stepdump reads there; "
                               "the store is damaged")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise CorruptDataError(f"{where} is nested too deep to be stepdump's (more than {max_depth} levels); "
                               "the store is damaged") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptDataError(f"{where} is not valid JSON: {e}") from None
    if depth(doc, max_depth) > max_depth:
        raise CorruptDataError(f"{where} is nested too deep to be stepdump's (more than {max_depth} levels); "
                               "the store is damaged")
    return doc
