"""A real HTTP receiver of job-end callbacks for the tests (http.server on 127.0.0.1, a random port).

What it answers depends on the path:

* ``/flaky/<n>/...``: 503 to the first ``n`` requests on that path, then 200
* ``/status/<code>/...``: always ``code``
* ``/down/...``: 503 while ``receiver.down`` is set, then 200
* ``/slow/...``: 200 once ``receiver.release`` is set (or after 20 s)
* anything else: 200
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None  # what the receiver answered (None: still answering)

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def delivery(self) -> str:
        return self.headers.get("x-dagfold-delivery", "")


class Receiver:
    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.lock = threading.Lock()
        self.down = threading.Event()
        self.release = threading.Event()
        self._seen: dict[str, int] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rec = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with receiver.lock:
                    receiver.requests.append(rec)  # on arrival: a slow answer is seen as in flight
                rec.status = status = receiver._answer(self.path)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _answer(self, path: str) -> int:
        parts = path.strip("/").split("/")
        with self.lock:
            n = self._seen[path] = self._seen.get(path, 0) + 1
        if parts[0] == "flaky":
            return 503 if n <= int(parts[1]) else 200
        if parts[0] == "status":
            return int(parts[1])
        if parts[0] == "down":
            return 503 if self.down.is_set() else 200
        if parts[0] == "slow":
            self.release.wait(20)
        return 200

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def of(self, delivery_id: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.delivery == delivery_id]

    def wait_for(self, delivery_id: str, n: int = 1, timeout_s: float = 30.0) -> list[Received]:
        """The requests of a delivery once there are at least ``n`` (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.of(delivery_id)
            if len(got) >= n:
                return got
            time.sleep(0.02)
        raise AssertionError(f"{delivery_id}: {len(self.of(delivery_id))} requests after {timeout_s}s, wanted {n}")

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
