"""Hosts with networks of their own on one Linux machine: network namespaces, veth links and real cuts.

``Net()`` claims a block ``10.213.B.0/24`` no other link of this machine uses and makes, on demand:

* the hub: a link in the root namespace, ``dfh<pid>n<k>`` (a veth pair: this kernel has no dummy links), with
  the address ``10.213.B.254``. Brokers listen there (``LocalKafka(host=net.hub)``), and so every host reaches
  them through its link while processes in the root namespace reach them locally;
* hosts (``net.host()``): a namespace ``dfn-<pid>-<k>`` with a veth pair, ``dfa<pid>n<k>`` in the root namespace
  and ``dfb<pid>n<k>`` in the host's, addresses ``10.213.B.4n+1`` (root side) and ``10.213.B.4n+2`` (host side)
  of a /30, a default route through the root side. ``host.run()`` starts a process on that host.

Faults, all at the network level (the machine has neither iptables nor nft, nor tc's drop actions):

* ``host.cut()``: both ends of the host's link down, a pulled cable. What the host sends is dropped without an
  answer; the root namespace has no route to it (a blackhole route on the block keeps its packets on this
  machine, off the default route). ``host.heal()`` puts the link and the host's default route back.
* ``host.cut_from(addresses)``: the host loses its routes to those addresses (say the brokers') and keeps
  every other: each goes through a neighbour that does not exist, so its packets die unanswered (the way a
  dead router loses them) while its peers still reach it. ``heal()`` removes them too.

Everything is removed by ``close()``, by a fixture's finalizer and at exit; ``sweep()`` (run by every ``Net()``)
removes what a crashed earlier run left: namespaces and links with this module's prefixes whose process is
gone, and nothing else. Only addresses of this module's own links are ever touched.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NS_PREFIX = "dfn-"  # namespaces: dfn-<pid>-<k>; links: dfa<pid>n<k> (root-side veth ends), dfh<pid>n<k> (hubs)
BLOCK = "10.213"
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "dagfold-netns.lock"
_NAMED = re.compile(r"^(?:dfn-(\d+)-\d+|df[ah](\d+)n\d+)$")
_SEQ = itertools.count()  # names of this process's hosts and hubs: unique whatever Net they belong to


class NetnsError(RuntimeError):
    """``ip netns`` cannot be used here, or a command of it failed."""


def ip(*args: str, check: bool = True) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p.stdout


def unusable() -> str | None:
    """Why this machine cannot make network namespaces (None when it can): root, ``ip`` and netns needed."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run the tests as root"
    try:
        name = f"{NS_PREFIX}{os.getpid()}-probe"
        ip("netns", "add", name)
        ip("netns", "del", name)
    except FileNotFoundError:
        return "`ip` (iproute2) is not installed"
    except NetnsError as exc:
        return f"`ip netns add` failed: {exc}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(keep_pid: int | None = None) -> list[str]:
    """Remove namespaces and links with this module's names whose creating process is gone; their names."""
    gone: list[str] = []
    names = ip("netns", "list", check=False).split()
    links = [ln.split(":")[1].strip().split("@")[0] for ln in ip("-o", "link", "show", check=False).splitlines()
             if ln.count(":") >= 2]
    for name in [*names, *links]:
        m = _NAMED.match(name)
        if m is None:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid == keep_pid or _alive(pid):
            continue
        if name.startswith(NS_PREFIX):
            ip("netns", "del", name, check=False)
        else:
            ip("link", "del", name, check=False)
        gone.append(name)
    return gone


def sweep_routes(used_blocks: set[str]) -> list[str]:
    """Remove this module's blackhole routes of blocks no link holds an address in any more; their blocks.

    A ``Net`` adds its route after its hub's address claimed the block, and deletes it before the hub, both under
    ``LOCK`` or at close: a route without an address is what a killed run left (its links went with ``sweep``).
    Called under ``LOCK``."""
    gone: list[str] = []
    for line in ip("route", "show", "type", "blackhole", check=False).splitlines():
        m = re.match(rf"(?:blackhole\s+)?{re.escape(BLOCK)}\.(\d+)\.0/24\b.*\bmetric 4000\b", line.strip())
        if m is None or m.group(1) in used_blocks:
            continue
        ip("route", "del", "blackhole", f"{BLOCK}.{m.group(1)}.0/24", "metric", "4000", check=False)
        gone.append(m.group(1))
    return gone


class Host:
    """One host: a namespace with a link to the root namespace (module docstring)."""

    def __init__(self, net: Net, n: int) -> None:
        self.net, self.n = net, n
        pid, k = os.getpid(), next(_SEQ)
        self.ns = f"{NS_PREFIX}{pid}-{k}"
        self.root_if, self.host_if = f"dfa{pid}n{k}", f"dfb{pid}n{k}"
        self.root_addr, self.addr = f"{net.prefix}.{4 * n + 1}", f"{net.prefix}.{4 * n + 2}"
        self.cut_routes: list[str] = []
        ip("netns", "add", self.ns)
        ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.host_if)
        ip("link", "set", self.host_if, "netns", self.ns)
        ip("addr", "add", f"{self.root_addr}/30", "dev", self.root_if)
        # hosts reach each other through the root namespace: forwarding on for this link only (the machine's
        # own setting, net.ipv4.ip_forward, stays as it is)
        Path(f"/proc/sys/net/ipv4/conf/{self.root_if}/forwarding").write_text("1")
        ip("link", "set", self.root_if, "up")
        ip("-n", self.ns, "addr", "add", f"{self.addr}/30", "dev", self.host_if)
        ip("-n", self.ns, "link", "set", "lo", "up")
        ip("-n", self.ns, "link", "set", self.host_if, "up")
        ip("-n", self.ns, "route", "add", "default", "via", self.root_addr)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host (its network namespace; the rest of the machine is shared)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(argv), **kw)

    def cut(self) -> None:
        """Pull the cable: both ends of the link down."""
        ip("-n", self.ns, "link", "set", self.host_if, "down")
        ip("link", "set", self.root_if, "down")

    def cut_from(self, addresses: Sequence[str]) -> None:
        """Lose the routes to ``addresses`` only: through a neighbour that does not exist."""
        for a in addresses:
            ip("-n", self.ns, "route", "replace", f"{a}/32", "via", self.net.dead, "dev", self.host_if, "onlink")
            self.cut_routes.append(a)

    def heal(self) -> None:
        ip("link", "set", self.root_if, "up")
        ip("-n", self.ns, "link", "set", self.host_if, "up")
        ip("-n", self.ns, "route", "replace", "default", "via", self.root_addr)
        for a in self.cut_routes:
            ip("-n", self.ns, "route", "del", f"{a}/32", check=False)
        self.cut_routes.clear()

    def reachable(self, address: str, port: int, timeout_s: float = 2.0) -> bool:
        """Whether a TCP connection from this host to ``address:port`` is answered (accepted or refused)."""
        code = ("import socket,sys\ns=socket.socket();s.settimeout(float(sys.argv[3]))\n"
                "try: s.connect((sys.argv[1],int(sys.argv[2])))\nexcept ConnectionRefusedError: pass\n"
                "except OSError: sys.exit(1)\n")
        p = subprocess.run(self.command(["python3", "-c", code, address, str(port), str(timeout_s)]),
                           capture_output=True, timeout=timeout_s + 30)
        return p.returncode == 0

    def close(self) -> None:
        ip("netns", "del", self.ns, check=False)
        ip("link", "del", self.root_if, check=False)  # gone with its peer already, unless a step failed


class Net:
    """This process's networks: a hub in the root namespace and hosts in namespaces (module docstring)."""

    def __init__(self) -> None:
        why = unusable()
        if why is not None:
            raise NetnsError(why)
        pid = os.getpid()
        self.hosts: list[Host] = []
        self.hub_if = f"dfh{pid}n{next(_SEQ)}"
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "w") as lock:  # concurrent sessions (pytest-xdist) claim blocks one at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep(keep_pid=pid)
            used = set(re.findall(rf"inet {re.escape(BLOCK)}\.(\d+)\.", ip("-o", "-4", "addr", "show")))
            sweep_routes(used)
            block = next((b for b in range(1, 255) if str(b) not in used), None)
            if block is None:
                raise NetnsError(f"every block of {BLOCK}.0.0/16 is in use")
            self.prefix = f"{BLOCK}.{block}"
            self.hub, self.dead = f"{self.prefix}.254", f"{self.prefix}.253"
            ip("link", "add", self.hub_if, "type", "veth", "peer", "name", "dfg" + self.hub_if[3:])
            ip("addr", "add", f"{self.hub}/32", "dev", self.hub_if)
            ip("link", "set", self.hub_if, "up")
            # while a host's link is down, the root namespace's packets to it stay here (not the default route);
            # added under the lock, after the hub's address claimed the block (sweep_routes relies on that order)
            ip("route", "replace", "blackhole", f"{self.prefix}.0/24", "metric", "4000")
        atexit.register(self.close)

    def host(self) -> Host:
        if len(self.hosts) >= 60:
            raise NetnsError("at most 60 hosts a Net (a /30 each below the hub)")
        h = Host(self, len(self.hosts))
        self.hosts.append(h)
        return h

    def close(self) -> None:
        for h in self.hosts:
            h.close()
        self.hosts.clear()
        ip("route", "del", "blackhole", f"{self.prefix}.0/24", "metric", "4000", check=False)
        ip("link", "del", self.hub_if, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
