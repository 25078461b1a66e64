"""Property tests of the allocator fold: random operation sequences against its invariants.

Invariants checked after every step: gang atomicity (every allocation holds
exactly ``hosts`` distinct hosts x ``gpus`` distinct GPUs), exact capacity
accounting (no GPU oversubscribed, free = capacity - held), no dangling
allocation (nothing held on a lost host, nothing outliving its host's lease),
a request is queued or allocated, never both; preemption only ever goes
strictly down the tiers (so no cycles); and at the end replaying the events
rebuilds the state byte for byte.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagfold.services.allocator import keys
from dagfold.services.allocator.harness import AllocatorHarness
from dagfold.services.allocator.model import FULL
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.timers import due_timers_in_store

TIERS = ("enterprise", "standard", "free")

op = st.one_of(
    st.tuples(st.just("req"), st.sampled_from([1, 1, 2, 4, 8]), st.sampled_from([1, 1, 1, 2]),
              st.sampled_from(TIERS), st.sampled_from(["a", "b", "c"]), st.sampled_from([1000, 1000, 300, 600]),
              st.sampled_from([None, 60.0, 600.0]), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("advance"), st.integers(1_000, 40_000)),
    st.tuples(st.just("health"), st.integers(0, 3), st.sampled_from(["ok", "throttled", "ecc_errors"])),
    st.tuples(st.just("silence"), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("register"), st.integers(0, 3)),
)


def check(h: AllocatorHarness) -> None:
    s = h.fold.state
    held: dict[str, list[int]] = {n: [0] * len(v.free) for n, v in s.nodes.items()}
    for a in s.allocs.values():
        r = a.req
        assert len(a.parts) == r.hosts, "gang must hold all its hosts"
        assert len({p.node for p in a.parts}) == r.hosts
        for p in a.parts:
            assert len(set(p.gpus)) == len(p.gpus) == r.gpus
            n = s.nodes[p.node]
            assert n.state != "lost", "allocation dangling on a lost host"
            assert n.lease_until >= h.now_ms - 1, "allocation outlived its host's lease"
            assert a.id in n.allocs
            for g in p.gpus:
                held[p.node][g] += p.milli
        assert r.key not in s.requests, "a request both queued and allocated"
    for nid, n in s.nodes.items():
        for g, f in enumerate(n.free):
            assert 0 <= f <= FULL
            assert f == FULL - held[nid][g], f"{nid} GPU {g}: free {f} but {held[nid][g]} held"
        if n.state == "lost":
            assert not n.allocs


def preemption_edges_go_down(h: AllocatorHarness) -> None:
    rank = {t: i for i, t in enumerate(TIERS)}
    for e in h.of_type("PreemptionRequested"):
        if e["preemptor_tier"] is not None:
            assert rank[e["preemptor_tier"]] < rank[e["tier"]], e


def timers_agree(h: AllocatorHarness) -> None:
    """The fold's in-memory timer heap (what the harness and the simulators fire) holds exactly the live timers
    of the store's due-time index (what the runtime scans, ``due_timers_in_store``), and both fire the same
    timers at any time."""
    h.commit()
    s = h.fold.state
    index = {keys.parse_timer(k) for k, _ in h.store.range(*keys.timers_due_until(2**62))}
    live = {(due, kind, target) for (kind, target), due in s.timers.items()}
    in_heap = {e for e in s.timer_heap if s.timers.get((e[1], e[2])) == e[0]}
    assert live == index, f"live timers {sorted(live - index)} not indexed, {sorted(index - live)} indexed only"
    assert in_heap == live, f"live timers missing from the heap: {sorted(live - in_heap)}"
    now = h.now_ms + 30_000
    from_store = {(c["due_ms"], c["timer"], c["target"]) for _, c in due_timers_in_store(h.store, h.pool, now)}
    assert from_store == {e for e in in_heap if e[0] <= now}
    assert s.next_timer_ms() == (min(index)[0] if index else None)


def _drive_ops(h: AllocatorHarness, ops: list, each: Callable[[AllocatorHarness], None]) -> None:
    silent: set[str] = set()
    for i in range(4):
        h.register(f"n{i}", "H100", 8)
    n = 0
    for o in ops:
        kind = o[0]
        if kind == "req":
            _, g, hosts, tier, tenant, milli, mrt, ck = o
            if milli < FULL:
                g, hosts = 1, 1
            h.request(f"j{n}", gpus=g, hosts=hosts, tier=tier, tenant=tenant, gpu_milli=milli, max_runtime_s=mrt,
                      checkpoint=ck)
            n += 1
        elif kind == "release":
            live = sorted(h.fold.state.allocs)
            if live:
                a = h.fold.state.allocs[live[o[1] % len(live)]]
                h.release(a.id, "preempted" if a.state == "preempting" else "completed")
        elif kind == "advance":
            for step in range(0, o[1], 10_000):
                h.advance(min(10_000, o[1] - step))
                for nid in sorted(h.fold.state.nodes):
                    if nid not in silent:
                        node = h.fold.state.nodes[nid]
                        h.heartbeat(nid, incarnation=node.incarnation)
        elif kind == "health":
            nid = f"n{o[1]}"
            node = h.fold.state.nodes[nid]
            h.heartbeat(nid, incarnation=node.incarnation, health=o[2])
        elif kind == "silence":
            silent.add(f"n{o[1]}")
        elif kind == "cancel" and n:
            h.cancel(f"j{o[1] % n}")
        elif kind == "register":
            nid = f"n{o[1]}"
            silent.discard(nid)
            h.register(nid, "H100", 8, incarnation=h.fold.state.nodes[nid].incarnation + 1)
        each(h)
    h.advance(120_000)
    each(h)


def _harness(placement: str, commit_every: int) -> AllocatorHarness:
    return AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), placement=placement, lease_s=30.0,
                                         grace_s=20.0, preempt_after_s={"enterprise": 0.0, "standard": 30.0}),
                            commit_every=commit_every)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=60), st.sampled_from(["frag", "bestfit", "firstfit"]))
def test_random_operations_keep_invariants(ops: list, placement: str) -> None:
    h = _harness(placement, commit_every=3)
    _drive_ops(h, ops, check)
    preemption_edges_go_down(h)
    assert h.digest() == h.replayed_digest()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=60), st.sampled_from(["frag", "bestfit"]))
def test_the_timer_heap_the_harness_fires_is_the_store_index_the_runtime_scans(ops: list, placement: str) -> None:
    """Live, the runtime fires allocator timers by scanning the store's index; the harness and the
    simulators pop the fold's heap. After every step of random operations both hold the same timers."""
    h = _harness(placement, commit_every=1)
    _drive_ops(h, ops, timers_agree)
    h.advance(600_000)
    timers_agree(h)


def _drive(h: AllocatorHarness, jobs: list[tuple[int, str, int, float, float]], until_ms: int) -> dict[str, int]:
    """Submit (t, id, gpus, runtime_s, max_runtime_s) jobs; release each after its runtime. Returns grant times."""
    pending = sorted(jobs)
    ends: list[tuple[int, str]] = []
    grant_at: dict[str, int] = {}
    runtime = {j[1]: j[3] for j in jobs}
    seen = 0
    while True:
        t_sub = pending[0][0] if pending else None
        t_end = ends[0][0] if ends else None
        cands = [t for t in (t_sub, t_end) if t is not None]
        if not cands or min(cands) > until_ms:
            return grant_at
        t = min(cands)
        h.now_ms = max(h.now_ms, t)
        if t_end is not None and t_end == t:
            _, aid = heapq.heappop(ends)
            if aid in h.fold.state.allocs:
                h.release(aid)
        else:
            t0, jid, g, _, mrt = pending.pop(0)
            h.request(jid, gpus=g, max_runtime_s=mrt, submitted_ms=t0)
        for e in h.events[seen:]:
            if e["type"].endswith("AllocationGranted"):
                grant_at[e["job_id"]] = e["ts_ms"]
                heapq.heappush(ends, (e["ts_ms"] + int(runtime[e["job_id"]] * 1000), e["alloc_id"]))
        seen = len(h.events)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_backfill_never_delays_the_reservation(seed: int) -> None:
    rng = random.Random(seed)
    h = AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), lease_s=10.0 ** 7, tiers=("standard",),
                                      placement=rng.choice(["frag", "bestfit"])), now_ms=0)
    for i in range(4):
        h.register(f"n{i}", "H100", 8)
    jobs = []
    t = 0
    for k in range(60):
        t += rng.randrange(0, 20_000)
        g = rng.choice([1, 2, 4, 8, 8])
        run = rng.uniform(10, 300)
        jobs.append((t, f"j{k}", g, run, run * rng.uniform(1.0, 2.0)))
    grant_at = _drive(h, jobs, 10 ** 8)
    first: dict[str, int] = {}
    for e in h.of_type("ReservationMade"):
        first.setdefault(e["job_id"], e["start_ms"])
    assert first, "the workload should block some head of line"
    for job, start in first.items():
        assert job in grant_at and grant_at[job] <= start, (job, grant_at.get(job), start)
    assert not h.of_type("ReservationCleared")


def test_weighted_fair_shares_converge() -> None:
    """Two backlogged tenants, weights 1 and 3, on 16 GPUs: running shares approach 1:3."""
    h = AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), lease_s=10.0 ** 7, tiers=("standard",),
                                      tenant_weights={"a": 1.0, "b": 3.0}), now_ms=0)
    for i in range(2):
        h.register(f"n{i}", "H100", 8)
    jobs = [(0, f"{t}{k}", 1, 60.0, 60.0) for k in range(700) for t in ("a", "b")]
    for t0, jid, g, _, mrt in jobs:
        h.request(jid, gpus=g, max_runtime_s=mrt, tenant=jid[0], submitted_ms=t0)
    samples = []
    for _ in range(40):
        h.advance(60_000)
        for aid in sorted(h.fold.state.allocs):
            a = h.fold.state.allocs[aid]
            if h.now_ms - a.granted_ms >= 60_000:
                h.release(aid)
        u = h.fold.state.usage
        samples.append((u.get(("standard", "a"), 0), u.get(("standard", "b"), 0)))
    a = sum(x for x, _ in samples[5:])
    b = sum(y for _, y in samples[5:])
    assert abs(b / a - 3.0) < 0.35, (a, b)
