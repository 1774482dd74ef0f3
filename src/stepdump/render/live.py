"""``stepdump report --watch``: the report as a small local web page that follows a run being recorded.

A run can be read while its Recorder writes (a step is visible once its catalog transaction
commits; ``run.live`` is True meanwhile). :class:`LiveReport` reopens the runs on each poll,
looks at how far they got (a few catalog reads) and rebuilds the report data only when that
moved on, so an idle page costs next to nothing and a busy one costs one report build per new
step at most per poll. :func:`serve` serves it on a local port:

* ``GET /``: the report page (the same page ``stepdump report`` writes), told to poll;
* ``GET /data.json``: ``{"version", "data", "summary_html", "findings_html", "nfindings", "compare_html", "ranks_html"}``,
  where ``version`` changes whenever the data do.

The server binds to 127.0.0.1 unless told otherwise; it only reads the runs. It answers only
requests whose ``Host`` names this machine's loopback (``localhost``, ``127.0.0.1``, ``[::1]``),
the bound address or a name given in ``allowed_hosts``, with the served port or none: a web page
that rebinds its own domain name to 127.0.0.1 (DNS rebinding) gets 403, not the runs. Error
responses carry the standard reason phrase only; the error text goes, HTML-escaped, into the
body (it can hold a run's path, which may hold any character).

Each connection has ``request_timeout_s`` to send its request (every read waits at most that
long, and a reaper closes a connection whose request is still incomplete that long after it
was accepted, however slowly it trickles in) and to take its response; at most
``max_connections`` are served at once, and one beyond them is answered 503 and closed at once.
Without these, each half-sent request held a thread and a file descriptor forever, and about a
thousand of them stopped the server from accepting anyone.
"""

from __future__ import annotations

import html
import json
import logging
import os
import socket
import sys
import threading
import time
from http import HTTPStatus
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stepdump.errors import ConfigError

log = logging.getLogger(__name__)


class LiveReport:
    """The current report of some runs, rebuilt when they change (see the module docstring).

    Args:
        paths: The runs (anything :func:`stepdump.open` takes).
        labels: A label per run (default: directory names).
        interval_s: How often the page polls.
        max_points: As for :func:`~stepdump.analysis.report.build_report_data`.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None,
                 interval_s: float = 2.0, max_points: int = 2000) -> None:
        if not paths:
            raise ConfigError("stepdump report --watch needs at least one run")
        if not interval_s > 0:
            raise ConfigError(f"interval {interval_s} s: give a positive number of seconds")
        self.paths = [os.fspath(p) for p in paths]
        self.labels = list(labels) if labels else None
        self.interval_s = float(interval_s)
        self.max_points = max_points
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._version = 0
        self._doc: dict[str, Any] = {}

    def _open(self) -> list[Any]:
        import stepdump

        return [stepdump.open(p) for p in self.paths]

    @staticmethod
    def _where(run: Any) -> tuple[Any, ...]:
        """How far a run got: enough to tell that its report would change."""
        steps = run.all_steps
        return (len(steps), steps[-1] if steps else None, run.live, "recording_stopped" in run.meta)

    def current(self) -> dict[str, Any]:
        """The document ``/data.json`` serves, rebuilt if a run moved on since the last call."""
        from stepdump.analysis.report_overlay import build_overlay_data
        from stepdump.render.html import fragments, page_json

        with self._lock:
            runs = self._open()
            try:
                key = tuple(self._where(r) for r in runs)
                if key != self._key:
                    data = build_overlay_data(runs, self.labels, max_points=self.max_points)
                    self._version += 1
                    self._doc = {"version": self._version, "data_json": page_json(data), **fragments(data),
                                 "data": data}
                    self._key = key
                    log.info("report --watch: rebuilt (version %d, %s)", self._version, key)
            finally:
                for r in runs:
                    r.close()
            return self._doc

    def data_json(self) -> bytes:
        """``/data.json``'s body."""
        doc = self.current()
        head = json.dumps({k: doc[k] for k in ("version", "summary_html", "findings_html", "nfindings", "compare_html",
                                               "ranks_html")},
                          separators=(",", ":"))
        return (head[:-1] + ',"data":' + doc["data_json"] + "}").encode("utf-8")

    def page(self) -> bytes:
        """``/``'s body: the report page, polling ``data.json``."""
        from stepdump.render.html import render_report

        doc = self.current()
        live = {"url": "data.json", "interval_ms": int(self.interval_s * 1000), "version": doc["version"]}
        return render_report(doc["data"], live=live).encode("utf-8")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
#: Seconds a connection has to send its whole request (and each read or write may wait).
REQUEST_TIMEOUT_S = 10.0
#: Connections served at once; one more is answered 503 and closed.
MAX_CONNECTIONS = 32
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 37\r\n"
         b"Connection: close\r\n\r\ntoo many connections; try again soon\n")


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``max_connections`` at once and closes a
    connection whose request is not complete ``request_timeout_s`` after it was accepted."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, request_timeout_s: float, max_connections: int) -> None:
        if not request_timeout_s > 0 or max_connections < 1:
            raise ConfigError(f"request_timeout_s={request_timeout_s}, max_connections={max_connections}: give a "
                              "positive timeout and at least one connection")
        self.request_timeout_s = float(request_timeout_s)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}  # connections still sending their request
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # every slot taken: say so now, hold nothing
            try:
                request.settimeout(0.5)
                request.sendall(_BUSY)
            except OSError:
                pass
            log.warning("report --watch: %d connections open already; refused one", len(self._deadlines))
            self.shutdown_request(request)
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + self.request_timeout_s
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def request_read(self, request: Any) -> None:
        """The handler has the whole request: building the answer is not bounded by the deadline."""
        with self._lock:
            self._deadlines.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection cut (closed at its deadline, reset by the client): logged, not a traceback on stderr."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("report --watch: connection from %s ended: %s", client_address, err)
            return
        super().handle_error(request, client_address)

    def service_actions(self) -> None:
        """Called by serve_forever at every poll: close connections past their deadline (their
        handler's read then ends, and with it the thread)."""
        now = time.monotonic()
        with self._lock:
            late = [s for s, due in self._deadlines.items() if due <= now]
            for s in late:
                del self._deadlines[s]
        for s in late:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def host_allowed(header: str, port: int, names: set[str]) -> bool:
    """Whether a request's ``Host`` header is one of ``names`` (lower case), with ``port`` or none."""
    h = header.strip().lower()
    if h.startswith("["):  # an IPv6 literal: [::1]:8765
        end = h.find("]") + 1
        if end == 0:
            return False
        name, rest = h[:end], h[end:]
    else:
        name, colon, given = h.partition(":")
        rest = colon + given
    if rest and rest != f":{port}":
        return False
    return name.removesuffix(".") in names  # "localhost." is localhost


def make_server(report: LiveReport, host: str = "127.0.0.1", port: int = 0,
                allowed_hosts: Sequence[str] = (), *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> BoundedServer:
    """An HTTP server for ``report`` bound to ``host:port`` (0: any free port), not yet serving.

    Requests are answered only when their ``Host`` header is a loopback name, ``host`` itself or
    one of ``allowed_hosts`` (the names a browser on another machine uses for this one, when
    ``host`` is not a loopback address), with the bound port or none. ``request_timeout_s`` and
    ``max_connections``: the bounds of the module docstring (the reaper runs at each poll of
    ``serve_forever``).
    """

    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout_s  # every read and write of the connection (StreamRequestHandler.setup)

        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            self.server.request_read(self.connection)  # type: ignore[attr-defined]
            host_header = self.headers.get("Host")
            if host_header is None:
                self.send_error(400, "a request without a Host header")
                return
            if not host_allowed(host_header, bound_port, names):
                log.warning("report --watch: refused a request for Host %r", host_header)
                self.send_error(403, f"this server answers requests for {', '.join(sorted(names))} only "
                                     "(a page on another site may be trying to read the report through DNS "
                                     "rebinding); to serve it under another name, start it with "
                                     "stepdump report --watch --allow-host NAME")
                return
            route: dict[str, tuple[Callable[[], bytes], str]] = {
                "/": (report.page, "text/html; charset=utf-8"),
                "/index.html": (report.page, "text/html; charset=utf-8"),
                "/data.json": (report.data_json, "application/json"),
            }
            target = route.get(self.path.split("?", 1)[0])
            if target is None:
                self.send_error(404, "the report is at / and its data at /data.json")
                return
            try:
                body = target[0]()
            except Exception as e:  # a damaged or vanished run: say so, keep serving
                log.warning("report --watch: %s", e)
                self.send_error(500, f"{type(e).__name__}: {e}")
                return
            self._reply(200, body, target[1])

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """Every error, ours and http.server's: the fixed reason phrase in the status line (a
            message there could split the response with CR/LF or fail to encode), the text escaped
            in the body."""
            try:
                status = HTTPStatus(code)
                phrase, text = status.phrase, message or status.description
            except ValueError:
                phrase, text = "Error", message or ""
            self.close_connection = True
            body = (f"<!doctype html><meta charset='utf-8'><title>{code} {phrase}</title>"
                    f"<h1>{code} {phrase}</h1><p>{html.escape(text)}</p>").encode("utf-8", "replace")
            self._reply(code, body, "text/html; charset=utf-8", phrase)

        def _reply(self, code: int, body: bytes, ctype: str, phrase: str | None = None) -> None:
            self.send_response(code, phrase)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # requests go to logging, not stderr
            log.debug("report --watch: " + format, *args)

    server = BoundedServer((host, port), Handler, request_timeout_s, max_connections)
    bound_port = int(server.server_address[1])
    bound = str(server.server_address[0]).lower()
    names = {*LOOPBACK_NAMES, f"[{bound}]" if ":" in bound else bound,
             *(h.strip().lower().removesuffix(".") for h in allowed_hosts)}
    return server


def serve(report: LiveReport, host: str = "127.0.0.1", port: int = 0,
          ready: Callable[[str], None] | None = None, allowed_hosts: Sequence[str] = ()) -> None:
    """Serve ``report`` until interrupted; ``ready(url)`` is called once the port is bound.
    ``allowed_hosts``: as for :func:`make_server`."""
    server = make_server(report, host, port, allowed_hosts)
    try:
        report.current()  # fail now, not on the first request, when a run cannot be read
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        if ready is not None:
            ready(f"http://{bound_host}:{bound_port}/")
        server.serve_forever(poll_interval=0.25)
    finally:
        server.server_close()
