"""The source says what the code does and why, in the present tense: history lives in git and in
docs/design-measurements.md, not in "issue N" references in src/ (a reader has no issue tracker)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stepdump"
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_issue_references_in_src() -> None:
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()}"
             for p in sorted(SRC.rglob("*")) if p.suffix in {".py", ".js", ".css", ".html"}
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ISSUE.search(line)]
    assert found == [], "\n".join(found)

