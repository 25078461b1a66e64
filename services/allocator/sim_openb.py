"""``dagfold sim openb``: a time-ordered replay of the openb trace through the allocator fold.

Each pod requests its GPUs (fractional, typed), CPU and memory at its creation
time and holds them, once granted, for its traced lifetime (deletion minus
scheduled time; deletion minus creation for pods the trace never scheduled).
Lifetimes double as declared ``max_runtime_s`` (perfect estimates), so backfill
reservations can be computed. Tiers follow the pods' QoS: Guaranteed ->
enterprise, LS and Burstable -> standard, BE -> free; the tenant is the QoS
class. The trace has no checkpoints, so preemption is off in this replay, and
it records no node faults, so nodes hold a lease longer than the trace and
send no heartbeats.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.allocator.options import AllocatorOptions
from services.allocator.sim_core import Job, World, pct
from services.allocator.traces import load_nodes, load_pods

QOS_TIER = {"Guaranteed": "enterprise", "LS": "standard", "Burstable": "standard", "BE": "free"}


def openb_options(policy: str) -> AllocatorOptions:
    base = AllocatorOptions(pool="openb", lease_s=10.0 ** 9, preempt_after_s={})
    if policy == "ours":
        return base
    if policy == "bestfit":
        return replace(base, placement="bestfit")
    if policy == "fifo":
        return replace(base, placement="firstfit", backfill=False, preemption=False, fair_share=False,
                       strict_tiers=False)
    raise ValueError(f"unknown policy {policy!r}")


def run_openb(data: Path, policy: str = "ours", trace: str = "default") -> dict[str, Any]:
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    nodes = load_nodes(data)
    pods = load_pods(data, trace)
    w = World(openb_options(policy), hb_ms=10 ** 15)
    for n in nodes:
        w.register(n.name, n.model, n.gpus, n.cpu_milli, n.memory_mib)
    cap = sum(n.gpus for n in nodes) * 1000
    end_s = max((p.deletion_s or 0) for p in pods)
    jobs: list[Job] = []
    for i, p in enumerate(pods):
        if p.creation_s is None:
            continue
        life = max(1, (p.deletion_s or end_s) - p.creation_s)
        j = Job(f"p{i}", p.qos or "none", QOS_TIER.get(p.qos, "standard"), p.num_gpu, 1, life * 1000,
                float(life), False, p.creation_s * 1000, milli=p.gpu_milli if p.num_gpu else 1000,
                cpu=p.cpu_milli, mem=p.memory_mib, gpu_types=p.gpu_spec)
        jobs.append(j)
        w.at(j.submit_ms, "submit", j)
    day = 86_400_000
    w.run(end_s * 1000, {"submit": w.submit, "finish": w.finish, "ckpt_release": w.ckpt_release},
          sample_ms=day // 4)
    wall = time.perf_counter() - t0
    waits = [((j.first_grant_ms if j.first_grant_ms >= 0 else end_s * 1000) - j.submit_ms) / 1000 for j in jobs
             if j.end_ms < 0 or j.first_grant_ms >= 0]
    rejected = [j for j in jobs if j.first_grant_ms < 0 and j.end_ms >= 0]
    jct = [(j.end_ms - j.submit_ms) / 1000 for j in jobs if j.end_ms >= 0 and j.first_grant_ms >= 0]
    gpu_jobs = [j for j in jobs if j.gpus > 0]
    gwaits = [((j.first_grant_ms if j.first_grant_ms >= 0 else end_s * 1000) - j.submit_ms) / 1000
              for j in gpu_jobs if j.first_grant_ms >= 0 or j.end_ms < 0]
    util = [(t / day, round(u, 4)) for t, u in w.samples]
    lat = sorted(w.pass_cpu)
    return {
        "policy": policy, "trace": trace, "pods": len(jobs), "gpus": cap // 1000,
        "rejected_pods": len(rejected), "never_started": sum(1 for j in jobs if j.first_grant_ms < 0) - len(rejected),
        "utilization_mean": round(sum(u for _, u in util) / max(1, len(util)), 4),
        "utilization_over_time": [[round(d, 2), u] for d, u in util],
        "queue_delay_p50_s": pct(waits, 50), "queue_delay_p99_s": pct(waits, 99),
        "queue_delay_mean_s": round(sum(waits) / max(1, len(waits)), 1),
        "gpu_pod_queue_delay_p99_s": pct(gwaits, 99),
        "queued_at_all": sum(1 for x in waits if x > 0),
        "jct_p50_s": pct(jct, 50), "jct_p99_s": pct(jct, 99),
        "decision_p50_ms": round(lat[len(lat) // 2] * 1000, 4) if lat else None,
        "decision_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 4) if lat else None,
        "wall_s": round(wall, 2), "cpu_s": round(time.process_time() - cpu0, 2),
    }
