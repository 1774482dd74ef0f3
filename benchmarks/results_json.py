"""benchmarks/results.json: the numbers behind RESULTS.md, as data (issue 23).

Each benchmark script that writes its section of RESULTS.md also stores what it measured here,
under its own key (``run``, ``leave_on``, ``keyframes``, ``startup``), replacing only that key, so
``make bench`` leaves one JSON beside RESULTS.md. benchmarks/docs_numbers.py renders the marked
numbers of docs/performance.md and README.md from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "results.json"


def update(section: str, data: Any, path: Path = DEFAULT) -> Path:
    """Set ``section`` of the JSON at ``path`` to ``data`` (other sections kept), atomically."""
    path = Path(path)
    whole = json.loads(path.read_text()) if path.exists() else {}
    whole[section] = json.loads(json.dumps(data, default=str))  # plain JSON values only
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(whole, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load(path: Path = DEFAULT) -> dict[str, Any]:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}
