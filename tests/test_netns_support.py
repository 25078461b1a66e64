"""The test networks clean up after a run that was killed: what it left never stops the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
