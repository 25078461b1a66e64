"""The test networks clean up after a run that was killed: what it left never stops the next run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns_support import Net, NetnsError, ip


def test_a_net_whose_process_was_killed_leaves_nothing_that_stops_the_next_one() -> None:
    """A run killed with SIGKILL keeps no atexit: its namespace, links and blackhole route stay behind. The
    next ``Net()`` removes them and claims blocks as usual (CI once failed with ``RTNETLINK answers: File
    exists`` on a blackhole route a killed run had left)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys,time\nfrom tests.netns_support import Net\n"
         "n=Net(); n.host(); print(n.prefix, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout is not None
        prefix = child.stdout.readline().strip()
        assert prefix, "the child made no Net"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert f"{prefix}.0/24" in ip("route", "show", "type", "blackhole"), "a killed run leaves its route"
    try:
        n = Net()
    except NetnsError as exc:
        pytest.fail(f"what a killed run left stopped the next Net: {exc}")
    try:
        h = n.host()
        h.cut()
        h.heal()
        routes = ip("route", "show", "type", "blackhole")
        stale = [ln for ln in routes.splitlines() if ln.startswith(f"blackhole {prefix}.0/24") or
                 ln.startswith(f"{prefix}.0/24")]
        assert n.prefix == prefix or not stale, f"the killed run's route is still there: {stale}"
        assert f"dfn-{child.pid}-" not in ip("netns", "list"), "the killed run's namespace is still there"
    finally:
        n.close()
    assert f"{n.prefix}.0/24" not in ip("route", "show", "type", "blackhole")


def test_a_broker_isolated_from_the_other_two_is_still_reached_by_its_clients(tmp_path: Path) -> None:
    """``BrokerCluster.isolate`` (brokers on hosts of their own): neither direction between the isolated host
    and the other two gets through, clients in the root namespace and the other two between themselves still
    do; ``heal`` gives everything back. (No broker runs: a connection that is refused got an answer.)"""
    from chaos.cluster import BrokerCluster

    net = Net()
    try:
        a, b, c = (net.host() for _ in range(3))
        cluster = BrokerCluster(tmp_path / "kafka", port=30192, hosts=[a, b, c])
        assert cluster.addresses == [a.addr, b.addr, c.addr]
        assert cluster.bootstrap == f"{a.addr}:30192,{b.addr}:30193,{c.addr}:30194"
        assert a.reachable(b.addr, 30193) and b.reachable(a.addr, 30192)
        cluster.isolate(1)
        assert cluster.isolated == 1 and not cluster.healthy()
        assert not a.reachable(b.addr, 30193, 1.0) and not a.reachable(c.addr, 30194, 1.0)
        assert not b.reachable(a.addr, 30192, 1.0) and not c.reachable(a.addr, 30192, 1.0)  # its answers die
        assert b.reachable(c.addr, 30194) and c.reachable(b.addr, 30193)
        assert _root_reaches(a.addr, 30192)  # the clients still reach it
        cluster.heal()
        assert cluster.isolated is None
        assert a.reachable(b.addr, 30193) and b.reachable(a.addr, 30192) and c.reachable(a.addr, 30192)
    finally:
        net.close()


def _root_reaches(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        try:
            s.connect((address, port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return True
