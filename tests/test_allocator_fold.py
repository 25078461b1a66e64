"""Unit tests of the allocator fold (services/allocator): placement, leases, drains, preemption, backfill."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dagfold.codec import default_codec
from dagfold.services.allocator import commands as cmds
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.harness import AllocatorHarness
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.state import MemoryStore, PartitionTransaction
from dagfold.state.store import state_digest

A = "dagfold.allocator."


def names(h: AllocatorHarness, since: int = 0) -> list[str]:
    return [e["type"][len(A):] for e in h.events[since:]]


def harness(hosts: int = 2, gpus: int = 8, gpu_type: str = "H100", **opts: object) -> AllocatorHarness:
    opts.setdefault("lease_s", 3600.0)
    opts.setdefault("orphan_grace_s", None)  # these heartbeats list no processes (orphans: their own test)
    h = AllocatorHarness(opts=replace(AllocatorOptions(pool="p"), **opts))  # type: ignore[arg-type]
    for i in range(hosts):
        h.register(f"n{i}", gpu_type, gpus)
    return h


def granted(h: AllocatorHarness, job: str) -> dict:
    gs = [e for e in h.of_type("AllocationGranted") if e["job_id"] == job]
    assert gs, f"{job} was not granted: {names(h)}"
    return gs[-1]


def test_gang_on_one_host_and_across_hosts() -> None:
    h = harness(hosts=3)
    h.request("one", gpus=4)
    g = granted(h, "one")
    assert len(g["hosts"]) == 1 and len(g["hosts"][0]["gpu_indices"]) == 4
    h.request("multi", gpus=8, hosts=2)
    g = granted(h, "multi")
    assert len({x["node_id"] for x in g["hosts"]}) == 2
    assert all(x["gpu_indices"] == list(range(8)) for x in g["hosts"])


def test_gang_is_all_or_nothing() -> None:
    h = harness(hosts=3)
    h.request("a", gpus=8, max_runtime_s=600)
    before = {n: list(v.free) for n, v in h.fold.state.nodes.items()}
    h.request("big", gpus=8, hosts=3, max_runtime_s=100)
    assert not [e for e in h.of_type("AllocationGranted") if e["job_id"] == "big"]
    assert {n: list(v.free) for n, v in h.fold.state.nodes.items()} == before  # nothing held
    assert h.of_type("ReservationMade")[-1]["job_id"] == "big"


def test_gpu_type_constraints_and_sets() -> None:
    h = harness(hosts=1)
    h.register("a100", "A100", 8)
    h.request("x", gpus=2, gpu_type=["A100"])
    assert granted(h, "x")["hosts"][0]["node_id"] == "a100"
    h.request("y", gpus=2, gpu_type=["V100", "H100"])
    assert granted(h, "y")["hosts"][0]["node_id"] == "n0"
    h.request("z", gpus=1, gpu_type=["T4"])
    assert "no registered host has GPU type T4" in h.of_type("RequestRejected")[-1]["reason"]


def test_gpu_sharing_packs_fractions_on_one_gpu() -> None:
    h = harness(hosts=1, gpus=2)
    h.request("s1", gpus=1, gpu_milli=500)
    h.request("s2", gpus=1, gpu_milli=400)
    g1, g2 = granted(h, "s1"), granted(h, "s2")
    assert g1["hosts"][0]["gpu_indices"] == g2["hosts"][0]["gpu_indices"]
    n = h.fold.state.nodes["n0"]
    assert sorted(n.free) == [100, 1000]


@pytest.mark.parametrize("kw,why", [
    ({"gpus": 9}, "largest host"), ({"gpus": 8, "hosts": 5}, "5 hosts of 8 GPUs requested"),
    ({"gpus": 8, "hosts": 2, "gpu_type": ["SMALL"]}, "2 hosts of 8 GPUs requested; the pool has 1"),
    ({"gpus": 2, "gpu_milli": 500}, "GPU share"), ({"tier": "gold"}, "unknown tier"),
    ({"gpus": 1, "max_runtime_s": -1.0}, "max_runtime_s"),
])
def test_rejections(kw: dict, why: str) -> None:
    h = harness(hosts=2)
    h.register("small-0", "SMALL", 8)
    h.register("small-1", "SMALL", 4)  # 2 hosts of the type, but one too small for the gang's part
    h.request("r", **kw)
    assert why in h.of_type("RequestRejected")[-1]["reason"]
    assert not h.fold.state.requests


def test_quota_caps_a_tenant_and_rejects_what_can_never_fit() -> None:
    h = harness(hosts=2, tenant_quota_gpus={"t": 8})
    h.request("a", gpus=8, tenant="t")
    h.request("b", gpus=4, tenant="t")
    h.request("c", gpus=4, tenant="u")
    assert granted(h, "a") and granted(h, "c")
    assert "b" not in {e["job_id"] for e in h.of_type("AllocationGranted")}
    h.request("d", gpus=8, hosts=2, tenant="t")
    assert "quota" in h.of_type("RequestRejected")[-1]["reason"]
    h.release(h.alloc_of("a"))
    assert granted(h, "b")


def test_duplicate_request_is_idempotent() -> None:
    h = harness(hosts=1)
    h.request("a", gpus=2)
    n = len(h.events)
    h.request("a", gpus=2)
    assert len(h.events) == n


def test_node_that_stops_heartbeating_loses_its_allocations() -> None:
    h = harness(hosts=2, lease_s=30.0)
    h.request("a", gpus=8, checkpoint=True)
    node = granted(h, "a")["hosts"][0]["node_id"]
    other = "n1" if node == "n0" else "n0"
    for _ in range(5):
        h.advance(10_000)
        h.heartbeat(other)
    lost = [e for e in h.of_type("NodeDrained") if e["node_id"] == node]
    assert lost and lost[0]["lost"]
    assert not h.fold.state.nodes[node].allocs
    exp = h.of_type("AllocationExpired")
    assert exp and exp[0]["requeued"]
    assert granted(h, "a")["hosts"][0]["node_id"] == other  # requeued and placed on the live host
    # the lost node comes back: its heartbeat (old incarnation) is fenced; it re-registers
    out = h.heartbeat(node, allocations=[cmds.alloc_status(exp[0]["alloc_id"], exp[0]["epoch"])])
    assert [o.record["reason"] for o in out if o.record["type"] == A + "StopAllocation"][0].startswith("fenced")
    h.register(node, "H100", 8, incarnation=2)
    assert h.fold.state.nodes[node].state == "up"


def test_heartbeats_keep_allocations_alive_and_record_checkpoints() -> None:
    h = harness(hosts=1, lease_s=30.0)
    h.request("a", gpus=8, checkpoint=True)
    g = granted(h, "a")
    for k in range(6):
        h.advance(10_000)
        h.heartbeat("n0", allocations=[cmds.alloc_status(g["alloc_id"], g["epoch"], last_checkpoint_ms=h.now_ms,
                                                          checkpoint_uri=f"/ckpt/{k}")])
    assert not h.of_type("AllocationExpired")
    assert h.fold.state.allocs[g["alloc_id"]].last_ckpt_uri == "/ckpt/5"


def test_a_heartbeat_with_nothing_new_records_nothing_until_the_lease_needs_renewing() -> None:
    # 1 s heartbeats against a 30 s lease: only what changes state, and a renewal every lease/4, is recorded
    h = harness(hosts=2, lease_s=30.0, orphan_grace_s=60.0)
    h.request("a", gpus=4, checkpoint=True)
    g = granted(h, "a")
    run = [cmds.alloc_status(g["alloc_id"], g["epoch"])]
    gpus = [cmds.gpu_status(i, utilization=0.9 if i < 4 else 0.0) for i in range(8)]
    h.advance(1_000)
    before = len(h.of_type("NodeHeartbeatRecorded"))
    for _ in range(60):  # a minute of unchanged heartbeats from both hosts
        h.heartbeat("n0", allocations=run, gpus=gpus, perf=1.0)
        h.heartbeat("n1", gpus=[cmds.gpu_status(i, utilization=0.0) for i in range(8)])
        h.advance(1_000)
    beats = h.of_type("NodeHeartbeatRecorded")[before:]
    per_node = {n: [e for e in beats if e["node_id"] == n] for n in ("n0", "n1")}
    assert 7 <= len(per_node["n0"]) <= 10 and 7 <= len(per_node["n1"]) <= 10  # every 7.5 s, not 60 each
    assert not h.of_type("NodeDrained") and not h.of_type("AllocationExpired")  # the leases stayed alive
    assert per_node["n0"][-1]["utilization"] == pytest.approx(0.45)

    # a checkpoint, a bad GPU, a node-level health change: each recorded at once, in the next heartbeat
    n = len(h.of_type("NodeHeartbeatRecorded"))
    h.heartbeat("n0", allocations=[cmds.alloc_status(g["alloc_id"], g["epoch"], last_checkpoint_ms=h.now_ms,
                                                      checkpoint_uri="/ckpt/1")], gpus=gpus, perf=1.0)
    assert len(h.of_type("NodeHeartbeatRecorded")) == n + 1
    assert h.fold.state.allocs[g["alloc_id"]].last_ckpt_uri == "/ckpt/1"
    bad = [cmds.gpu_status(i, health="xid" if i == 6 else "ok") for i in range(8)]
    h.heartbeat("n1", gpus=bad)
    assert h.of_type("NodeHeartbeatRecorded")[-1]["cordoned_gpus"] == [6]
    assert h.fold.state.nodes["n1"].cordoned == [6]
    h.heartbeat("n1", gpus=bad)  # the same report again: nothing new
    assert len(h.of_type("NodeHeartbeatRecorded")) == n + 2
    h.heartbeat("n1", health="throttled", gpus=bad)
    assert h.of_type("NodeDrained")[-1]["node_id"] == "n1"
    # a process the allocator does not know is fenced by an unrecorded heartbeat too
    out = h.heartbeat("n0", allocations=run + [cmds.alloc_status("p:99", 99)], gpus=gpus, perf=1.0)
    assert any(o.record["type"] == A + "StopAllocation" and o.record["alloc_id"] == "p:99" for o in out)
    assert h.replayed_digest() == h.digest()  # replay of the recorded events equals the live state


def test_a_node_whose_heartbeats_stop_is_lost_within_a_lease_of_its_last_heartbeat() -> None:
    h = harness(hosts=1, lease_s=30.0)
    for _ in range(20):
        h.advance(1_000)
        h.heartbeat("n0")
    last = h.now_ms
    h.advance(40_000)
    lost = h.of_type("NodeDrained")
    assert lost and lost[0]["lost"]
    assert 30_000 - 7_500 <= lost[0]["ts_ms"] - last <= 30_000  # lease_s - lease_s/4 .. lease_s


def test_gray_failure_drains_and_moves_jobs_from_checkpoints() -> None:
    h = harness(hosts=2, grace_s=30.0, undrain_ok_heartbeats=2)
    h.request("a", gpus=8, checkpoint=True)
    g = granted(h, "a")
    node = g["hosts"][0]["node_id"]
    h.heartbeat(node, health="throttled", detail="GPU 3 at 92 C")
    drained = h.of_type("NodeDrained")[-1]
    assert drained["node_id"] == node and not drained["lost"] and "throttled" in drained["reason"]
    pr = h.of_type("PreemptionRequested")[-1]
    assert pr["alloc_id"] == g["alloc_id"] and pr["preemptor_job_id"] is None
    assert any(c["checkpoint"] for c in h.controls if c["alloc_id"] == g["alloc_id"])
    h.release(g["alloc_id"], "preempted", checkpoint_uri="/ckpt/a/7")
    g2 = granted(h, "a")
    assert g2["hosts"][0]["node_id"] != node and g2["resume_checkpoint"] == "/ckpt/a/7" and g2["grants"] == 2
    for _ in range(2):
        h.heartbeat(node)
    assert h.of_type("NodeRestored")[-1]["node_id"] == node


def test_slow_node_is_drained_against_the_fleet() -> None:
    h = harness(hosts=3)
    for _ in range(3):
        for n in ("n0", "n1", "n2"):
            h.heartbeat(n, perf=1.0)
    h.heartbeat("n2", perf=0.3)
    assert h.of_type("NodeDrained")[-1]["reason"].startswith("slow")


def test_ecc_drain_is_sticky_until_re_registration() -> None:
    h = harness(hosts=1, undrain_ok_heartbeats=1)
    h.heartbeat("n0", health="ecc_errors")
    for _ in range(3):
        h.heartbeat("n0")
    assert not h.of_type("NodeRestored")
    h.register("n0", "H100", 8, incarnation=2)
    assert h.fold.state.nodes["n0"].state == "up"


def test_preemption_checkpoints_victim_then_places_higher_tier() -> None:
    h = harness(hosts=1, grace_s=30.0)
    h.request("free1", gpus=4, tier="free", checkpoint=True)
    h.request("free2", gpus=4, tier="free", checkpoint=False)
    f1 = granted(h, "free1")
    h.heartbeat("n0", allocations=[cmds.alloc_status(f1["alloc_id"], f1["epoch"], last_checkpoint_ms=h.now_ms)])
    h.advance(60_000)
    h.request("ent", gpus=4, tier="enterprise")
    pr = h.of_type("PreemptionRequested")
    assert len(pr) == 1 and pr[0]["job_id"] == "free1"  # least work lost: free1 just checkpointed
    assert pr[0]["preemptor_tier"] == "enterprise"
    h.release(pr[0]["alloc_id"], "preempted", checkpoint_uri="/c/free1")
    assert granted(h, "ent")
    queued = [e for e in h.of_type("RequestQueued") if e["job_id"] == "free1"]
    assert queued[-1]["requeued"] and queued[-1]["resume_checkpoint"] == "/c/free1"


def test_grace_expiry_stops_the_victim() -> None:
    h = harness(hosts=1, grace_s=30.0)
    h.request("free1", gpus=8, tier="free")
    h.request("ent", gpus=8, tier="enterprise")
    assert h.of_type("PreemptionRequested")
    h.advance(31_000)
    rel = h.of_type("AllocationReleased")[-1]
    assert "grace expired" in rel["reason"] and rel["requeued"]
    assert granted(h, "ent")


def test_equal_tier_never_preempts_and_standard_waits_before_preempting() -> None:
    h = harness(hosts=1, preempt_after_s={"enterprise": 0.0, "standard": 120.0})
    h.request("e1", gpus=8, tier="enterprise")
    h.request("e2", gpus=8, tier="enterprise")
    assert not h.of_type("PreemptionRequested")
    h2 = harness(hosts=1, preempt_after_s={"enterprise": 0.0, "standard": 120.0})
    h2.request("f", gpus=8, tier="free")
    h2.request("s", gpus=8, tier="standard")
    assert not h2.of_type("PreemptionRequested")
    h2.advance(121_000)
    h2.heartbeat("n0")
    h2.request("other", gpus=8, tier="free")  # any command runs a pass
    assert h2.of_type("PreemptionRequested")[-1]["job_id"] == "f"


def test_backfill_uses_gaps_that_end_before_the_reservation() -> None:
    h = harness(hosts=2)
    h.request("long", gpus=8, max_runtime_s=1000)
    h.request("mid", gpus=4, max_runtime_s=600)
    h.request("big", gpus=8, hosts=2, max_runtime_s=100)
    res = h.of_type("ReservationMade")[-1]
    assert res["job_id"] == "big" and res["kind"] == "backfill"
    start = res["start_ms"]
    h.request("short", gpus=4, max_runtime_s=60)  # ends long before the reservation: backfilled
    assert granted(h, "short")
    h.request("toolong", gpus=1, max_runtime_s=5000)  # would delay it: waits
    assert "toolong" not in {e["job_id"] for e in h.of_type("AllocationGranted")}
    for job in ("short", "mid", "long"):
        h.release(h.alloc_of(job))
    g = granted(h, "big")
    assert g["ts_ms"] <= start


def test_max_runtime_is_enforced() -> None:
    h = harness(hosts=1, runtime_grace_s=10.0)
    h.request("a", gpus=1, max_runtime_s=60)
    h.advance(71_000)
    assert h.of_type("AllocationExpired")[-1]["reason"] == "max_runtime_s exceeded"


def test_cancel_queued_and_running() -> None:
    h = harness(hosts=1)
    h.request("a", gpus=8)
    h.request("b", gpus=8)
    h.cancel("b")
    assert h.of_type("RequestCancelled")[-1]["job_id"] == "b"
    h.cancel("a")
    rel = h.of_type("AllocationReleased")[-1]
    assert rel["job_id"] == "a" and rel["reason"].startswith("cancelled")
    assert h.controls[-1]["type"] == A + "StopAllocation"
    assert not h.fold.state.allocs and not h.fold.state.requests


def test_stale_processes_are_fenced_by_epoch() -> None:
    h = harness(hosts=1)
    h.request("a", gpus=1)
    g = granted(h, "a")
    out = h.heartbeat("n0", allocations=[cmds.alloc_status(g["alloc_id"], g["epoch"]),
                                         cmds.alloc_status("p:999", 999)])
    stops = [o.record for o in out if o.record["type"] == A + "StopAllocation"]
    assert [s["alloc_id"] for s in stops] == ["p:999"]
    out = h.heartbeat("n0", incarnation=7)
    assert any("stale incarnation" in o.record["reason"] for o in out)


def test_no_pass_deferral_loop_without_progress() -> None:
    h = harness(hosts=1, pass_budget=2)
    for i in range(10):
        h.request(f"j{i}", gpus=8, max_runtime_s=100)
    h.advance(1)
    assert len(h.of_type("PassDeferred")) <= 2


def test_replay_rebuilds_state_byte_for_byte_and_reload_keeps_indexes() -> None:
    h = harness(hosts=3, lease_s=30.0, grace_s=20.0)
    h.request("f", gpus=8, tier="free", checkpoint=True, max_runtime_s=500)
    h.request("s", gpus=1, gpu_milli=300, tier="standard")
    h.request("g", gpus=8, hosts=2, tier="standard", max_runtime_s=300)
    h.request("e", gpus=8, tier="enterprise")
    h.advance(25_000)
    h.heartbeat("n0", health="throttled")
    h.advance(40_000)
    h.cancel("s")
    assert h.digest() == h.replayed_digest()
    # a fold opened on the committed store sees the same views
    fresh = AllocatorFold(h.store, h.opts)
    live = h.fold.state
    assert {k: v.record() for k, v in fresh.state.nodes.items()} == {k: v.record() for k, v in live.nodes.items()}
    assert {k: v.record() for k, v in fresh.state.allocs.items()} == \
        {k: v.record() for k, v in live.allocs.items()}
    assert fresh.state.timers == live.timers and fresh.state.queued_shapes == live.queued_shapes


def test_a_failing_command_leaves_no_trace() -> None:
    store = MemoryStore()
    fold = AllocatorFold(store, AllocatorOptions(pool="p"))
    txn = PartitionTransaction(store)
    fold.process(txn, cmds.register_node("p", "n0", "H100", 8), 0, 0)
    fold.process(txn, cmds.request_allocation("p", "a", gpus=2), 0, 1)
    bad = cmds.request_allocation("p", "b", gpus=2)
    del bad["hosts"]
    with pytest.raises(KeyError):
        fold.process(txn, bad, 0, 2)
    fold.process(txn, cmds.request_allocation("p", "c", gpus=2), 0, 3)
    txn.commit()
    assert sorted(a.req.job_id for a in fold.state.allocs.values()) == ["a", "c"]
    assert sorted(fold.state.nodes["n0"].free) == [0, 0, 0, 0, 1000, 1000, 1000, 1000]
    assert state_digest(store)


def test_every_output_matches_its_schema() -> None:
    codec = default_codec()
    h = harness(hosts=2, lease_s=30.0)
    h.request("f", gpus=8, tier="free", checkpoint=True, max_runtime_s=100)
    h.request("e", gpus=8, tier="enterprise", gpu_type=["H100"])
    h.request("b", gpus=8, hosts=2, max_runtime_s=50)
    h.heartbeat("n1", health="xid", allocations=[cmds.alloc_status("p:9", 9, progress=0.5)])
    h.cancel("b")
    h.advance(200_000)
    seen = set()
    for rec in h.events + h.controls:
        codec.decode(codec.encode(rec, validate_record=True))
        seen.add(rec["type"])
    assert len(seen) >= 10
    for c in (cmds.register_node("p", "n", "H100", 8), cmds.node_heartbeat("p", "n"),
              cmds.request_allocation("p", "j"), cmds.release_allocation("p", "a", 1, "n"),
              cmds.cancel_request("p", "j")):
        codec.encode(c, validate_record=True)


def test_a_gang_holds_its_hosts_until_its_first_host_ends_and_a_failed_part_tells_the_scheduler() -> None:
    h = harness(hosts=3)
    h.request("g1", task_id="t", gpus=8, hosts=2)
    g = h.of_type("AllocationGranted")[-1]
    first, second = (p["node_id"] for p in g["hosts"])
    h.process(cmds.release_allocation(h.pool, g["alloc_id"], g["epoch"], second, "completed", ts_ms=h.now_ms))
    assert g["alloc_id"] in h.fold.state.allocs  # a part finished early: the gang still holds both hosts
    h.process(cmds.release_allocation(h.pool, g["alloc_id"], g["epoch"], first, "completed", ts_ms=h.now_ms))
    assert g["alloc_id"] not in h.fold.state.allocs
    assert not [c for c in h.scheduler_commands if c["status"] != "granted"]  # the first host reports itself

    h.request("g2", task_id="t", gpus=8, hosts=2)
    g2 = h.of_type("AllocationGranted")[-1]
    part = g2["hosts"][1]["node_id"]
    h.process(cmds.release_allocation(h.pool, g2["alloc_id"], g2["epoch"], part, "failed", exit_code=1,
                                      ts_ms=h.now_ms))
    assert g2["alloc_id"] not in h.fold.state.allocs
    told = h.scheduler_commands[-1]
    assert (told["job_id"], told["status"], told["alloc_id"]) == ("g2", "ended", g2["alloc_id"])
    assert told["reason"] == f"failed on {part}"
    stopped = [c["node_id"] for c in h.controls if c["alloc_id"] == g2["alloc_id"]]
    assert stopped == [g2["hosts"][0]["node_id"]]  # the first host's process is stopped


def test_the_scheduler_hears_of_grants_requeues_and_rejections() -> None:
    h = harness(hosts=1, gpus=8, lease_s=5.0)
    h.request("a", task_id="t", gpus=4, checkpoint=True)
    h.request("too-big", task_id="t", gpus=16)
    g = h.of_type("AllocationGranted")[-1]
    h.advance(6_000)  # no heartbeat: the node's lease expires, the allocation goes back to the queue
    told = [(c["job_id"], c["status"]) for c in h.scheduler_commands]
    assert told == [("a", "granted"), ("too-big", "rejected"), ("a", "requeued")]
    assert h.scheduler_commands[0]["hosts"] == g["hosts"]
    assert h.scheduler_commands[1]["reason"].startswith("16 GPUs per host requested")
    for c in h.scheduler_commands:
        default_codec().encode(c, validate_record=True)


def test_an_allocation_its_first_host_never_runs_is_requeued_after_the_grace() -> None:
    h = harness(hosts=2, orphan_grace_s=30.0)
    h.request("lost-dispatch", task_id="t", gpus=8, checkpoint=True)
    g = h.of_type("AllocationGranted")[-1]
    node = g["hosts"][0]["node_id"]
    h.now_ms += 20_000
    h.heartbeat(node)  # not listed, but within the grace: the dispatch may still be on its way
    assert g["alloc_id"] in h.fold.state.allocs
    h.now_ms += 15_000
    h.heartbeat(node)
    ended = h.of_type("AllocationExpired")[-1]
    assert ended["alloc_id"] == g["alloc_id"] and ended["requeued"] and "not running on" in ended["reason"]
    assert h.of_type("AllocationGranted")[-1]["alloc_id"] != g["alloc_id"]  # placed again at once
    assert [c["status"] for c in h.scheduler_commands] == ["granted", "requeued", "granted"]
    listed = h.of_type("AllocationGranted")[-1]
    h.now_ms += 60_000
    h.heartbeat(listed["hosts"][0]["node_id"], allocations=[cmds.alloc_status(listed["alloc_id"], listed["epoch"])])
    assert listed["alloc_id"] in h.fold.state.allocs  # a running allocation is left alone


# -- issue 24, recipe 7: a tenant's own declaration never drains a host ------------------------------------------
# Before: the agent reported the median of its jobs' paces (progress against the max_runtime_s each job declared)
# as the host's perf, and the allocator drained a host whose perf fell below half the fleet's. A job declaring 3 s
# for 100 s of work drained its host as "slow" 6 times in 126 s, checkpointing and requeueing another tenant's job
# there each time, then hopped to the next host; its runtime limit restarted with every grant.

def _paces(h: AllocatorHarness, node: str, *allocs: tuple[dict, float]) -> list:
    """A heartbeat as the agent sends it: each job's pace, and no figure of the host's own (NVML)."""
    return h.heartbeat(node, allocations=[cmds.alloc_status(g["alloc_id"], g["epoch"], pace=p) for g, p in allocs])


def test_one_tenants_slow_jobs_do_not_drain_the_host_they_share() -> None:
    h = harness(hosts=1)
    h.request("honest", tenant="acme", gpus=4, max_runtime_s=600, checkpoint=True)
    h.request("liar", task_id="t1", tenant="mallory", gpus=2, max_runtime_s=3, checkpoint=True)
    h.request("liar", task_id="t2", tenant="mallory", gpus=2, max_runtime_s=3, checkpoint=True)
    honest, l1, l2 = granted(h, "honest"), *[e for e in h.of_type("AllocationGranted") if e["job_id"] == "liar"]
    for _ in range(3):  # the fleet's pace: every job keeps to what it declared
        _paces(h, "n0", (honest, 1.5), (l1, 1.5), (l2, 1.5))
    assert h.fold.state.perf["H100"] == pytest.approx(1.5)
    for _ in range(5):  # mallory's jobs go at 3% of what they declared: 2 of 3, the host's median
        _paces(h, "n0", (honest, 1.5), (l1, 0.03), (l2, 0.03))
        h.advance(1_000)
    assert not h.of_type("NodeDrained") and not h.of_type("PreemptionRequested")
    assert h.fold.state.nodes["n0"].state == "up"
    assert h.fold.state.perf["H100"] == pytest.approx(1.5)  # and their claim does not move the fleet's average


def test_jobs_of_several_tenants_going_slow_drain_the_host() -> None:
    h = harness(hosts=1)
    h.request("a", tenant="acme", gpus=4, max_runtime_s=600, checkpoint=True)
    h.request("b", tenant="globex", gpus=4, max_runtime_s=600, checkpoint=True)
    a, b = granted(h, "a"), granted(h, "b")
    for _ in range(3):
        _paces(h, "n0", (a, 1.5), (b, 1.5))
    _paces(h, "n0", (a, 0.4), (b, 0.5))
    drained = h.of_type("NodeDrained")
    assert drained and drained[-1]["reason"].startswith("slow")
    assert {e["job_id"] for e in h.of_type("PreemptionRequested")} == {"a", "b"}


def test_a_jobs_runtime_limit_counts_across_its_grants() -> None:
    h = harness(hosts=1, runtime_grace_s=10.0, grace_s=1.0)
    h.request("liar", tenant="mallory", gpus=8, max_runtime_s=3, checkpoint=True)
    first = granted(h, "liar")
    h.advance(8_000)
    h.request("vip", tenant="acme", tier="enterprise", gpus=8)  # preempts it: checkpoint, stop, requeue
    h.release(first["alloc_id"], "preempted", checkpoint_uri="/ckpt/liar/1")
    assert h.of_type("RequestQueued")[-1]["ran_ms"] == 8_000  # the run it keeps counts
    h.release(granted(h, "vip")["alloc_id"])
    second = granted(h, "liar")
    assert second["alloc_id"] != first["alloc_id"]
    # 3 s declared, 8 s used by the first grant: nothing left but the 10 s grace, not 3 s + 10 s again
    h.advance(9_900)
    assert not h.of_type("AllocationExpired")
    h.advance(200)
    [expired] = h.of_type("AllocationExpired")
    assert expired["alloc_id"] == second["alloc_id"] and expired["reason"] == "max_runtime_s exceeded over 2 grants"
    assert not expired["requeued"]
    assert [(c["status"], c["reason"]) for c in h.scheduler_commands][-1] == ("ended", expired["reason"])


def test_a_run_on_a_host_that_failed_does_not_count_against_the_jobs_runtime() -> None:
    h = harness(hosts=2, runtime_grace_s=10.0, grace_s=1.0)
    h.request("j", gpus=8, max_runtime_s=3, checkpoint=True)
    first = granted(h, "j")
    h.advance(8_000)
    h.heartbeat(first["hosts"][0]["node_id"], health="throttled")  # the host's own evidence: it slowed the job
    h.release(first["alloc_id"], "preempted", checkpoint_uri="/ckpt/j/1")
    assert h.of_type("RequestQueued")[-1]["ran_ms"] == 0
    second = granted(h, "j")
    h.advance(12_900)
    assert not h.of_type("AllocationExpired")  # a full 3 s + 10 s on the new host
    h.advance(200)
    assert h.of_type("AllocationExpired")[-1]["alloc_id"] == second["alloc_id"]


def test_a_job_past_its_runtime_when_moved_is_not_requeued() -> None:
    h = harness(hosts=1, runtime_grace_s=0.0, grace_s=30.0)
    h.request("liar", tenant="mallory", gpus=8, max_runtime_s=60, checkpoint=True)
    first = granted(h, "liar")
    h.advance(59_000)
    h.request("vip", tenant="acme", tier="enterprise", gpus=8)  # preempts it
    h.now_ms += 2_000  # its checkpointed stop reaches the allocator after its runtime, before the timer fired
    h.release(first["alloc_id"], "preempted", checkpoint_uri="/ckpt/liar/1")
    [released] = h.of_type("AllocationReleased")
    assert not released["requeued"] and "not requeued: max_runtime_s exceeded" in released["reason"]
    assert [g["job_id"] for g in h.of_type("AllocationGranted")] == ["liar", "vip"]
    assert [c["status"] for c in h.scheduler_commands if c["job_id"] == "liar"][-1] == "ended"
