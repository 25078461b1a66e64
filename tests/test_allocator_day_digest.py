"""The synthetic day's decisions, pinned: every record the allocator fold emits in a small day, hashed.

CPU work on the fold (issue 14 part 6) must leave every decision as it was; this test says so in seconds.
Three policies take the fold's three fair-share paths: ``ours`` (weighted DRF per tier, frag placement,
backfill, preemption), ``bestfit`` (the same with best-fit placement) and ``fifo`` (one queue for all
tiers, no fair share, first-fit). The digests were taken on main at 07ebbb9, before the changes they
guard. A change meant to alter decisions updates them, and says why in its commit.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from dagfold.services.allocator import sim_core
from dagfold.services.allocator.sim_day import run_day

PINNED = {
    "ours": "b80a6c64b8d3392721d868b39aa6d605f463f19353529f7f5f70638fd2f2a246",
    "bestfit": "cca793e494d955c809031ba79a0ef33284bd0677845fb7562fa454c781e087af",
    "fifo": "35b638d7ce7d173a2c0ea8c4de5ec274d71feeb94fcb13acd4ba9acc67d14d8d",
}


def day_digest(monkeypatch: pytest.MonkeyPatch, policy: str) -> tuple[str, dict[str, Any]]:
    h = hashlib.sha256()
    orig = sim_core.AllocatorHarness.process

    def hashed(self: sim_core.AllocatorHarness, cmd: dict[str, Any]) -> Any:
        out = orig(self, cmd)
        for o in out:
            h.update(o.topic.encode())
            h.update(json.dumps(o.record, sort_keys=True).encode())
        return out

    monkeypatch.setattr(sim_core.AllocatorHarness, "process", hashed)
    r = run_day(240, 2400, 7, policy, True)
    return h.hexdigest(), r


@pytest.mark.parametrize("policy", sorted(PINNED))
def test_day_decisions_unchanged(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    digest, r = day_digest(monkeypatch, policy)
    assert r["commands"] > 2400 and r["utilization"] > 0.5  # a day that decided something
    assert digest == PINNED[policy]
