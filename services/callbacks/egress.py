"""Where callbacks may go: the destination rules, checked on the address actually connected to.

A tenant names the callback URL, so without rules the notifier is the tenant's way into the
deployment's network (issue 24, recipe 5): ``http://127.0.0.1:<port>/`` or ``http://2130706433/``
reached the service's own ports and the delivery status said what answered. So:

* **deny**: every address that is not global unicast: loopback, unspecified, link-local, private
  (RFC 1918, IPv6 ULA ``fc00::/7``), shared (``100.64.0.0/10``), reserved, multicast, broadcast;
  an IPv6 address that carries an IPv4 one (IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``,
  6to4 ``2002::/16``) is judged by the IPv4 address it carries.
* **allow**: ``DAGFOLD_CALLBACK_ALLOW``, comma-separated CIDRs or addresses, lets an operator open
  ranges of the denied space (receivers on the same machine or network). Even there the service's
  own ports (its API's, its metrics', its Kafka brokers') stay closed.
* **resolve once, connect there**: ``GuardedBackend.connect_tcp`` (the httpcore network backend of
  the notifier's client, the one place its connections are made) resolves the URL's host, refuses
  unless *every* address it resolves to passes, and connects to that vetted address; TLS still
  verifies the certificate for the URL's name (httpcore passes the origin's host as
  ``server_hostname`` to ``start_tls``: ``httpcore/_sync/connection.py``, ``_connect``) and the
  ``Host`` header is the URL's. No second lookup happens, so a name that answers a public address
  to the check and ``127.0.0.1`` to the connection (DNS rebinding) cannot slip through.
* **one deadline per attempt**: httpx's timeouts bound each read and write, so a receiver that
  drips one byte every few seconds kept an attempt (and its delivery slot) for as long as it liked
  (recipe 6). A ``GuardedBackend`` clamps the DNS lookup, the connect, the TLS handshake (CPython
  bounds a whole handshake by the socket's timeout) and every read and write to what is left of the
  attempt's deadline (``attempt_deadline``), so resolve + connect + send + read together end by it.

Redirects are not followed (the notifier's client has ``follow_redirects=False``; a 3xx is a failed
attempt), so a receiver cannot bounce a callback to a denied address either.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import typing
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpcore

from dagfold.services.callbacks.exceptions import CallbackConfigError, CallbackError

ENV_ALLOW = "DAGFOLD_CALLBACK_ALLOW"
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")
LOCAL_NAMES = ("localhost", "localhost.localdomain")
RESOLVERS = 4
_RESOLVER = ThreadPoolExecutor(RESOLVERS, thread_name_prefix="callbacks-dns")


class RefusedDestination(CallbackError):
    """The callback's destination is not allowed (its resolved address or port); the message says which rule."""


def carried_v4(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4), else ``ip`` itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


def denied_kind(ip: IPAddress) -> str | None:
    """Which deny rule an address falls under (None: a global unicast address)."""
    ip = carried_v4(ip)
    for kind, hit in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                      ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                      ("shared", ip in _SHARED), ("private", ip.is_private), ("reserved", ip.is_reserved),
                      ("not global", not ip.is_global)):
        if hit:
            return kind
    return None


def literal_ip(host: str) -> IPAddress | None:
    """The address a URL host spells literally, in any form the resolver accepts (``2130706433``,
    ``0x7f.1``, ``127.1``, ``[::1]``); None for a name."""
    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        pass
    if h and all(c in "0123456789abcdefxABCDEFX." for c in h) and h[0].isdigit():
        try:  # the legacy inet_aton forms getaddrinfo resolves too (decimal, octal, hex, short)
            return ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return None
    return None


def log_ports(log_url: str) -> frozenset[int]:
    """The broker ports of a ``kafka://host:port[,host:port][?...]`` log URL (none for ``embedded``): with
    loopback allowed for local receivers, the deployment's own brokers stay closed to callbacks."""
    if not log_url.startswith("kafka://"):
        return frozenset()
    ports = set()
    for hostport in log_url[len("kafka://"):].split("?", 1)[0].split(","):
        tail = hostport.rsplit(":", 1)[-1] if ":" in hostport else ""
        if tail.isdigit():
            ports.add(int(tail))
    return frozenset(ports)


def parse_allow(raw: str) -> tuple[IPNetwork, ...]:
    """``DAGFOLD_CALLBACK_ALLOW``: comma-separated CIDRs or addresses."""
    nets: list[IPNetwork] = []
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise CallbackConfigError(f"{ENV_ALLOW}: {item!r} is not an address or CIDR "
                                      "(e.g. 127.0.0.1/32,10.1.0.0/16)") from None
    return tuple(nets)


@dataclass(frozen=True)
class EgressRules:
    """The deny list, the operator's allow list and the service's own ports."""

    allow: tuple[IPNetwork, ...] = ()
    own_ports: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EgressRules:
        """``DAGFOLD_CALLBACK_ALLOW``; own ports from ``DAGFOLD_PORT`` (default 8080), ``DAGFOLD_METRICS_PORT``
        and the brokers of ``DAGFOLD_LOG``."""
        e = os.environ if env is None else env
        ports = set(log_ports(e.get("DAGFOLD_LOG") or ""))
        for name, default in (("DAGFOLD_PORT", "8080"), ("DAGFOLD_METRICS_PORT", "")):
            raw = (e.get(name) or default).strip()
            if raw.isdigit():
                ports.add(int(raw))
        return cls(parse_allow(e.get(ENV_ALLOW, "")), frozenset(ports))

    def allowed(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.allow) or (
            carried_v4(ip) != ip and any(carried_v4(ip) in n for n in self.allow if n.version == 4))

    def refusal(self, ip: IPAddress, port: int) -> str | None:
        """Why a connection to ``ip:port`` is refused (None: it may be made)."""
        kind = denied_kind(ip)
        if kind is None:
            return None
        if not self.allowed(ip):
            return f"{ip} is {kind} and not in {ENV_ALLOW}"
        if port in self.own_ports:
            return f"port {port} of {ip} is one of the service's own ports"
        return None

    def literal_refusal(self, url: str) -> str | None:
        """Why a callback URL is refused before any lookup: its host is a denied literal address or a
        local name. A name is judged at delivery, after it resolves (the authoritative check)."""
        try:
            import httpx  # the notifier's URL parser: what is checked here is what is called later

            u = httpx.URL(url)
        except Exception:
            return None  # not a URL at all: the spec's own validation says so
        host = u.host.lower().rstrip(".")
        port = u.port or (443 if u.scheme == "https" else 80)
        if host in LOCAL_NAMES or host.endswith(".localhost"):
            ip: IPAddress | None = ipaddress.ip_address("127.0.0.1")
        else:
            ip = literal_ip(host)
        return None if ip is None else self.refusal(ip, port)

    def resolve(self, host: str, port: int, timeout: float | None = None) -> str:
        """The one address to connect to for ``host:port``: every address the name resolves to must pass.

        ``timeout``: the lookup runs on one of ``RESOLVERS`` threads and is given up after it (getaddrinfo
        cannot be interrupted: a resolver that hangs keeps that thread, at most ``RESOLVERS`` of them, and
        lookups behind them time out too, so no delivery slot waits longer than its deadline).
        """
        try:
            if timeout is None:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            else:
                infos = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(timeout)
        except FutureTimeout:
            raise httpcore.ConnectTimeout(f"no DNS answer for {host!r} within the attempt's deadline") from None
        except (OSError, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addrs:
            raise httpcore.ConnectError(f"{host!r} resolves to no address")
        for a in addrs:
            why = self.refusal(ipaddress.ip_address(a.split("%", 1)[0]), port)
            if why is not None:
                raise RefusedDestination(f"{host}:{port} resolves to {a}: {why}")
        return addrs[0]


# -- the attempt's deadline and the guarded connections ----------------------------------------
_DEADLINE = threading.local()


@contextmanager
def attempt_deadline(seconds: float) -> Iterator[None]:
    """Everything this thread's guarded connections do inside ends ``seconds`` from now."""
    _DEADLINE.at = time.monotonic() + seconds
    try:
        yield
    finally:
        _DEADLINE.at = None


def _left(timeout: float | None, exc: type[Exception]) -> float | None:
    """``timeout`` clamped to what is left of this thread's attempt deadline (raises ``exc`` once it passed)."""
    at = getattr(_DEADLINE, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise exc("the callback attempt's deadline passed")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every read and write ends by the attempt's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: typing.Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                    _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore's sync backend behind the egress rules and the attempt deadline."""

    def __init__(self, rules: EgressRules, inner: httpcore.NetworkBackend | None = None) -> None:
        self.rules = rules
        self._inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[typing.Any] | None = None) -> httpcore.NetworkStream:
        address = self.rules.resolve(host, port, _left(timeout, httpcore.ConnectTimeout))
        stream = self._inner.connect_tcp(address, port, _left(timeout, httpcore.ConnectTimeout), local_address,
                                         socket_options)
        return DeadlineStream(stream)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[typing.Any] | None = None) -> httpcore.NetworkStream:
        raise RefusedDestination("callbacks do not connect to unix sockets")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)
