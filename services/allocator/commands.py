"""Builders of allocator commands (plain dicts with every schema field).

One place to construct commands keeps the agent, the simulator, the harness
and the scheduler integration consistent with ``schemas/dagfold.allocator.*``;
a test encodes each with the codec to prove it. They skip ``codec.make`` on
purpose: the simulator builds hundreds of thousands of them.
"""

from __future__ import annotations

from typing import Any

from dagfold.codec import Record

C = "dagfold.allocator."


def register_node(pool: str, node_id: str, gpu_type: str, gpus: int, *, cpu_milli: int = 0, memory_mib: int = 0,
                  incarnation: int = 1, ts_ms: int = 0) -> Record:
    return {"type": C + "RegisterNode", "pool": pool, "node_id": node_id, "gpu_type": gpu_type, "gpus": gpus,
            "cpu_milli": cpu_milli, "memory_mib": memory_mib, "incarnation": incarnation, "ts_ms": ts_ms}


def alloc_status(alloc_id: str, epoch: int, *, progress: float | None = None, last_checkpoint_ms: int | None = None,
                 checkpoint_uri: str | None = None, pace: float | None = None) -> Record:
    rec: Record = {"alloc_id": alloc_id, "epoch": epoch, "progress": progress, "last_checkpoint_ms": last_checkpoint_ms,
           "checkpoint_uri": checkpoint_uri}
    if pace is not None:  # absent: the record as before paces (the simulator's heartbeats, pinned digests)
        rec["pace"] = pace
    return rec


def node_heartbeat(pool: str, node_id: str, *, incarnation: int = 1, ts_ms: int = 0, health: str = "ok",
                   detail: str | None = None, perf: float | None = None, temperature_c: float | None = None,
                   ecc_errors: int = 0, xid_errors: int = 0, throttle_events: int = 0,
                   allocations: list[Record] | None = None, gpus: list[Record] | None = None) -> Record:
    return {"type": C + "NodeHeartbeat", "pool": pool, "node_id": node_id, "incarnation": incarnation,
            "ts_ms": ts_ms, "health": health, "detail": detail, "perf": perf, "temperature_c": temperature_c,
            "ecc_errors": ecc_errors, "xid_errors": xid_errors, "throttle_events": throttle_events,
            "allocations": allocations or [], "gpus": gpus or []}


def gpu_status(index: int, *, health: str = "ok", detail: str | None = None, utilization: float | None = None,
               memory_used_mib: int | None = None, memory_total_mib: int | None = None,
               temperature_c: float | None = None, throttle_reasons: int = 0, ecc_errors: int = 0,
               xid_errors: int = 0, last_xid: int | None = None) -> Record:
    """One GPU's entry of a NodeHeartbeat (``dagfold.allocator.GpuStatus``)."""
    return {"index": index, "health": health, "detail": detail, "utilization": utilization,
            "memory_used_mib": memory_used_mib, "memory_total_mib": memory_total_mib,
            "temperature_c": temperature_c, "throttle_reasons": throttle_reasons, "ecc_errors": ecc_errors,
            "xid_errors": xid_errors, "last_xid": last_xid}


def request_allocation(pool: str, job_id: str, task_id: str = "gpu", attempt: int = 1, *, tenant: str = "default",
                       tier: str = "standard", gpus: int = 1, gpu_type: list[str] | None = None, hosts: int = 1,
                       gpu_milli: int = 1000, cpu_milli: int = 0, memory_mib: int = 0,
                       max_runtime_s: float | None = None, checkpoint: bool = False, submitted_ms: int = 0,
                       wait: bool = True, resume_checkpoint: str | None = None) -> Record:
    return {"type": C + "RequestAllocation", "pool": pool, "job_id": job_id, "task_id": task_id,
            "attempt": attempt, "tenant": tenant, "tier": tier, "gpus": gpus, "gpu_type": list(gpu_type or []),
            "hosts": hosts, "gpu_milli": gpu_milli, "cpu_milli": cpu_milli, "memory_mib": memory_mib,
            "max_runtime_s": max_runtime_s, "checkpoint": checkpoint, "submitted_ms": submitted_ms, "wait": wait,
            "resume_checkpoint": resume_checkpoint}


def from_resources(pool: str, job_id: str, task_id: str, attempt: int, tenant: str, tier: str,
                   resources: dict[str, Any], submitted_ms: int) -> Record:
    """The request for a task whose JobSpec carries ``resources`` (dagfold.common.Resources)."""
    return request_allocation(pool, job_id, task_id, attempt, tenant=tenant, tier=tier, gpus=resources["gpus"],
                              gpu_type=list(resources.get("gpu_type") or []), hosts=resources.get("hosts", 1),
                              gpu_milli=resources.get("gpu_milli", 1000),
                              max_runtime_s=resources.get("max_runtime_s"),
                              checkpoint=bool(resources.get("checkpoint")), submitted_ms=submitted_ms)


def release_allocation(pool: str, alloc_id: str, epoch: int, node_id: str, reason: str = "completed", *,
                       exit_code: int | None = None, checkpoint_uri: str | None = None, ts_ms: int = 0) -> Record:
    return {"type": C + "ReleaseAllocation", "pool": pool, "alloc_id": alloc_id, "epoch": epoch,
            "node_id": node_id, "reason": reason, "exit_code": exit_code, "checkpoint_uri": checkpoint_uri,
            "ts_ms": ts_ms}


def cancel_request(pool: str, job_id: str, task_id: str | None = None, reason: str = "cancelled",
                   ts_ms: int = 0, attempt: int | None = None) -> Record:
    return {"type": C + "CancelRequest", "pool": pool, "job_id": job_id, "task_id": task_id, "attempt": attempt,
            "reason": reason, "ts_ms": ts_ms}
