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
from pathlib import Path
from typing import Any

from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.sim_core import Job, World, pct, with_policy
from dagfold.services.allocator.traces import load_nodes, load_pods

QOS_TIER = {"Guaranteed": "enterprise", "LS": "standard", "Burstable": "standard", "BE": "free"}


def openb_options(policy: str) -> AllocatorOptions:
    return with_policy(AllocatorOptions(pool="openb", lease_s=10.0 ** 9, preempt_after_s={},
                                        notify_scheduler=False), policy)


def run_openb(data: Path, policy: str = "ours", trace: str = "default", limit: int | None = None,
              time_scale: float = 1.0) -> dict[str, Any]:
    """Replay; ``time_scale`` > 1 compresses the arrival times (not the lifetimes) to raise the load."""
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    nodes = load_nodes(data)
    pods = load_pods(data, trace)
    if limit is not None:  # the first pods by creation time (tests)
        pods = sorted(pods, key=lambda p: (p.creation_s or 0, p.name))[:limit]
    w = World(openb_options(policy), hb_ms=10 ** 15)
    for n in nodes:
        w.register(n.name, n.model, n.gpus, n.cpu_milli, n.memory_mib)
    cap = sum(n.gpus for n in nodes) * 1000
    end_s = max((p.deletion_s or 0) for p in pods)
    c0 = min((p.creation_s for p in pods if p.creation_s is not None), default=0)
    jobs: list[Job] = []
    for i, p in enumerate(pods):
        if p.creation_s is None:
            continue
        life = max(1, (p.deletion_s or end_s) - p.creation_s)
        submit_s = c0 + (p.creation_s - c0) / time_scale
        j = Job(f"p{i}", p.qos or "none", QOS_TIER.get(p.qos, "standard"), p.num_gpu, 1, life * 1000,
                float(life), False, int(submit_s * 1000), milli=p.gpu_milli if p.num_gpu else 1000,
                cpu=p.cpu_milli, mem=p.memory_mib, gpu_types=p.gpu_spec)
        jobs.append(j)
        w.at(j.submit_ms, "submit", j)
    day = 86_400_000
    end_s = int(max(j.submit_ms + j.work_ms for j in jobs) / 1000) + 1 if time_scale != 1.0 else end_s
    w.run(end_s * 1000, {"submit": w.submit, "finish": w.finish, "ckpt_release": w.ckpt_release},
          sample_ms=max(60_000, int(day // 4 / time_scale)))
    wall = time.perf_counter() - t0
    waits = [((j.first_grant_ms if j.first_grant_ms >= 0 else end_s * 1000) - j.submit_ms) / 1000 for j in jobs
             if j.end_ms < 0 or j.first_grant_ms >= 0]
    rejected = [j for j in jobs if j.first_grant_ms < 0 and j.end_ms >= 0]
    jct = [(j.end_ms - j.submit_ms) / 1000 for j in jobs if j.end_ms >= 0 and j.first_grant_ms >= 0]
    gpu_jobs = [j for j in jobs if j.gpus > 0]
    gwaits = [((j.first_grant_ms if j.first_grant_ms >= 0 else end_s * 1000) - j.submit_ms) / 1000
              for j in gpu_jobs if j.first_grant_ms >= 0 or j.end_ms < 0]
    util = [(t / day, round(u, 4)) for t, u in w.samples]
    starts = sorted(j.submit_ms for j in jobs)
    win0 = starts[len(starts) // 100] / day  # the busy window: 1st to 99th percentile of pod creations
    win1 = starts[len(starts) * 99 // 100] / day
    busy = [u for d, u in util if win0 <= d <= win1]
    lat = sorted(w.pass_cpu)
    return {
        "policy": policy, "trace": trace, "time_scale": time_scale, "pods": len(jobs), "gpus": cap // 1000,
        "rejected_pods": len(rejected), "never_started": sum(1 for j in jobs if j.first_grant_ms < 0) - len(rejected),
        "window_start_day": round(win0, 2), "window_end_day": round(win1, 2), "end_day": round(end_s / 86400, 2),
        "utilization_mean": round(sum(busy) / max(1, len(busy)), 4),
        "utilization_max": max(busy, default=0.0), "utilization_final": util[-1][1] if util else None,
        "utilization_over_time": [[round(d, 2), u] for d, u in util if win0 - 1 <= d <= win1 + 1],
        "queue_delay_p50_s": pct(waits, 50), "queue_delay_p99_s": pct(waits, 99),
        "queue_delay_mean_s": round(sum(waits) / max(1, len(waits)), 1),
        "gpu_pod_queue_delay_p99_s": pct(gwaits, 99),
        "queued_at_all": sum(1 for x in waits if x > 0),
        "jct_p50_s": pct(jct, 50), "jct_p99_s": pct(jct, 99),
        "decision_p50_ms": round(lat[len(lat) // 2] * 1000, 4) if lat else None,
        "decision_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 4) if lat else None,
        "wall_s": round(wall, 2), "cpu_s": round(time.process_time() - cpu0, 2),
    }
