"""The allocator's derived in-memory indexes and its optimised searches against plain recomputations.

The fold keeps indexes beside the store (sorted hosts per tier, hosts per number of
whole free GPUs, memoised feasible shapes, per-tenant queues) and runs an optimised
victim search. On random histories with GPU shares, CPU/memory, gangs, tiers,
preemption and drains, every index must equal what a scan of the views gives, a fold
opened on the committed store must rebuild the same indexes, and the victim search
must return what the straightforward search (kept here as the reference) returns, and frag placement
through its incremental per-shape rankings must choose the hosts a plain score of every host chooses,
whether the rankings score signatures one by one or vectorised (numpy) in batches.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dagfold.services.allocator import passes, placement, scoring
from dagfold.services.allocator.capacity import l1_fits, signature
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.harness import AllocatorHarness
from dagfold.services.allocator.model import FULL, AllocView, RequestView
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.placement import after_sig, feasible_shapes, frag_scores, place
from dagfold.services.allocator.preemption import find_victims, lost_work_gpu_min, share_excess
from dagfold.services.allocator.profile import (
    FILL_RATE,
    for_type,
    remainder_change,
    remainder_waste,
    share_sizes,
    stranded,
    usable,
)
from dagfold.services.allocator.reservations import Exclusions, excluded_for, part_fits
from dagfold.services.allocator.state import PoolState


def reference_find_victims(st: PoolState, r: RequestView, now_ms: int,
                           excluded: set[str]) -> tuple[list[str], list[AllocView]] | None:
    """The victim search written plainly (as before its optimisation): the specification."""
    rank = st.rank(r.tier)
    ntiers = len(st.opts.tiers) + 1
    g, milli = r.gpus, r.per_gpu_milli()
    types = set(r.gpu_types)
    scanned = 0
    seen: set[str] = set()
    options: list[tuple[tuple[float, int, float], str, list[AllocView]]] = []
    for low in range(ntiers, rank, -1):
        hosts = st.tier_nodes.get(low)
        if not hosts:
            continue
        for nid in sorted(hosts):
            if nid in seen or nid in excluded:
                continue
            seen.add(nid)
            n = st.nodes[nid]
            if n.state != "up" or (types and n.gpu_type not in types) or n.gpus < g:
                continue
            scanned += 1
            cands = [st.allocs[x] for x in n.allocs]
            cands = [a for a in cands if a.state == "running" and st.rank(a.req.tier) > rank]
            if not cands:
                continue
            cands.sort(key=lambda a: (-st.rank(a.req.tier), lost_work_gpu_min(a, now_ms), -share_excess(st, a), a.id))
            free = list(n.free)
            cpu_free, mem_free = n.cpu_free, n.mem_free
            chosen: list[AllocView] = []
            for a in cands:
                for p in a.parts:
                    if p.node == nid:
                        for gi in p.gpus:
                            free[gi] += p.milli
                cpu_free += a.req.cpu
                mem_free += a.req.mem
                chosen.append(a)
                if part_fits(free, cpu_free, mem_free, g, milli, r.cpu, r.mem):
                    lost = sum(lost_work_gpu_min(v, now_ms) for v in chosen)
                    top = min(st.rank(v.req.tier) for v in chosen)
                    excess = -sum(share_excess(st, v) for v in chosen)
                    options.append(((round(lost, 1), ntiers - top, excess), nid, chosen))
                    break
            if scanned >= st.opts.preempt_scan_limit:
                break
        if scanned >= st.opts.preempt_scan_limit:
            break
    if len(options) < r.hosts:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    best = options[:r.hosts]
    victims = {v.id: v for _, _, vs in best for v in vs}
    return sorted(nid for _, nid, _ in best), [victims[k] for k in sorted(victims)]


_WASTE: dict[tuple[int, str], Any] = {}  # plain remainder_waste tables (~25 ms each): per profile and GPU type


def plain_frag_score(st: PoolState, t: str, sig: Any, g: int, milli: int, cpu: int, mem: int) -> float:
    """frag's score of one part on a host of type ``t`` in state ``sig``, from the plain definitions."""
    key = (id(st.classes), t)
    if key not in _WASTE:
        _WASTE[key] = remainder_waste(*share_sizes(st.classes, t), FILL_RATE)
    groups, after = for_type(t, st.groups), after_sig(sig, g, milli, cpu, mem)
    balance = stranded(sum(after[2]), after[0], st.gpu_per_cpu) - stranded(sum(sig[2]), sig[0], st.gpu_per_cpu)
    return ((usable(sig, groups) - usable(after, groups)) / st.weight_scale
            + st.opts.frag_pack_weight * sum(after[2]) + st.opts.frag_balance_weight * balance
            + st.opts.frag_remainder_weight * remainder_change(sig[2], g, milli, _WASTE[key]))


def reference_frag_hosts(st: PoolState, r: RequestView, excluded: set[str]) -> list[str]:
    """frag's choice written plainly: score every up host that can hold one part, best first (the
    specification of placement's incremental per-shape rankings)."""
    g, milli, cpu, mem = r.gpus, r.per_gpu_milli(), r.cpu, r.mem
    options = []
    for nid, n in st.nodes.items():
        if n.state != "up" or nid in excluded or (r.gpu_types and n.gpu_type not in r.gpu_types):
            continue
        l1, sig = signature(n)
        if not l1_fits(l1, g, milli) or sig[0] < cpu or sig[1] < mem:
            continue
        score = plain_frag_score(st, n.gpu_type, sig, g, milli, cpu, mem)
        options.append(((score, sig[0], sig[1], n.gpu_type, sig[2]), nid))
    options.sort()
    return [nid for _, nid in options[:r.hosts]] if len(options) >= r.hosts else []


def check_indexes(st: PoolState) -> None:
    for rank, hosts in st.tier_nodes.items():
        assert list(st.tier_hosts.get(rank, ())) == sorted(hosts)
    assert all(not hosts or rank in st.tier_nodes for rank, hosts in st.tier_hosts.items())
    by_full: dict[str, list[int]] = {}
    for n in st.nodes.values():
        if n.state == "up":
            counts = by_full.setdefault(n.gpu_type, [])
            k = signature(n)[0][0]
            counts.extend([0] * (k + 1 - len(counts)))
            counts[k] += 1
    for t in set(by_full) | set(st.capacity.by_full):
        got, want = st.capacity.by_full.get(t, []), by_full.get(t, [])
        assert got[:len(want)] == want and not any(got[len(want):]), t
    # the live signatures, as rows (vectorised scoring) and by birth (rankings' catch-up)
    cap = st.capacity
    cap.arrays()
    live = {(n.gpu_type, *signature(n)) for n in st.nodes.values() if n.state == "up"}
    assert {cap.at[i] for i in np.flatnonzero(cap.alive)} == live == set(cap.born.values())
    assert {v for b in cap.born_full for v in b.values()} == live and cap.n_sigs == len(live)
    for t, l1, sig in live:
        i = cap.slot_of[(t, sig)]
        row = [sig[0], sig[1], *sig[2]]
        assert list(cap.rows[i]) == row + [0] * (cap.rows.shape[1] - len(row))
        assert (cap.type_list[cap.row_type[i]], cap.row_full[i], cap.row_part[i]) == (t, *l1)
    for rank, tenants in st.queues.items():
        for tenant, q in tenants.items():
            assert q == sorted((r.seq, r.key) for r in st.requests.values()
                               if st.rank(r.tier) == rank and r.tenant == tenant)
    for rank in st.queued_shapes:
        fresh = {gs for gs in st.queued_shapes[rank] if st.capacity.hosts_with(gs[0], gs[1], gs[2], gs[3])}
        assert feasible_shapes(st, rank) == fresh


def check_exclusions(st: PoolState, now_ms: int) -> None:
    grace = int(st.opts.runtime_grace_s * 1000)
    for rank in st.queues:
        excl = Exclusions(st, rank, now_ms)
        for r in st.requests.values():
            if st.rank(r.tier) != rank or r.key in st.meta["reservations"]:
                continue
            want: set[str] = set()
            for v in st.meta["reservations"].values():
                if v["rank"] > rank:
                    continue
                if v["kind"] == "backfill" and r.max_runtime_ms is not None \
                        and now_ms + r.max_runtime_ms + grace <= v["start_ms"]:
                    continue
                want.update(v["nodes"])
            assert excl.hosts(excl.pattern(r)) == want


@pytest.mark.parametrize("seed", range(12))
def test_indexes_and_victim_search_match_plain_recomputation(seed: int, monkeypatch: Any) -> None:
    rng = random.Random(seed)
    searches = [0, 0]
    placed = [0]

    def checked(st: PoolState, r: RequestView, now_ms: int, excluded: set[str]) -> Any:
        got = find_victims(st, r, now_ms, excluded)
        want = reference_find_victims(st, r, now_ms, excluded)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got[0] == want[0] and [v.id for v in got[1]] == [v.id for v in want[1]]
        searches[0] += 1
        searches[1] += got is not None
        return got

    monkeypatch.setattr(passes, "find_victims", checked)
    # rankings catch up by a loop over the births, or by a scan of the capacity rows past this many
    monkeypatch.setattr(placement, "SCAN_BIRTHS", rng.choice([0, 4, 10 ** 9]))
    monkeypatch.setattr(placement, "DEAD_POPS", rng.choice([1, 3, 64]))  # dead entries dropped all at once
    opts = replace(AllocatorOptions(pool="p"), lease_s=10.0 ** 6, grace_s=20.0, orphan_grace_s=None,
                   preempt_scan_limit=rng.choice([3, 8, 64]))
    h = AllocatorHarness(opts=opts, commit_every=rng.choice([1, 7]))
    for k in range(rng.randint(3, 10)):
        h.register(f"n{k:02d}", rng.choice(["A", "B"]), rng.choice([4, 8]), cpu_milli=rng.choice([0, 16000]),
                   memory_mib=rng.choice([0, 64000]))
    st = h.fold.state
    for i in range(250):
        x = rng.random()
        if x < 0.6:
            share = rng.random() < 0.3
            h.request(f"j{i}", tenant=rng.choice("abcd"), tier=rng.choice(["enterprise", "standard", "free", "free"]),
                      gpus=1 if share else rng.choice([1, 2, 4, 8]),
                      gpu_milli=rng.choice([250, 500]) if share else 1000,
                      hosts=1 if share else rng.choice([1, 1, 2]), gpu_type=rng.choice([[], ["A"], ["B"]]),
                      cpu_milli=rng.choice([0, 0, 2000]), memory_mib=rng.choice([0, 0, 8000]),
                      max_runtime_s=rng.choice([None, 100, 1000]), checkpoint=rng.random() < 0.7)
        elif x < 0.72 and st.allocs:
            aid = rng.choice(sorted(st.allocs))
            h.release(aid, "preempted" if st.allocs[aid].state == "preempting" else "completed")
        elif x < 0.75 and st.requests:
            h.cancel(st.requests[rng.choice(sorted(st.requests))].job_id)
        elif x < 0.97:
            for nid, n in sorted(st.nodes.items()):
                if n.state != "lost":
                    health = "throttled" if rng.random() < 0.02 else "ok"
                    h.heartbeat(nid, health=health, allocations=[
                        {"alloc_id": a, "epoch": st.allocs[a].epoch, "progress": 0.5,
                         "last_checkpoint_ms": h.now_ms - rng.randint(0, 100_000), "checkpoint_uri": "c"}
                        for a in n.allocs])
        else:
            h.register(f"n{rng.randrange(3):02d}", "A", 8)  # re-registration: its allocations end
        h.advance(rng.randint(0, 30_000))
        check_indexes(st)
        check_exclusions(st, h.now_ms)
        for k in range(3):  # the victim search for requests of every kind, not only those the pass made
            share = rng.random() < 0.3
            probe = RequestView(f"probe{k}", {
                "job_id": f"probe{k}", "task_id": "gpu", "attempt": 1, "tenant": rng.choice("abcd"),
                "tier": rng.choice(["enterprise", "standard"]), "gpus": 1 if share else rng.choice([1, 2, 4, 8]),
                "gpu_type": rng.choice([[], ["A"]]), "hosts": 1 if share else rng.choice([1, 2]),
                "gpu_milli": rng.choice([250, 500]) if share else 1000, "cpu_milli": rng.choice([0, 2000]),
                "memory_mib": 0, "max_runtime_ms": None, "checkpoint": True, "submitted_ms": 0, "seq": 0,
                "queued_ms": 0, "resume": None, "grants": 0})
            excl = excluded_for(st, probe, h.now_ms)
            checked(st, probe, h.now_ms, excl)
            parts = place(st, probe, excl)
            assert ([p.node for p in parts] if parts else []) == reference_frag_hosts(st, probe, excl)
            placed[0] += parts is not None
    h.commit()
    fresh = AllocatorFold(h.store, h.opts).state
    check_indexes(fresh)
    assert {r: list(v) for r, v in fresh.tier_hosts.items() if v} == {r: list(v) for r, v in st.tier_hosts.items() if v}
    assert fresh.queues == {r: t for r, t in st.queues.items() if t}
    assert h.digest() == h.replayed_digest()
    assert searches[1] > 0 and placed[0] > 0


@pytest.mark.parametrize("seed", range(3))
def test_compiled_scoring_equals_the_plain_definition_and_choice(seed: int) -> None:
    """A pool of many distinct host states (GPU shares, CPU, memory, GPU types) under a learned mix of typed
    and untyped, shared and whole-GPU classes, hosts short of CPU among them: the compiled kernel gives every
    signature exactly the score that ``usable``, ``stranded`` and ``remainder_waste`` (the definition, plain
    Python) give, and frag places new shapes on the hosts the plain scoring picks."""
    rng = random.Random(seed)
    h = AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), lease_s=10.0 ** 6, orphan_grace_s=None),
                         commit_every=64)
    for k in range(60):
        h.register(f"n{k:02d}", rng.choice(["A", "B", "C"]), rng.choice([2, 4, 8]),
                   cpu_milli=rng.choice([8000, 16000, 32000, 96000]), memory_mib=rng.choice([128000, 256000]))

    def shape() -> dict[str, Any]:
        share = rng.random() < 0.5
        return {"gpus": 1 if share else rng.choice([0, 1, 2, 4, 8]),
                "gpu_milli": rng.choice([100, 250, 330, 500, 750]) if share else 1000,
                "gpu_type": rng.choice([[], [], ["A"], ["B", "C"]]), "cpu_milli": rng.choice([1000, 4000, 6000]),
                "memory_mib": rng.choice([0, 8000, 30000])}

    mix = [shape() for _ in range(25)]
    for i in range(300):  # a learned profile, and hosts in many states
        h.request(f"j{i}", wait=False, **rng.choice(mix))
    st = h.fold.state
    assert len(st.groups) > 5 and st.capacity.n_sigs > 30
    scored = 0
    for k in range(60):
        s = shape()
        probe = RequestView(f"probe{k}", {
            "job_id": f"probe{k}", "task_id": "gpu", "attempt": 1, "tenant": "t", "tier": "standard",
            "gpus": s["gpus"], "gpu_type": s["gpu_type"], "hosts": 1, "gpu_milli": s["gpu_milli"],
            "cpu_milli": s["cpu_milli"], "memory_mib": s["memory_mib"], "max_runtime_ms": None, "checkpoint": True,
            "submitted_ms": 0, "seq": 0, "queued_ms": 0, "resume": None, "grants": 0})
        g, milli, cpu, mem = probe.gpus, probe.per_gpu_milli(), probe.cpu, probe.mem
        cands = list(st.capacity.candidate_sigs(probe.gpu_types, g, milli, cpu, mem))
        plain = [plain_frag_score(st, t, sig, g, milli, cpu, mem) for t, _l1, sig in cands]
        assert frag_scores(st, cands, g, milli, cpu, mem) == plain  # to the last bit
        st.rankings.clear()
        parts = place(st, probe)
        assert ([p.node for p in parts] if parts else []) == reference_frag_hosts(st, probe, set())
        scored += len(cands)
    assert scored > 100


def test_remainder_waste_pairs_shares_and_its_compiled_twin_is_exact() -> None:
    """The expected idle milli of a GPU remainder: nothing fits -> all of it idles; a remainder the mix
    fills well (530 after a 470, where the next 470 leaves 60) is worth keeping; and a 320-milli share is
    better in a 650's remainder (350 -> 30) or another 320's (680 -> 360, which the next 320 fills) than in
    a 470's (530 -> 210, where nothing of this mix fits). The compiled table equals the plain one to the bit."""
    classes: list[Any] = [(1, FULL, 4000, 0, (), 0.6), (1, 810, 3000, 0, (), 0.15), (1, 470, 8000, 0, (), 0.12),
                          (1, 650, 8000, 0, (), 0.05), (1, 320, 4000, 0, (), 0.06), (1, 160, 4000, 0, ("T4",), 0.02)]
    sizes, freq = share_sizes(classes, "G2")
    assert sizes.tolist() == [320, 470, 650, 810]  # the T4-only class is not one of a G2 host's
    e = remainder_waste(sizes, freq, FILL_RATE)
    assert e[0] == 0.0 and e[319] == 319.0 and e[190] == 190.0
    assert e[530] < 150  # a 470's remainder: the next 470 takes it
    into = {g: remainder_change((g,), 1, 320, e) for g in (350, 680, 530)}
    assert into[530] > 50 > max(into[350], into[680])
    assert remainder_change((FULL, FULL), 2, FULL, e) == 0.0  # whole GPUs: no remainder
    rng = random.Random(7)
    for _ in range(20):
        ms = sorted(rng.sample(range(10, 1000, 10), rng.randint(0, 12)))
        sz = np.array(ms, dtype=np.int64)
        fq = np.array([rng.random() / 10 for _ in ms], dtype=np.float64)
        rate = rng.choice([1.0, FILL_RATE, 300.0])
        assert scoring._remainder_waste(sz, fq, rate).tolist() == remainder_waste(sz, fq, rate).tolist()


def test_the_allocator_process_freezes_its_state_and_collects_less_often() -> None:
    """``tune_gc`` (called by ``dagfold allocator`` after catch-up; ``allocator_gc`` around the simulators'
    runs): the objects alive then are frozen out of the collector's scans and the young generation is
    collected at ``GC_THRESHOLD``."""
    import gc

    from dagfold.services.allocator.runner import GC_THRESHOLD, allocator_gc

    before = gc.get_threshold()
    state = [{"held": i} for i in range(1000)]  # the caught-up state stands in
    with allocator_gc():
        assert gc.get_threshold() == GC_THRESHOLD
        assert gc.get_freeze_count() >= len(state)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0  # the block's setting is undone


def test_the_scoring_kernel_works_where_numba_cannot_cache() -> None:
    """A read-only install without a home folder: numba finds no cache location and refuses ``cache=True``
    at import. The kernel then compiles in the process instead of failing the allocator's start."""
    import os
    import subprocess
    import sys

    code = ("from dagfold.services.allocator import scoring\n"
            "scoring.warm()\n"
            "print(type(scoring._scores._cache).__name__)\n")
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "IPythonCacheLocator"}  # none outside IPython
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NullCache"


def test_decisions_run_the_kernel_that_warm_compiled() -> None:
    """``scoring.warm`` compiles (or loads) the kernel before the first decision; a decision must not make
    numba compile another version of it (seconds, inside the decision), e.g. for a weight given as an int."""
    from dagfold.services.allocator import scoring

    scoring.warm()
    compiled = len(scoring._scores.signatures)
    h = AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), frag_pack_weight=0, frag_balance_weight=4,
                                      frag_remainder_weight=20), commit_every=16)
    for k in range(4):
        h.register(f"n{k}", "A", 8, cpu_milli=64000, memory_mib=256000)
    for i in range(20):
        h.request(f"j{i}", gpus=1, gpu_milli=300 + 10 * i, cpu_milli=2000, wait=False)
    assert h.fold.state.scorer is not None  # frag scored
    assert len(scoring._scores.signatures) == compiled
