"""The report's screenshots (issue 26): docs/screenshots/make_screenshots.py records real runs, builds
the single-run, comparison and live pages and shoots them in headless chromium; docs/report.md shows
every committed PNG, and every PNG it names is committed (they cannot drift apart).

The script runs end to end into a temporary directory (short runs); each PNG must be a real PNG
of the script's viewport (read from its IHDR header), not empty, and under the size kept in the repo.
"""

from __future__ import annotations

import importlib.util
import re
import struct
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "screenshots" / "make_screenshots.py"
REPORT_MD = ROOT / "docs" / "report.md"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_BYTES = 300_000  #: each committed screenshot stays small


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_screenshots", SCRIPT)
    assert spec is not None and spec.loader is not None, f"{SCRIPT} missing"
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_screenshots"] = mod
    spec.loader.exec_module(mod)
    return mod


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk; fails on anything that is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path.name}: not a PNG"
    assert head[12:16] == b"IHDR", f"{path.name}: no IHDR chunk first"
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def _shown_in_report_md() -> set[str]:
    """Image paths that docs/report.md shows (markdown images), relative to docs/."""
    return set(re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", REPORT_MD.read_text(encoding="utf-8")))


def test_script_shoots_every_page_end_to_end(tmp_path: Path) -> None:
    mod = _script()
    shots = mod.make(tmp_path / "shots", steps=20, work=tmp_path / "work")
    assert [p.name for p in shots] == list(mod.SHOTS)
    assert {"report-single.png", "report-compare.png", "report-live.png"} <= set(mod.SHOTS)
    for p in shots:
        assert p.parent == tmp_path / "shots" and p.is_file(), p
        assert _png_size(p) == tuple(mod.VIEWPORT), p.name
        assert 5_000 < p.stat().st_size < MAX_BYTES, (p.name, p.stat().st_size)  # drawn, and small
    assert sorted(x.name for x in (tmp_path / "work").iterdir()) == ["base", "compare.html", "live", "lr10", "single.html"]


def _committed() -> list[str]:
    return sorted(p.name for p in (ROOT / "docs" / "screenshots").glob("*.png"))


@pytest.mark.parametrize("name", sorted(set(_script().SHOTS) | set(_committed())))
def test_each_screenshot_is_committed_small_and_shown(name: str) -> None:
    path = ROOT / "docs" / "screenshots" / name
    assert path.is_file(), f"{name}: not committed (run {SCRIPT.relative_to(ROOT)})"
    assert name in _script().SHOTS, f"{name}: committed but the script does not make it"
    assert _png_size(path) == tuple(_script().VIEWPORT)
    assert 0 < path.stat().st_size < MAX_BYTES
    assert f"screenshots/{name}" in _shown_in_report_md(), f"docs/report.md does not show {name}"


def test_report_md_shows_only_committed_images() -> None:
    shown = _shown_in_report_md()
    assert shown, "docs/report.md shows no screenshot"
    for rel in shown:
        assert (REPORT_MD.parent / rel).is_file(), f"docs/report.md shows {rel}, which is not in docs/"
