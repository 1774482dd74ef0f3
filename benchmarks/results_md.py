"""benchmarks/RESULTS.md: each benchmark script owns one ``## `` section of it.

``make bench`` runs the scripts one after another; each replaces only its own section (found by
its heading), so a script run alone leaves the other scripts' sections as they were.
"""

from __future__ import annotations

from pathlib import Path

HEADER = "# stepdump benchmarks: results\n"


def replace_section(path: Path, marker: str, text: str) -> None:
    """Put ``text`` (a section starting with its ``## `` heading, ``marker``) into the RESULTS.md at
    ``path``: where the section of that heading was, or at the end if there was none."""
    path = Path(path)
    body = path.read_text() if path.exists() else HEADER
    heading = "\n" + marker.lstrip("\n")
    start = body.find(heading)
    if start == -1:
        path.write_text(body.rstrip("\n") + "\n" + text.rstrip("\n") + "\n")
        return
    nxt = body.find("\n## ", start + len(heading))
    after = body[nxt:] if nxt != -1 else ""
    path.write_text(body[:start].rstrip("\n") + "\n" + text.rstrip("\n") + "\n" + after)
