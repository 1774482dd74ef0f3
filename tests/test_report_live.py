"""``stepdump report --watch`` (issue 15): the CLI in a subprocess serves the report of a run
that a Recorder is still writing, and the page in headless Chromium follows new steps."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
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
                                 "--interval", "0.3", "--allow-host", "box.lan"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving the report" in line, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "data.json") as r:  # the data endpoint answers JSON
            assert r.headers["Content-Type"] == "application/json" and b'"version"' in r.read()
        with urllib.request.urlopen(urllib.request.Request(url + "data.json", headers={"Host": "box.lan"})) as r:
            assert r.status == 200  # --allow-host reached the server
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(urllib.request.Request(url + "data.json", headers={"Host": "evil.example"}))

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


# -- the server under hostile input (issue 22, item 12): real requests on a real socket ------------

ERROR_NAMES = {  # a run directory's name ends up in the error text when the run vanishes
    "crlf": "run\r\nX-Injected: yes\r\n\r\n<p>body</p>",
    "lf": "run\nSet-Cookie: a=b",
    "non-latin-1": "run-€-数据-🙂",
    "html": "run<script>alert(1)</script>&amp;",
}


def _serve(report: object, host: str = "127.0.0.1", allowed: tuple[str, ...] = ()):
    import threading

    from stepdump.render.live import make_server

    server = make_server(report, host, 0, allowed_hosts=allowed)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def _get(server: object, path: str = "/data.json", host: str | None = "default") -> tuple[bytes, bytes]:
    """One raw HTTP/1.1 GET; returns (the status line and headers, the body) as bytes."""
    import socket

    addr, port = server.server_address[:2]  # type: ignore[attr-defined]
    lines = [f"GET {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {addr}:{port}" if host == "default" else f"Host: {host}".replace("{port}", str(port)))
    req = ("\r\n".join([*lines, "Connection: close", "", ""])).encode("latin-1")
    with socket.create_connection((addr, port), timeout=20) as s:
        s.sendall(req)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def _recorded(path: Path) -> Path:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(path, model, opt) as rec:
        _train(rec, model, opt, range(3))
    return path


@pytest.mark.parametrize("name", ERROR_NAMES, ids=list(ERROR_NAMES))
def test_error_text_never_reaches_the_status_line(tmp_path: Path, name: str) -> None:
    import html
    import shutil

    from stepdump.render.live import LiveReport

    path = _recorded(tmp_path / ERROR_NAMES[name])
    server = _serve(LiveReport([path]))
    try:
        head, body = _get(server, "/")
        assert head.startswith(b"HTTP/1.0 200 OK\r\n"), head
        shutil.rmtree(path)  # the run vanishes while served: an error whose text holds its name
        for page in ("/", "/data.json"):
            head, body = _get(server, page)
            status, *headers = head.split(b"\r\n")
            assert status == b"HTTP/1.0 500 Internal Server Error", head
            assert all(h.split(b":")[0] in {b"Server", b"Date", b"Content-Type", b"Content-Length", b"Connection",
                                            b"Cache-Control", b"X-Content-Type-Options"} for h in headers), head
            assert b"X-Injected" not in head and b"Set-Cookie" not in head
            text = body.decode("utf-8")
            assert html.escape(str(path)) in text  # the error says which run, escaped
            assert "<script>" not in text and "<p>body" not in text
        head, _ = _get(server, "/nowhere")
        assert head.startswith(b"HTTP/1.0 404 Not Found\r\n"), head
    finally:
        server.shutdown()
        server.server_close()


REFUSED_HOSTS = ["evil.example:{port}", "127.0.0.1.evil.example:{port}", "localhost.evil.example:{port}",
                 "evil.example", "0.0.0.0:{port}", "127.0.0.2:{port}", "127.0.0.1:1", "localhost:{port}0", "",
                 "[::1]x:{port}", "127.0.0.1:{port}@evil.example", None]
SERVED_HOSTS = ["127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}", "[::1]:{port}", "127.0.0.1",
                "localhost", "localhost.:{port}"]


@pytest.fixture(scope="module")
def one_server(tmp_path_factory: pytest.TempPathFactory):
    from stepdump.render.live import LiveReport

    server = _serve(LiveReport([_recorded(tmp_path_factory.mktemp("hosts") / "run")]))
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("host", REFUSED_HOSTS, ids=[repr(h) for h in REFUSED_HOSTS])
def test_a_foreign_host_name_is_refused(one_server: object, host: str | None) -> None:
    for page in ("/", "/data.json"):
        head, body = _get(one_server, page, host)
        status = head.split(b"\r\n")[0]
        if host is None:  # no Host header at all
            assert status == b"HTTP/1.0 400 Bad Request", head
        else:
            assert status == b"HTTP/1.0 403 Forbidden", head
        assert b'"version"' not in body and b"<canvas" not in body  # nothing of the runs
        assert b"--allow-host" in body or host is None  # what to do


@pytest.mark.parametrize("host", SERVED_HOSTS, ids=SERVED_HOSTS)
def test_a_loopback_host_name_is_served(one_server: object, host: str) -> None:
    head, body = _get(one_server, "/data.json", host)
    assert head.startswith(b"HTTP/1.0 200 OK\r\n"), head
    assert body.startswith(b'{"version":')


def test_the_bound_address_and_allowed_names_are_served(tmp_path: Path) -> None:
    from stepdump.render.live import LiveReport

    server = _serve(LiveReport([_recorded(tmp_path / "run")]), host="127.0.0.2", allowed=("box.lan",))
    try:
        for host in ("127.0.0.2:{port}", "box.lan:{port}", "BOX.LAN", "localhost:{port}"):
            head, _ = _get(server, "/data.json", host)
            assert head.startswith(b"HTTP/1.0 200 OK\r\n"), (host, head)
        for host in ("127.0.0.3:{port}", "other.lan:{port}"):
            head, _ = _get(server, "/data.json", host)
            assert head.startswith(b"HTTP/1.0 403 Forbidden\r\n"), (host, head)
    finally:
        server.shutdown()
        server.server_close()
