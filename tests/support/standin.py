"""A stand-in inference instance on a loopback port: a real HTTP server that records what the
Placement Controller sends it (PUT state, POST prefetch, POST resume) and answers as a node
would, so the controller's side of each exchange is tested over real HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.waiting import wait_until


class StandinNode:
    def __init__(self, port: int = 0):
        """``port``: one a previous stand-in had, to bring a node back up at its URL."""
        self.requests: list[tuple[str, str, dict | None]] = []
        self.directives: dict[str, dict] = {}
        # Per-route overrides: (method, path prefix) -> (status, body or None).
        self.answers: dict[tuple[str, str], tuple[int, dict | None]] = {}
        # Per-route delays before answering, in seconds: a slow or hung instance.
        self.delays: dict[tuple[str, str], float] = {}
        # Per-route events to wait for before answering: an instance that answers when the
        # test says so.
        self.holds: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict | None, headers=()):
                payload = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                content_type = "application/problem+json" if status >= 400 else "application/json"
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _handle(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with node._lock:
                    node.requests.append((method, self.path, body))
                for (route_method, prefix), seconds in list(node.delays.items()):
                    if route_method == method and self.path.startswith(prefix):
                        time.sleep(seconds)
                for (route_method, prefix), gate in list(node.holds.items()):
                    if route_method == method and self.path.startswith(prefix):
                        gate.wait(timeout=120)
                for (route_method, prefix), (status, answer) in node.answers.items():
                    if route_method == method and self.path.startswith(prefix):
                        return self._answer(status, answer)
                if method == "POST" and self.path == "/kvsp/prefetch":
                    node.directives[body["directive"]] = body
                    location = f"/kvsp/prefetch/{body['directive']}"
                    return self._answer(
                        202, {"directive": body["directive"]}, [("Location", location)]
                    )
                if method == "GET" and self.path.startswith("/kvsp/prefetch/"):
                    directive = node.directives.get(self.path.rsplit("/", 1)[-1])
                    if directive is None:
                        return self._answer(404, {"type": "kvsp-not-found", "detail": "no"})
                    loaded = [block["block_key"] for block in directive["blocks"]]
                    state = {"directive": directive["directive"], "state": "complete"}
                    return self._answer(200, {**state, "loaded": loaded, "reason": None})
                if method in ("PUT", "POST"):
                    return self._answer(200, {"ok": True})
                return self._answer(404, {"type": "kvsp-not-found", "detail": "no"})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/kvsp/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandinNode:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def received(self, method: str, path_prefix: str) -> list[dict | None]:
        with self._lock:
            return [b for m, p, b in self.requests if m == method and p.startswith(path_prefix)]

    def wait_for(self, method: str, path_prefix: str, count: int = 1, timeout: float = 30):
        return wait_until(
            lambda: len(found := self.received(method, path_prefix)) >= count and found,
            f"{count} {method} {path_prefix}",
            timeout,
        )
