"""The GPU cluster read model: folded from allocator events when they exist, empty otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dagfold.config import ALLOCATOR_EVENTS, Config
from dagfold.log.base import LogRecord, TopicSpec
from dagfold.log.embedded import EmbeddedLog
from dagfold.projections import ClusterModel, Projector, ReadModelStore
from dagfold.projections import cluster as cluster_model

T0 = 1_700_000_000_000
A = "dagfold.allocator."


def node(nid: str, gpus: int = 8, health: str = "healthy", pool: str = "p1", **kw: Any) -> dict[str, Any]:
    return {"type": A + "NodeRegistered", "node_id": nid, "pool": pool, "gpus": gpus, "gpu_type": "H100",
            "health": health, "ts_ms": T0, **kw}


def grant(aid: str, tenant: str, placements: list[tuple[str, int]], job: str = "j") -> dict[str, Any]:
    return {"type": A + "AllocationGranted", "allocation_id": aid, "job_id": job, "task_id": "t", "tenant": tenant,
            "tier": "enterprise", "placements": [{"node_id": n, "gpus": g} for n, g in placements], "ts_ms": T0 + 1}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ReadModelStore]:
    s = ReadModelStore(tmp_path / "read")
    yield s
    s.close()


def fold(store: ReadModelStore, *events: dict[str, Any]) -> None:
    txn = store.txn()
    for e in events:
        cluster_model.apply(txn, e)
    store.commit(txn)


def test_empty_until_allocator_events(store: ReadModelStore) -> None:
    cm = ClusterModel(store)
    assert cm.totals() is None and cm.nodes().items == [] and cm.tenants() == []
    txn = store.txn()
    assert cluster_model.apply(txn, {"type": "dagfold.event.JobAccepted", "job_id": "x"}) is False
    assert len(txn) == 0


def test_occupancy_grants_releases_and_health(store: ReadModelStore) -> None:
    cm = ClusterModel(store)
    fold(store, node("h1"), node("h2"), node("h3", gpus=4, pool="p2"))
    tot = cm.totals()
    assert tot is not None and (tot["nodes"], tot["gpus"], tot["healthy_gpus"], tot["allocated"]) == (3, 20, 20, 0)

    fold(store, grant("a1", "acme", [("h1", 8), ("h2", 8)]), grant("a2", "beta", [("h3", 2)]))
    fold(store, grant("a1", "acme", [("h1", 8), ("h2", 8)]))  # a repeated grant changes nothing
    tot = cm.totals()
    assert tot is not None and tot["allocated"] == 18
    nodes = {n["node_id"]: n for n in cm.nodes().items}
    assert nodes["h1"]["allocated"] == 8 and nodes["h1"]["tenants"] == {"acme": 8}
    assert nodes["h3"]["allocations"] == {"a2": {"tenant": "beta", "gpus": 2, "job_id": "j"}}
    assert {t["tenant"]: (t["gpus"], t["allocations"]) for t in cm.tenants()} == {"acme": (16, 1), "beta": (2, 1)}
    assert [a["allocation_id"] for a in cm.allocations_of("acme")] == ["a1"]
    assert [n["node_id"] for n in cm.nodes(pool="p2").items] == ["h3"]

    # a heartbeat with utilisation; a drained node leaves the healthy capacity
    fold(store, {"type": A + "NodeHeartbeat", "node_id": "h1", "gpu_util": [90, 80, 100, 70, 90, 80, 100, 70],
                 "ts_ms": T0 + 2},
         {"type": A + "NodeDrained", "node_id": "h2", "reason": "xid 79", "ts_ms": T0 + 3})
    nodes = {n["node_id"]: n for n in cm.nodes().items}
    assert nodes["h1"]["utilization"] == pytest.approx(0.85) and nodes["h2"]["health"] == "drained"
    tot = cm.totals()
    assert tot is not None and tot["healthy_gpus"] == 12 and tot["gpus"] == 20

    fold(store, {"type": A + "AllocationReleased", "allocation_id": "a1", "ts_ms": T0 + 4},
         {"type": A + "AllocationExpired", "alloc_id": "a2", "ts_ms": T0 + 5},
         {"type": A + "AllocationReleased", "allocation_id": "unknown", "ts_ms": T0 + 5})
    tot = cm.totals()
    assert tot is not None and tot["allocated"] == 0 and tot["events"] == 11
    assert all(n["allocated"] == 0 and n["tenants"] == {} and n["allocations"] == {} for n in cm.nodes().items)
    assert {t["tenant"]: t["gpus"] for t in cm.tenants()} == {"acme": 0, "beta": 0}

    fold(store, {"type": A + "TenantShareUpdated", "tenant": "acme", "weight": 3, "dominant_share": 0.25},
         {"type": A + "NodeRemoved", "node_id": "h3"})
    acme = next(t for t in cm.tenants() if t["tenant"] == "acme")
    assert acme["weight"] == 3 and acme["share"] == 0.25
    tot = cm.totals()
    assert tot is not None and tot["nodes"] == 2 and tot["gpus"] == 16


def test_tolerates_other_field_names(store: ReadModelStore) -> None:
    """Allocator schemas may name fields differently (host, gpu_count, hosts with gpus_per_host)."""
    cm = ClusterModel(store)
    fold(store, {"type": A + "NodeHeartbeat", "host": "n1", "gpu_count": 8, "model": "A100", "healthy": True},
         {"type": A + "NodeHeartbeat", "host": "n2", "gpu_count": 8, "status": "Degraded"},
         {"type": A + "GangAllocated", "job_id": "g1", "task_id": "t", "attempt": 1, "tenant": "acme",
          "hosts": ["n1", "n2"], "gpus_per_host": 4})
    nodes = {n["node_id"]: n for n in cm.nodes().items}
    assert nodes["n1"]["gpu_type"] == "A100" and nodes["n1"]["allocated"] == 4
    assert nodes["n2"]["health"] == "degraded"
    tot = cm.totals()
    assert tot is not None and tot["healthy_gpus"] == 8 and tot["allocated"] == 8
    fold(store, {"type": A + "Released", "job_id": "g1", "task_id": "t", "attempt": 1})
    tot = cm.totals()
    assert tot is not None and tot["allocated"] == 0


def test_projector_reads_the_allocator_topic_once_it_exists(tmp_path: Path) -> None:
    from dagfold.codec import Codec

    class DictCodec(Codec):  # the allocator's schemas are not in this tree yet: records are JSON here
        def __init__(self) -> None:
            pass

        def decode(self, data: bytes | None) -> dict[str, Any]:  # type: ignore[override]
            import json

            return dict(json.loads(data or b"{}"))

    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(Config(partitions=2).core_topics())
    projector = Projector(log, tmp_path / "read", codec=DictCodec())
    try:
        assert projector.catch_up(timeout_s=2, idle_s=0.2) == 0
        assert ClusterModel(projector.store).totals() is None
        log.create_topics([TopicSpec(ALLOCATOR_EVENTS, 2)])
        import json

        p = log.producer("alloc")
        p.send(ALLOCATOR_EVENTS, b"pool-1", json.dumps(node("h1")).encode())
        p.send(ALLOCATOR_EVENTS, b"pool-1", json.dumps(grant("a1", "acme", [("h1", 8)])).encode())
        p.flush()
        assert projector.catch_up(timeout_s=5, idle_s=0.3) == 2
        tot = ClusterModel(projector.store).totals()
        assert tot is not None and tot["allocated"] == 8
        assert sum(projector.positions(ALLOCATOR_EVENTS).values()) == 2
        # positions fence a replay of the same records
        recs: list[LogRecord] = []
        for part in range(2):
            from dagfold.log.base import TopicPartition

            recs += log.read(TopicPartition(ALLOCATOR_EVENTS, part), 0, 10)
        assert projector.apply_records(recs) == 0
    finally:
        projector.close()
        log.close()


def test_follows_the_real_allocator(store: ReadModelStore) -> None:
    """Events of the allocator's own fold (virtual time): the model agrees with the allocator's state."""
    from dagfold.services.allocator.harness import AllocatorHarness

    h = AllocatorHarness()
    for i in range(3):
        h.register(f"n{i}", gpus=8)
    h.request("j1", tenant="acme", gpus=8, hosts=2)           # a gang on two hosts
    h.request("j2", tenant="beta", gpus=4)
    h.request("j3", tenant="beta", gpus=8, hosts=2)           # does not fit now: queued
    cm = ClusterModel(store)
    seen = [0]

    def check() -> None:
        txn = store.txn()
        for e in h.events[seen[0]:]:
            assert cluster_model.apply(txn, e)
        seen[0] = len(h.events)
        store.commit(txn)
        nodes = {n["node_id"]: n for n in cm.nodes().items}
        st = h.fold.state
        for nid, view in st.nodes.items():
            used = sum(1 for f in view.free if f != 1000)
            assert nodes[nid]["allocated"] == used, nid
            assert (nodes[nid]["health"] == "healthy") == (view.state == "up" and view.health == "ok"), nid
        tot = cm.totals()
        assert tot is not None and tot["queued"] == sum(len(q) for t in st.queues.values() for q in t.values())

    check()
    tot = cm.totals()
    assert tot is not None and (tot["allocated"], tot["queued"], tot["queued_gpus"]) == (20, 1, 16)
    assert {t["tenant"]: (t["gpus"], t.get("queued", 0)) for t in cm.tenants()} == {"acme": (16, 0), "beta": (4, 1)}

    alloc = h.alloc_of("j1")
    assert alloc is not None
    h.release(alloc)                                           # j1 done: j3 fits now
    check()
    assert {t["tenant"]: t["gpus"] for t in cm.tenants()} == {"acme": 0, "beta": 20}

    for _ in range(2):                                         # n2 stops heartbeating: lost, its allocation expires
        for i in (0, 1):
            h.heartbeat(f"n{i}")
        h.advance(20_000)
    check()
    lost = [n for n in cm.nodes().items if n["health"] == "lost"]
    assert [n["node_id"] for n in lost] == ["n2"] and lost[0]["allocated"] == 0
    tot = cm.totals()
    assert tot is not None and tot["healthy_gpus"] == 16
