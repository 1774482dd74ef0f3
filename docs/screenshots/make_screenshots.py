"""Record small real runs and take the screenshots of the report shown in docs/report.md.

    .venv/bin/python docs/screenshots/make_screenshots.py            # rewrites docs/screenshots/*.png
    .venv/bin/python docs/screenshots/make_screenshots.py --out /tmp/shots --steps 40

What it does, as a user would:

1. records a tiny GPT-style loop (2 blocks of attention + MLP + LayerNorm, AdamW, random tokens)
   for ``--steps`` updates, full tensors every 10th step and stats in between (``base``);
2. records the same loop again with the learning rate raised tenfold from the middle on (``lr10``);
3. writes ``stepdump report base`` and ``stepdump report base lr10`` and takes a screenshot of each
   page (the single run at its per-tensor charts and distributions; the comparison at "Where the
   runs part", run table folded, and at its scalars: both runs, the marker, the A − B chart);
4. starts a third run, serves it with ``stepdump report --watch`` (a subprocess, as on the command
   line) while the loop keeps recording, waits until the page has refreshed with new steps, and
   takes a screenshot of the live page.

Screenshots come from headless Debian chromium through playwright, as the tests drive it
(``STEPDUMP_CHROMIUM`` overrides the executable), at a fixed viewport of ``VIEWPORT`` CSS pixels
and a device scale of 1, so each PNG is exactly that size. tests/test_report_screenshots.py runs
this end to end into a temporary directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import stepdump
from stepdump.export import write_report

log = logging.getLogger("make_screenshots")

#: Viewport of every screenshot (CSS pixels, device scale 1): the PNGs are this size.
VIEWPORT = (1280, 800)
#: The PNGs written, in the order docs/report.md shows them.
SHOTS = ("report-single.png", "report-compare.png", "report-compare-scalars.png", "report-live.png")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VOCAB, BLOCK, DIM = 65, 16, 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)  # causal
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-style model small enough to train for the screenshots in seconds on a CPU."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(BLOCK, DIM)
        self.h = nn.ModuleList(_Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``t``: the same tokens in every run (a repeating pattern with noise, so the loss falls)."""
    g = torch.Generator().manual_seed(t)
    start = torch.randint(0, VOCAB, (8, 1), generator=g)
    seq = (start + torch.arange(BLOCK + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def train(path: Path, steps: int, lr_at: Callable[[int], float],
          between: Callable[[int], None] | None = None) -> Path:
    """Record ``steps`` updates of the tiny GPT at ``path`` (full every 10th step, stats between);
    ``between(t)`` runs after update t (the live screenshot waits there)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.1)
    with stepdump.Recorder(path, model, opt, every=10, metadata={"batch_size": 8, "seed": 0}) as rec:
        for t in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(t)
            x, y = _batch(t)
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            rec.log(loss=loss)
            if between is not None:
                between(t)
    return path


def chromium() -> str:
    """Debian's chromium (never ``playwright install``), or ``STEPDUMP_CHROMIUM``."""
    exe = os.environ.get("STEPDUMP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(exe).exists():
        raise SystemExit(f"chromium not found ({exe}): apt-get install chromium, or set STEPDUMP_CHROMIUM")
    return exe


def _shoot(browser: object, url: str, out: Path, scroll_to: str | None = None,
           wait: Callable[[object], None] | None = None, script: str | None = None) -> Path:
    page = browser.new_page(viewport={"width": VIEWPORT[0], "height": VIEWPORT[1]},  # type: ignore[attr-defined]
                            device_scale_factor=1)
    try:
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        if wait is not None:
            wait(page)
        if script is not None:
            page.evaluate(script)
        if scroll_to is not None:
            # below the sticky bar of controls, which would hide the section's title
            page.eval_on_selector(scroll_to, "e => { e.scrollIntoView({block: 'start'}); window.scrollBy(0, -60); }")
        page.wait_for_timeout(300)  # let the charts finish drawing after a scroll
        page.screenshot(path=str(out))
    finally:
        page.close()
    return out


def make(out: Path, steps: int = 60, work: Path | None = None) -> list[Path]:
    """Record the runs under ``work`` (a temporary directory if None) and write :data:`SHOTS` to ``out``."""
    from playwright.sync_api import sync_playwright

    if steps < 20:
        raise SystemExit("--steps: give at least 20 (the lr changes at the middle; the live page needs steps to add)")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # a tiny model: one thread is faster on a busy machine, and the runs repeat exactly
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="stepdump-shots-")) if work is None else work
    try:
        half = steps // 2
        base = train(work / "base", steps, lambda t: 3e-3)
        lr10 = train(work / "lr10", steps, lambda t: 3e-3 if t < half else 3e-2)
        with stepdump.open(base) as a, stepdump.open(lr10) as b:
            write_report(a, work / "single.html")
            write_report([a, b], work / "compare.html", labels=["base", "lr10"])
        shots = [out / s for s in SHOTS]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
            try:
                _shoot(browser, (work / "single.html").as_uri(), shots[0], scroll_to="#layers")
                # the run table folded, so the reading and the norm-difference heatmap show together
                _shoot(browser, (work / "compare.html").as_uri(), shots[1], scroll_to="#compare",
                       script="document.querySelector('#compare details').open = false")
                _shoot(browser, (work / "compare.html").as_uri(), shots[2], scroll_to="#scalars")
                _live(browser, work / "live", steps, shots[3])
            finally:
                browser.close()
        return shots
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _live(browser: object, path: Path, steps: int, shot: Path) -> None:
    """Record a run while ``stepdump report --watch`` serves it; shoot once the page shows later steps."""
    proc: subprocess.Popen[str] | None = None
    first = steps // 2

    def between(t: int) -> None:
        nonlocal proc
        if t + 1 == first:  # the first half is recorded: start serving it
            proc = subprocess.Popen([sys.executable, "-m", "stepdump", "report", "--watch", str(path),
                                     "--port", "0", "--interval", "0.5"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        elif t + 1 == steps - 1:  # one update before the end: the run is still being recorded
            line = proc.stdout.readline() if proc is not None and proc.stdout else ""
            if " at " not in line:
                raise SystemExit(f"stepdump report --watch did not start: {line!r}")
            url = line.split(" at ", 1)[1].split()[0]

            def refreshed(page: object) -> None:  # the page polled and shows steps recorded after it opened
                page.wait_for_function(  # type: ignore[attr-defined]
                    "n => parseInt(document.querySelector(\"#summary [data-key='Steps recorded'] dd\").textContent) >= n",
                    arg=steps - 1, timeout=30_000)

            _shoot(browser, url, shot, wait=refreshed)

    try:
        train(path, steps, lambda t: 3e-3, between=between)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                   help="directory for the PNGs (default: docs/screenshots)")
    p.add_argument("--steps", type=int, default=60, help="updates per run (default 60)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for shot in make(args.out, args.steps):
        log.info("wrote %s (%d bytes)", shot, shot.stat().st_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
