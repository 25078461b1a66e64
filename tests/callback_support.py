"""A real HTTP receiver of job-end callbacks for the tests (http.server on 127.0.0.1, a random port).

What it answers depends on the path:

* ``/flaky/<n>/...``: 503 to the first ``n`` requests on that path, then 200
* ``/status/<code>/...``: always ``code``
* ``/down/...``: 503 while ``receiver.down`` is set, then 200
* ``/slow/...``: 200 once ``receiver.release`` is set (or after 20 s)
* ``/drip/<ms>/...``: the answer's status line one byte every ``<ms>`` milliseconds (a receiver that
  never times out a read and never finishes: issue 24, recipe 6); ``finished`` counts those that did
* anything else: 200

The notifier refuses loopback destinations unless the operator allows them: ``LOOPBACK`` (for
``CallbackOptions(egress=...)``) and ``allow_loopback`` (for a Stack, which reads the environment)
are the tests' explicit allow list.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import default_codec, make
from dagfold.config import EVENTS, Config
from dagfold.log.embedded import EmbeddedLog
from dagfold.log.reader import position_key
from dagfold.projections.store import ReadModelStore
from dagfold.services.callbacks import LEDGER_DIR, CallbackNotifier
from dagfold.services.callbacks.egress import ENV_ALLOW, EgressRules, parse_allow

LOOPBACK_CIDR = "127.0.0.1/32"
LOOPBACK = EgressRules(allow=parse_allow(LOOPBACK_CIDR))


def allow_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a Stack's notifier (it reads DAGFOLD_CALLBACK_*) call the receivers on 127.0.0.1."""
    monkeypatch.setenv(ENV_ALLOW, LOOPBACK_CIDR)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None  # what the receiver answered (None: still answering)
    at: float = field(default_factory=time.time)  # arrival, Unix seconds

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def delivery(self) -> str:
        return self.headers.get("x-dagfold-delivery", "")


class Receiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[Received] = []
        self.lock = threading.Lock()
        self.down = threading.Event()
        self.release = threading.Event()
        self._seen: dict[str, int] = {}
        self.dripping = 0  # drip answers being sent now
        self.most_dripping = 0  # the most at once
        self.finished = 0  # drip answers sent to the end
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rec = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with receiver.lock:
                    receiver.requests.append(rec)  # on arrival: a slow answer is seen as in flight
                if self.path.startswith("/drip/"):
                    receiver._drip(self, int(self.path.split("/")[2]) / 1000)
                    return
                rec.status = status = receiver._answer(self.path)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.host = host
        self.server = ThreadingHTTPServer((host, 0), Handler)
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

    def _drip(self, handler: BaseHTTPRequestHandler, every_s: float) -> None:
        with self.lock:
            self.dripping += 1
            self.most_dripping = max(self.most_dripping, self.dripping)
        conn = handler.connection
        try:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                if select.select([conn], [], [], every_s)[0] and not conn.recv(1, socket.MSG_PEEK):
                    return  # the notifier hung up (its deadline): counted as done at once
                if self.release.is_set():
                    return
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            with self.lock:
                self.finished += 1
        except OSError:
            return  # the notifier hung up (its deadline)
        finally:
            with self.lock:
                self.dripping -= 1
            handler.close_connection = True

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

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


# -- the events a scheduler would write, and stepping a notifier --------------------------------
class EventLog:
    """The embedded log with the events a scheduler would write."""

    def __init__(self, tmp: Path) -> None:
        self.config = Config(partitions=2)
        self.log = EmbeddedLog(tmp / "log")
        self.log.create_topics(self.config.core_topics())
        self._producer = self.log.producer("test")
        self.ts = int(time.time() * 1000)

    def emit(self, name: str, job_id: str, **fields: Any) -> None:
        self.ts += 1
        ev = make("dagfold.event." + name, job_id=job_id, ts_ms=self.ts, **fields)
        self._producer.send(EVENTS, job_id.encode(), default_codec().encode(ev))
        self._producer.flush()

    def accept(self, job_id: str, url: str | None, tenant: str = "acme") -> None:
        task = make("dagfold.common.TaskSpec", task_id="a", handler="noop")
        self.emit("JobAccepted", job_id, spec=make("dagfold.common.JobSpec", job_id=job_id, tenant=tenant,
                                                   callback_url=url, tasks=[task]))

    def forget_positions(self, data_dir: Path) -> None:
        """Drop the positions from the (closed) notifier's ledger in ``data_dir``: a ledger written before it
        kept its positions reads every event again."""
        store = ReadModelStore(data_dir / LEDGER_DIR)
        txn = store.txn()
        for p in range(self.config.partitions):
            txn.delete(position_key(EVENTS, p))
        store.commit(txn)
        store.close()

    def close(self) -> None:
        self._producer.close()
        self.log.close()


def pump(n: CallbackNotifier, until: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        n.step(0.05)


def pump_for(n: CallbackNotifier, seconds: float) -> int:
    """Step for ``seconds``; returns the event records read."""
    read = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        read += n.step(0.05)
    return read
