"""The wheel a user installs (issue 23 item 8).

Builds the wheel from a copy of the sources (so the shared checkout gets no
build/ or egg-info), with no deprecation warning from the build backend, then
installs it (not editable) into a fresh virtual environment and runs the
``stepdump`` entry point from there: ``--version``, a tiny recording, and a
report whose CSS/JS must have come along as package data.

Offline by construction: the build uses the project venv's setuptools
(``--no-build-isolation --no-index``), the wheel is installed with
``--no-deps --no-index``, and the dependencies (torch, numpy, ...) reach the new
environment through a ``.pth`` line naming the project venv's site-packages. A
path line in a ``.pth`` file does not run the ``.pth`` files inside that
directory, so the checkout's editable finder stays off: the test asserts that
``stepdump`` is imported from the new environment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)`` (trailing zeros dropped: 2.13 and 2.13.0 are one release)."""
    parts = [int(p) for p in re.match(r"\d+(\.\d+)*", version).group(0).split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_the_torch_floor_is_the_torch_the_suite_runs_on() -> None:
    """pyproject's torch floor is the version `make install-test` pins and this suite runs on (no
    older torch has been run), and README says it."""
    import torch

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [m.group(1) for d in deps if (m := re.fullmatch(r"torch\s*>=\s*([\w.]+)", d.strip()))]
    pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert len(floors) == 1 and pin is not None, (deps, "Makefile TORCH")
    assert _release(floors[0]) == _release(pin.group(1))
    assert _release(torch.__version__) == _release(pin.group(1))  # this suite runs on the floor
    assert f"torch ≥ {floors[0]}" in (ROOT / "README.md").read_text()

RECORD = """
import torch, stepdump
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with stepdump.Recorder("run", model, opt) as rec:
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(4, 3)).square().mean()
        loss.backward()
        opt.step()
        rec.log(loss=loss)
print(stepdump.__file__)
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The built wheel and the build's verbose log."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src" / "stepdump", src / "src" / "stepdump",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    done = _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
                 "-v", "-w", str(out)], src)
    wheels = list(out.glob("stepdump-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], done.stdout + done.stderr


@pytest.fixture(scope="module")
def venv(wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel (not editable); deps come from the project venv."""
    env = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], env)
    py = env / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env).stdout.strip())
    (site / "_deps_from_project_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", str(wheel[0])], env)
    return env


@pytest.mark.parametrize("needle", ["project.license", "deprecated", "2027"])
def test_wheel_builds_without_deprecation(wheel: tuple[Path, str], needle: str) -> None:
    assert needle not in wheel[1], f"the build warns ({needle!r}):\n{wheel[1]}"


@pytest.mark.parametrize("member", ["stepdump/py.typed", "stepdump/render/report.css", "stepdump/render/report.js",
                                    "stepdump/render/report_draw.js", "stepdump/render/report_heat.js"])
def test_wheel_carries_package_data(wheel: tuple[Path, str], member: str) -> None:
    import zipfile

    assert member in zipfile.ZipFile(wheel[0]).namelist()


def test_installed_wheel_records_and_reports(venv: Path, tmp_path: Path) -> None:
    exe = venv / "bin" / "stepdump"
    version = _run([str(exe), "--version"], tmp_path).stdout
    assert version.startswith("stepdump 0.") and "store format" in version
    where = _run([str(venv / "bin" / "python"), "-c", RECORD], tmp_path).stdout.strip().splitlines()[-1]
    assert Path(where).resolve().is_relative_to(venv.resolve()), f"stepdump came from {where}, not the wheel"
    _run([str(exe), "info", "run"], tmp_path)
    _run([str(exe), "report", "run", "-o", "report.html"], tmp_path)
    html = (tmp_path / "report.html").read_text()
    for piece in ("report.css", "report_draw.js", "report.js"):  # each asset, as the package ships it
        text = (ROOT / "src" / "stepdump" / "render" / piece).read_text().strip()
        assert text.splitlines()[0] in html and text.splitlines()[-1] in html, piece
