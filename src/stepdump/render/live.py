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
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
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
                allowed_hosts: Sequence[str] = ()) -> ThreadingHTTPServer:
    """An HTTP server for ``report`` bound to ``host:port`` (0: any free port), not yet serving.

    Requests are answered only when their ``Host`` header is a loopback name, ``host`` itself or
    one of ``allowed_hosts`` (the names a browser on another machine uses for this one, when
    ``host`` is not a loopback address), with the bound port or none.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
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
