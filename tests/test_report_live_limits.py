"""``stepdump report --watch`` bounds each connection's time and how many it serves at once.

A half-sent request used to hold a thread and a file descriptor forever: at a 1,024-descriptor
limit about 1,026 of them stopped the server from accepting anyone. Here, with real sockets on
127.0.0.1 only and a short ``request_timeout_s``: half-sent requests and a request trickled a
byte at a time (each byte inside the per-read timeout) are closed by the server; a connection
beyond ``max_connections`` is answered 503 at once, never queued; once the slow ones are gone a
normal request is served. Every loop here is bounded in time.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from test_report_live import _get, _train

import stepdump
from stepdump.render.live import LiveReport, make_server

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("limits") / "run"
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(path, model, opt) as rec:
        _train(rec, model, opt, range(3))
    srv = make_server(LiveReport([path]), "127.0.0.1", 0, request_timeout_s=TIMEOUT_S, max_connections=4)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _half_sent(srv) -> socket.socket:
    s = socket.create_connection(srv.server_address[:2], timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHo")
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``s`` within ``seconds`` (and what it sent first)."""
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            break
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_half_sent_requests_are_closed_and_the_server_serves_again(server) -> None:
    held = [_half_sent(server) for _ in range(4)]
    try:
        started = time.monotonic()
        for s in held:
            closed, _ = _closed_within(s, TIMEOUT_S + 5)
            assert closed, "a half-sent request was held open past the timeout"
        assert time.monotonic() - started < TIMEOUT_S + 5
    finally:
        for s in held:
            s.close()
    head, body = _get(server, "/data.json")
    assert head.startswith(b"HTTP/1.0 200 OK"), head


def test_a_trickled_request_is_closed_at_the_connection_deadline(server) -> None:
    s = socket.create_connection(server.server_address[:2], timeout=10)
    try:
        started = time.monotonic()
        closed = False
        for byte in b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 200:  # a byte every 0.1 s: never idle past a read timeout
            if time.monotonic() - started > TIMEOUT_S + 5:
                break
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            closed, _ = _closed_within(s, 0.1)
            if closed:
                break
        assert closed, "a request trickled a byte at a time was served past the connection deadline"
        assert time.monotonic() - started < TIMEOUT_S + 5
    finally:
        s.close()


def test_connections_beyond_the_limit_are_refused_at_once(server) -> None:
    held = [_half_sent(server) for _ in range(4)]
    try:
        time.sleep(0.1)  # the four are accepted and hold every slot
        extra = socket.create_connection(server.server_address[:2], timeout=10)
        try:
            closed, got = _closed_within(extra, TIMEOUT_S / 2)  # well before any slot frees
            assert closed and got.startswith(b"HTTP/1.0 503"), got
        finally:
            extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + TIMEOUT_S + 5
    while True:  # the held ones closed by us: their slots come back
        head, _ = _get(server, "/data.json")
        if head.startswith(b"HTTP/1.0 200 OK") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert head.startswith(b"HTTP/1.0 200 OK"), head
