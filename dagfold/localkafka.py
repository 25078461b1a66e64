"""The project's pinned local Kafka (``deploy/kafka/kafka.sh``), driven from Python.

The tests, the chaos harness and the benchmarks all start brokers on loopback;
this is the one place that knows how: free ports (a broker needs its client
port and its controller port, +1000) and the script's environment variables.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

KAFKA_SH = Path(__file__).resolve().parent.parent / "deploy" / "kafka" / "kafka.sh"


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (SO_REUSEADDR, so TIME_WAIT sockets don't count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(candidates: Iterable[int], brokers: int = 1) -> int:
    """The first candidate p whose client ports p.. and controller ports p+1000.. are all free."""
    for p in candidates:
        if all(port_free(p + i) and port_free(p + 1000 + i) for i in range(brokers)):
            return p
    raise RuntimeError("no free port range for a local Kafka broker")


@dataclass
class LocalKafka:
    """One local KRaft cluster (1 or 3 brokers) with its own ports and data folder."""

    port: int
    data: Path
    brokers: int = 1
    extra_env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # the address the brokers listen on and advertise (KAFKA_HOST)
    # or brokers on hosts of their own: one address each (KAFKA_HOSTS), and the network namespace each runs in
    # (KAFKA_NETNS; tests/netns_support.py's hosts)
    hosts: tuple[str, ...] = ()
    netns: tuple[str, ...] = ()

    def address(self, i: int) -> str:
        """The address broker ``i`` (0-based) listens on."""
        return self.hosts[i] if self.hosts else self.host

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.address(i)}:{self.port + i}" for i in range(self.brokers))

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "KAFKA_PORT": str(self.port), "KAFKA_BROKERS": str(self.brokers),
                "KAFKA_DATA": str(self.data),
                **({"KAFKA_HOST": self.host} if self.host != "127.0.0.1" else {}),
                **({"KAFKA_HOSTS": ",".join(self.hosts)} if self.hosts else {}),
                **({"KAFKA_NETNS": ",".join(self.netns)} if self.netns else {}), **self.extra_env}

    def sh(self, cmd: str, timeout: float = 300) -> str:
        """Run ``kafka.sh CMD``; a failure raises with the script's output."""
        p = subprocess.run([str(KAFKA_SH), cmd], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"kafka.sh {cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def start(self) -> LocalKafka:
        self.data.mkdir(parents=True, exist_ok=True)
        self.sh("start")
        return self

    def stop(self) -> None:
        """Stop the brokers; never raises (used in cleanups)."""
        subprocess.run([str(KAFKA_SH), "stop"], env=self.env(), capture_output=True, check=False)


@dataclass
class SecureLocalKafka(LocalKafka):
    """A local cluster with SASL/SCRAM-SHA-256 and ACLs (``KAFKA_SECURITY=sasl``): the log's trust boundary.

    The super user ``admin`` creates principals (``add_user``) and grants them operations (``allow``);
    every other connection is refused, and an authenticated principal may do only what an ACL allows.
    """

    admin_password: str = "admin-secret-0"

    def env(self) -> dict[str, str]:
        return {**super().env(), "KAFKA_SECURITY": "sasl", "KAFKA_ADMIN_PASSWORD": self.admin_password}

    def client_config(self, user: str = "admin", password: str | None = None) -> dict[str, str]:
        """librdkafka settings of a client authenticating as ``user``."""
        return {"bootstrap.servers": self.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": user,
                "sasl.password": self.admin_password if password is None else password}

    def user_url(self, user: str, password: str) -> str:
        """A ``kafka://`` log URL that authenticates as ``user`` (every client, the admin client too)."""
        from urllib.parse import urlencode

        return f"{self.url}?" + urlencode({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                                           "sasl.username": user, "sasl.password": password})

    def _admin(self) -> object:
        from confluent_kafka.admin import AdminClient

        return AdminClient({**self.client_config(), "log_level": 0})

    def add_user(self, user: str, password: str) -> None:
        """A SCRAM-SHA-256 principal ``User:<user>``."""
        from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

        admin = self._admin()
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 4096)
        futures = admin.alter_user_scram_credentials(  # type: ignore[attr-defined]
            [UserScramCredentialUpsertion(user, info, password.encode())])
        for f in futures.values():
            f.result(timeout=30)

    def allow(self, user: str, resource: str, name: str, operations: Iterable[str], prefixed: bool = False) -> None:
        """ACLs: ``User:<user>`` may do ``operations`` (READ, WRITE, DESCRIBE, CREATE, ALL, ...) on
        ``resource`` (TOPIC, GROUP, TRANSACTIONAL_ID, or BROKER: the cluster, named kafka-cluster) named
        ``name`` (a prefix if ``prefixed``; ``*`` for any)."""
        from confluent_kafka.admin import (
            AclBinding,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
        bindings = [AclBinding(ResourceType[resource], name, pattern, f"User:{user}", "*", AclOperation[op],
                               AclPermissionType.ALLOW) for op in operations]
        admin = self._admin()  # referenced until the results are in: a collected client cancels them
        futures = admin.create_acls(bindings, request_timeout=30)  # type: ignore[attr-defined]
        for f in futures.values():
            f.result(timeout=30)
