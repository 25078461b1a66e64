"""The synthetic day's decisions, pinned: every record the allocator fold emits in a small day, hashed.

CPU work on the fold (issue 14 part 6) must leave every decision as it was; this test says so in seconds.
Three policies take the fold's three fair-share paths: ``ours`` (weighted DRF per tier, frag placement,
backfill, preemption), ``bestfit`` (the same with best-fit placement) and ``fifo`` (one queue for all
tiers, no fair share, first-fit). The digests were taken on main at 07ebbb9, before the changes they
guard. A change meant to alter decisions updates them, and says why in its commit. Last: issue 24 recipe 7
(a requeued request carries ``ran_ms``, its runtime limit counts across grants; the simulator's jobs that do
not checkpoint stop with no checkpoint URI).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from dagfold.services.allocator import sim_core
from dagfold.services.allocator.sim_day import run_day

PINNED = {
    "ours": "0120b45c26b5df84ff34d657de96374b73e296591213c55f03c1980578f370c0",
    "bestfit": "03429c2f523f6f67c260c083586bbcbc14523a074039d167566d190d27d80ef6",
    "fifo": "986ee63eaefd7130cdb3ccb7541637f084026558b149a936f7f9dfc4f0d8bde6",
}


def day_digest(monkeypatch: pytest.MonkeyPatch, policy: str) -> tuple[str, dict[str, Any]]:
    h = hashlib.sha256()
    orig = sim_core.SimAllocator.process

    def hashed(self: sim_core.SimAllocator, cmd: dict[str, Any]) -> Any:
        out = orig(self, cmd)
        for o in out:
            h.update(o.topic.encode())
            h.update(json.dumps(o.record, sort_keys=True).encode())
        return out

    monkeypatch.setattr(sim_core.SimAllocator, "process", hashed)
    r = run_day(240, 2400, 7, policy, True)
    return h.hexdigest(), r


@pytest.mark.parametrize("policy", sorted(PINNED))
def test_day_decisions_unchanged(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    digest, r = day_digest(monkeypatch, policy)
    assert r["commands"] > 2400 and r["utilization"] > 0.5  # a day that decided something
    assert digest == PINNED[policy]
