"""``stepdump report --watch``: the report as a small local web page that follows a run being recorded.

A run can be read while its Recorder writes (a step is visible once its catalog transaction
commits; ``run.live`` is True meanwhile). :class:`LiveReport` reopens the runs on each poll,
looks at how far they got (a few catalog reads) and rebuilds the report data only when that
moved on, so an idle page costs next to nothing and a busy one costs one report build per new
step at most per poll. :func:`serve` serves it on a local port:

* ``GET /``: the report page (the same page ``stepdump report`` writes), told to poll;
* ``GET /data.json``: ``{"version", "data", "summary_html", "findings_html", "nfindings"}``,
  where ``version`` changes whenever the data do.

The server binds to 127.0.0.1 unless told otherwise; it only reads the runs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
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
        head = json.dumps({k: doc[k] for k in ("version", "summary_html", "findings_html", "nfindings")},
                          separators=(",", ":"))
        return (head[:-1] + ',"data":' + doc["data_json"] + "}").encode("utf-8")

    def page(self) -> bytes:
        """``/``'s body: the report page, polling ``data.json``."""
        from stepdump.render.html import render_report

        doc = self.current()
        live = {"url": "data.json", "interval_ms": int(self.interval_s * 1000), "version": doc["version"]}
        return render_report(doc["data"], live=live).encode("utf-8")


def make_server(report: LiveReport, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for ``report`` bound to ``host:port`` (0: any free port), not yet serving."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
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
            self.send_response(200)
            self.send_header("Content-Type", target[1])
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # requests go to logging, not stderr
            log.debug("report --watch: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(report: LiveReport, host: str = "127.0.0.1", port: int = 0,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve ``report`` until interrupted; ``ready(url)`` is called once the port is bound."""
    server = make_server(report, host, port)
    try:
        report.current()  # fail now, not on the first request, when a run cannot be read
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        if ready is not None:
            ready(f"http://{bound_host}:{bound_port}/")
        server.serve_forever(poll_interval=0.25)
    finally:
        server.server_close()
