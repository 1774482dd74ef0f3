"""Startup cost (issue 13 targets), written into benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/startup.py              # median of 5 fresh processes each
    .venv/bin/python benchmarks/startup.py --repeats 9

Each figure is the wall time of a fresh interpreter, measured from outside
(interpreter start-up included, as a user feels it), the median over
``--repeats`` runs after one untimed run that warms the page cache. Targets:
``import stepdump`` at most 1.5 × ``import torch``, also when every public name
is touched (which loads torch and pandas); ``stepdump --help`` under 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "\n## Startup"
IMPORT_RATIO = 1.5  # import stepdump / import torch
HELP_SECONDS = 1.0  # stepdump --help


def _cli() -> list[str]:
    """The installed ``stepdump`` script next to this interpreter, else ``python -m stepdump``."""
    script = Path(sys.executable).with_name("stepdump")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stepdump"]


CASES: list[tuple[str, list[str]]] = [
    ("python -c pass (interpreter alone)", [sys.executable, "-c", "pass"]),
    ("import torch", [sys.executable, "-c", "import torch"]),
    ("import stepdump", [sys.executable, "-c", "import stepdump"]),
    ("import stepdump + every name in __all__",
     [sys.executable, "-c", "import stepdump\nfor n in stepdump.__all__: getattr(stepdump, n)"]),
    ("stepdump --help", [*_cli(), "--help"]),
]


def time_once(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def measure(repeats: int) -> dict[str, float]:
    """Median wall seconds per case. Cases are interleaved so that drift hits them alike."""
    for _label, cmd in CASES:
        time_once(cmd)  # warm the page cache
    runs: dict[str, list[float]] = {label: [] for label, _ in CASES}
    for _ in range(repeats):
        for label, cmd in CASES:
            runs[label].append(time_once(cmd))
    return {label: statistics.median(v) for label, v in runs.items()}


def render(med: dict[str, float], repeats: int) -> str:
    torch_s = med["import torch"]
    rows = []
    for label, _ in CASES:
        s = med[label]
        if label.startswith("import stepdump"):
            ratio = s / torch_s
            target, ok = f"≤ {IMPORT_RATIO}× import torch", ratio <= IMPORT_RATIO
            value = f"{s * 1000:.0f} ms ({ratio:.2f}× import torch)"
        elif label == "stepdump --help":
            target, ok = f"< {HELP_SECONDS:.0f} s", s < HELP_SECONDS
            value = f"{s * 1000:.0f} ms"
        else:
            target, ok, value = "–", None, f"{s * 1000:.0f} ms"
        result = "–" if ok is None else "pass" if ok else "FAIL"
        rows.append(f"| {label} | {value} | {target} | {result} |")
    return "\n".join([
        "",
        "## Startup (issue 13 targets)",
        "",
        f"`benchmarks/startup.py`: wall time of a fresh process, median of {repeats} runs after one warm-up; "
        "interpreter start-up included.",
        "",
        "| what | time | target | result |",
        "|---|---:|---:|---|",
        *rows,
        "",
    ])


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per case (default 5)")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="results file to update")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    med = measure(args.repeats)
    text = render(med, args.repeats)
    print(text)
    write_section(args.out, text)
    from results_json import update  # benchmarks/ is sys.path[0] when run as a script

    update("startup", {"repeats": args.repeats, "median_s": med}, args.out.with_name("results.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
