"""A 3-broker KRaft cluster on loopback, or on hosts of its own, run by the project's ``deploy/kafka/kafka.sh``.

With ``hosts`` (``tests.netns_support.Host``, one per broker) each broker runs in its host's network namespace
and listens on that host's address, so a network fault can isolate one broker from the other two
(``isolate``: its routes to the other brokers go, clients still reach it) while they go on without it.

``kafka.sh start`` starts the brokers that are not running (and waits until the
cluster metadata lists all of them), so restarting one killed broker is
``kill -9`` its pid, then ``start`` again. Before another broker may be killed
the cluster must be whole again: every broker registered and every partition's
ISR complete (``healthy``), so no partition ever has fewer than two in-sync
replicas because of the harness.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from dagfold.localkafka import LocalKafka
from dagfold.localkafka import free_base_port as free_base_port_among

ROOT = Path(__file__).resolve().parent.parent
BROKERS = 3


def free_base_port(start: int = 30192, stop: int = 31700, step: int = 100) -> int:
    """A client port p with p..p+2 and the controller ports p+1000..p+1002 free.

    Below the ephemeral range (32768 up on Linux): a killed broker must get its ports back
    when it restarts, which an outgoing connection holding one would prevent.
    """
    return free_base_port_among(range(start, stop, step), BROKERS)


class BrokerCluster:
    def __init__(self, data: Path, port: int | None = None, heap: str = "-Xmx384m -Xms128m",
                 host: str = "127.0.0.1", hosts: Sequence[Any] = ()) -> None:
        if hosts and len(hosts) != BROKERS:
            raise ValueError(f"one host per broker ({BROKERS})")
        self.data = data
        self.port = port if port is not None else free_base_port()
        self.heap = heap
        self.host = host  # the address the brokers listen on (a test network's hub for partition faults)
        self.hosts = list(hosts)  # or a host of its own per broker (tests.netns_support.Host)
        self.local = LocalKafka(self.port, self.data, BROKERS,
                                {"KAFKA_HEAP_OPTS": self.heap, "KAFKA_START_TIMEOUT": "180"}, host=self.host,
                                hosts=tuple(h.addr for h in self.hosts), netns=tuple(h.ns for h in self.hosts))
        self.bootstrap = self.local.bootstrap
        self.addresses = [self.local.address(i) for i in range(BROKERS)]
        self.isolated: int | None = None  # the broker cut from the other two now (1-based)
        self._admin: AdminClient | None = None

    def _sh(self, cmd: str, timeout: float = 240) -> str:
        return self.local.sh(cmd, timeout=timeout)

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        self._sh("start")

    def stop(self) -> None:
        try:
            self._sh("stop", timeout=120)
        except (RuntimeError, subprocess.TimeoutExpired):
            for i in range(1, BROKERS + 1):
                self.kill9(i)

    # -- one broker -----------------------------------------------------------
    def node_dir(self, node: int) -> Path:
        return self.data / f"node-{node}"

    def pid(self, node: int) -> int | None:
        """The broker's pid if it runs (checked against its command line: pids get reused)."""
        try:
            pid = int((self.node_dir(node) / "kafka.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            return None
        want = f"kafka.Kafka {self.node_dir(node)}/server.properties".encode()
        return pid if want in cmdline else None

    def running(self) -> list[int]:
        return [n for n in range(1, BROKERS + 1) if self.pid(n) is not None]

    def kill9(self, node: int) -> bool:
        pid = self.pid(node)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + 10
        while self.pid(node) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def restart_missing(self) -> None:
        """Start every broker that is not running (``kafka.sh start``)."""
        self._sh("start")

    # -- network faults (brokers on hosts of their own) ------------------------------
    def isolate(self, node: int) -> None:
        """Cut broker ``node`` from the other two brokers: its routes to their addresses go through a neighbour
        that does not exist, so neither direction of a connection between them gets through (their packets
        reach it, its answers die), while every client still reaches it, as it reaches the others. Its
        partitions' followers stop fetching, the controller quorum goes on without it (and fences it after
        the broker session timeout), and clients that still talk to it find a leader that cannot commit."""
        if not self.hosts:
            raise RuntimeError("isolating a broker needs brokers on hosts of their own")
        host = self.hosts[node - 1]
        host.cut_from([a for i, a in enumerate(self.addresses) if i != node - 1])
        self.isolated = node

    def heal(self) -> None:
        if self.isolated is not None:
            self.hosts[self.isolated - 1].heal()
            self.isolated = None

    # -- health ---------------------------------------------------------------
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        return self._admin

    def registered(self) -> set[int] | None:
        """Brokers in the cluster metadata (a killed broker stays there until the controller fences it)."""
        try:
            return set(self.admin().list_topics(timeout=5).brokers)
        except Exception:
            return None

    def under_replicated(self) -> int | None:
        """Partitions whose ISR lacks a replica or whose leader is not running (None: metadata unreadable)."""
        try:
            md = self.admin().list_topics(timeout=5)
        except Exception:
            return None
        if len(md.brokers) < BROKERS:
            return None
        running = set(self.running())
        n = 0
        for t in md.topics.values():
            if t.error is not None:
                return None
            for p in t.partitions.values():
                if p.error is not None or p.leader not in running or len(p.isrs) < len(p.replicas):
                    n += 1
        return n

    def healthy(self) -> bool:
        return self.isolated is None and len(self.running()) == BROKERS and self.under_replicated() == 0

    def wait_healthy(self, timeout_s: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return True
            time.sleep(0.5)
        return False
