"""``stepdump report --watch`` (issue 15): the CLI in a subprocess serves the report of a run
that a Recorder is still writing, and the page in headless Chromium follows new steps."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import torch
from helpers import tiny_batch, tiny_model
from test_report import CHROMIUM_ARGS, _chromium
from torch import nn

import stepdump


def _train(rec: stepdump.Recorder, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        x, y = tiny_batch(t)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        rec.log(loss=loss)


def _steps_shown(page: object) -> str:
    return page.inner_text("#summary [data-key='Steps recorded'] dd")  # type: ignore[attr-defined]


def test_watch_page_follows_a_run_being_recorded(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "live"
    rec = stepdump.Recorder(path, model, opt)
    proc = None
    try:
        _train(rec, model, opt, range(0, 5))
        proc = subprocess.Popen([sys.executable, "-m", "stepdump", "report", "--watch", str(path), "--port", "0",
                                 "--interval", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving the report" in line, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "data.json") as r:  # the data endpoint answers JSON
            assert r.headers["Content-Type"] == "application/json" and b'"version"' in r.read()

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                problems: list[str] = []
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=15_000)
                first = int(_steps_shown(page).split()[0])
                version = int(page.evaluate("document.body.dataset.version"))
                assert 1 <= first <= 5 and page.is_visible("#live-status")
                page.select_option("#layer-select", "2.weight")  # a choice the refresh must keep

                _train(rec, model, opt, range(5, 20))  # the Recorder is still open: run.live
                page.wait_for_function("() => document.querySelector(\"#summary [data-key='Steps recorded'] dd\")"
                                       ".textContent.startsWith('20 ')", timeout=20_000)
                assert int(page.evaluate("document.body.dataset.version")) > version
                loss = page.evaluate("JSON.parse(document.querySelector(\"canvas[data-plot='scalar:loss']\").dataset.series)")
                assert len(loss) == 1 and 19 <= loss[0]["points"] <= 20  # the last iteration's scalars land with the next step
                assert page.input_value("#layer-select") == "2.weight"
                grad = page.evaluate("JSON.parse(document.querySelector(\"canvas[data-plot='layer:grad_norm']\").dataset.series)")
                assert grad == [{"label": "2.weight gradient L2 norm", "points": 20}]
                assert "still being recorded" in page.inner_text("#summary")
            finally:
                browser.close()
        assert problems == []
    finally:
        rec.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def test_watch_of_a_missing_run_fails_before_serving(tmp_path: Path) -> None:
    from stepdump.cli.main import main

    assert main(["report", "--watch", str(tmp_path / "no-such-run"), "--port", "0"]) == 3  # not found
