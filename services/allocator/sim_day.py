"""``dagfold sim day``: a synthetic day on 8-GPU hosts.

Workload (seeded): Poisson arrivals over 24 h after a one-hour warm-up (jobs
of the warm-up fill the cluster and are not measured); tiers enterprise 15%,
standard 55%, free 30%; tenants per tier with equal weights; one standard
tenant ("flood") submits 5,000 jobs at once at 10:00; a small standard tenant
("small") submits about 180 small jobs through the day. Gangs: 1, 2, 4, 8 GPUs
on one host, 2x8 and 4x8 across hosts. Runtimes uniform in 2-45 min; declared
``max_runtime_s`` 1.1-1.6x the runtime (at most 45 min, at least the runtime).
85% of jobs checkpoint every 5 min and checkpoint within 10 s when asked.

Faults, scaled from Meta's Llama 3 report (419 unexpected interruptions in 54
days on 16,384 GPUs: ~4.7 per 10,000 GPUs per day, GPU and host failures
dominating): per 10,000 GPUs and day, 3 host crashes (no heartbeats; back
after 2 h), 2 ECC/Xid error bursts (drained until re-registered after 4 h),
2 thermal throttling episodes (half speed, 30 min) and 1 silently slow host
(30% speed, reported only through its throughput).
"""

from __future__ import annotations

import random
import time
from typing import Any

from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.sim_core import Job, World, pct, with_policy

H = 3_600_000
GANGS = ((1, 1, 0.25), (2, 1, 0.15), (4, 1, 0.15), (8, 1, 0.32), (8, 2, 0.10), (8, 4, 0.03))
TIERS = (("enterprise", 0.15, ("ent-a", "ent-b", "ent-c")),
         ("standard", 0.55, tuple(f"std-{i}" for i in range(1, 9))),
         ("free", 0.30, tuple(f"free-{i}" for i in range(1, 11))))


# Expected GPU-seconds of one job: mean GPUs of a gang (sum of gpus x hosts x share) times the mean runtime
# (uniform 120-2700 s). Offered load = jobs x this / (GPUs x 24 h); the 100k-job day on 10,000 GPUs offers 102%.
MEAN_JOB_GPUS = sum(g * h * p for g, h, p in GANGS)
MEAN_JOB_GPU_S = MEAN_JOB_GPUS * (120 + 2700) / 2
SWEEP_LOADS = (0.70, 0.85, 0.95, 1.10)


def jobs_for_load(load: float, gpus: int) -> int:
    """Measured jobs of a day that offers ``load`` times the GPU-seconds of ``gpus`` GPUs over 24 h (the
    warm-up hour comes at the same rate; the flood and the small tenant are part of the count)."""
    return max(100, round(load * gpus * 24 * 3600 / MEAN_JOB_GPU_S))


def offered_load(jobs: int, gpus: int) -> float:
    return jobs * MEAN_JOB_GPU_S / (gpus * 24 * 3600)


def day_options(policy: str) -> AllocatorOptions:
    return with_policy(AllocatorOptions(pool="day", lease_s=900.0, grace_s=30.0, notify_scheduler=False), policy)


def make_jobs(seed: int, n_jobs: int, gpus: int, flood: bool) -> list[Job]:
    rng = random.Random(seed)
    warm = int(n_jobs / 24)
    out: list[Job] = []

    def one(i: int, t: int, tier: str, tenant: str, small: bool = False) -> Job:
        if small:
            g, h = rng.choice(((1, 1), (2, 1)))
        else:
            x = rng.random()
            acc = 0.0
            g, h = 8, 1
            for gg, hh, p in GANGS:
                acc += p
                if x < acc:
                    g, h = gg, hh
                    break
        run_s = rng.uniform(120, 2700)
        mrt = min(2700.0, max(run_s, run_s * rng.uniform(1.1, 1.6)))
        return Job(f"j{i}", tenant, tier, g, h, int(run_s * 1000), round(mrt, 1), rng.random() < 0.85, t)

    total = n_jobs + warm
    rate = total / (25 * H)
    t = 0.0
    i = 0
    flood_n = round(0.05 * n_jobs) if flood else 0
    n_small = max(20, round(180 * n_jobs / 100000))
    regular = n_jobs - round(0.05 * n_jobs) - n_small
    regular_rate = rate * (warm + regular) / total
    while i < warm + regular:
        t += rng.expovariate(regular_rate)
        x = rng.random()
        acc = 0.0
        for tier, share, tenants in TIERS:
            acc += share
            if x < acc or tier == "free":
                j = one(i, int(t), tier, rng.choice(tenants))
                break
        out.append(j)
        i += 1
    # The sum of the exponential gaps overshoots the 25 simulated hours about half the time (its spread is
    # 25 h / sqrt(jobs)): jobs drawn after the end were never submitted and counted as "never started" (18
    # and 49 at 70% and 85% of 1,000 GPUs, the same under every policy). Scaling the arrival times onto the
    # day, with one mean gap left after the last, keeps the Poisson shape (arrivals given their count are
    # uniform over the window) and the job count.
    scale = 25 * H / (t + 1 / regular_rate) if out else 1.0
    for j in out:
        j.submit_ms = int(j.submit_ms * scale)
        j.measured = j.submit_ms >= H
    for k in range(n_small):
        out.append(one(i, int(H + (k + rng.random()) * 24 * H / n_small), "standard", "small", small=True))
        i += 1
    if flood:
        t0 = H + 10 * H
        for _ in range(flood_n):
            out.append(one(i, t0, "standard", "flood"))
            i += 1
    out.sort(key=lambda j: (j.submit_ms, j.id))
    # the flood RNG draws must not change the other jobs: regenerate flood-free runs with the same seed
    return out


def fault_plan(seed: int, hosts: int, gpus: int) -> list[tuple[int, str, str]]:
    rng = random.Random(seed + 1)
    scale = gpus / 10000
    plan = []
    for kind, per_day in (("crash", 3), ("ecc", 2), ("throttle", 2), ("slow", 1)):
        n = max(1, round(per_day * scale))
        for _ in range(n):
            plan.append((int(H + rng.uniform(0, 24 * H)), kind, f"h{rng.randrange(hosts):05d}"))
    return sorted(plan)


def run_day(gpus: int = 10000, jobs: int = 100000, seed: int = 42, policy: str = "ours", flood: bool = True,
            hb_s: float = 300.0) -> dict[str, Any]:
    hosts = gpus // 8
    opts = day_options(policy)
    w = World(opts, hb_ms=int(hb_s * 1000))
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    rng = random.Random(seed + 2)
    for k in range(hosts):
        w.register(f"h{k:05d}", "H100", 8)
    for k in range(hosts):
        w.at(int(rng.uniform(0, w.hb_ms)), "hb", f"h{k:05d}")
    workload = make_jobs(seed, jobs, gpus, flood)
    for j in workload:
        w.at(j.submit_ms, "submit", j)
    for t, kind, node in fault_plan(seed, hosts, gpus):
        w.at(t, "fault", (kind, node))
    faults: dict[str, int] = {}

    def fault(p: tuple[str, str]) -> None:
        kind, node = p
        faults[kind] = faults.get(kind, 0) + 1
        if kind == "crash":
            w.node_up[node] = False
            for aid in list(w.node_allocs.get(node, ())):
                j = w.alloc_job.get(aid)
                if j is not None:
                    j.token += 1  # its process died with the host: no exit report
            w.at(w.now() + 2 * H, "recover", node)
        elif kind == "ecc":
            w.node_health[node] = "ecc_errors"
            w.at(w.now() + 4 * H, "recover", node)
        elif kind == "throttle":
            w.node_health[node] = "throttled"
            w.set_speed(node, 0.5)
            w.at(w.now() + H // 2, "unthrottle", node)
        elif kind == "slow":
            w.node_perf[node] = 0.3
            w.set_speed(node, 0.3)
            w.at(w.now() + 4 * H, "recover", node)

    def recover(node: str) -> None:
        w.register(node, "H100", 8)
        w.at(w.now() + w.hb_ms, "hb", node)

    def unthrottle(node: str) -> None:
        w.node_health[node] = "ok"
        w.set_speed(node, 1.0)

    end = 25 * H
    w.run(end, {"submit": w.submit, "finish": w.finish, "ckpt_release": w.ckpt_release, "hb": w.heartbeat,
                "fault": fault, "recover": recover, "unthrottle": unthrottle}, sample_ms=300_000)
    wall = time.perf_counter() - t0
    return summarize(w, workload, gpus, policy, flood, wall, faults, cpu0)


def summarize(w: World, workload: list[Job], gpus: int, policy: str, flood: bool, wall: float,
              faults: dict[str, int], cpu0: float) -> dict[str, Any]:
    end = 25 * H
    meas = [j for j in workload if j.measured]
    waits: dict[str, list[float]] = {}
    for j in meas:
        wt = (j.first_grant_ms if j.first_grant_ms >= 0 else end) - j.submit_ms
        waits.setdefault(j.tier, []).append(wt / 1000)
    by_tenant: dict[str, list[float]] = {}
    for j in meas:
        wt = (j.first_grant_ms if j.first_grant_ms >= 0 else end) - j.submit_ms
        by_tenant.setdefault(j.tenant, []).append(wt / 1000)
    util = [u for t, u in w.samples if t >= H]
    lat = sorted(w.pass_lat)
    cpu = sorted(w.pass_cpu)
    done = [j for j in meas if j.end_ms >= 0 and j.first_grant_ms >= 0]
    jct = [(j.end_ms - j.submit_ms) / 1000 for j in done]
    jct_tier: dict[str, list[float]] = {}
    for j in done:
        jct_tier.setdefault(j.tier, []).append((j.end_ms - j.submit_ms) / 1000)
    return {
        "policy": policy, "flood": flood, "gpus": gpus, "hosts": gpus // 8, "jobs_measured": len(meas),
        # offered: the measured jobs' GPU time at nominal speed over the day's capacity (as drawn, not expected)
        "offered_load": round(sum(j.work_ms * j.gpus * j.hosts for j in meas) / (gpus * 24 * H), 4),
        "offered_load_nominal": round(offered_load(len(meas), gpus), 4),
        "jobs_warmup": len(workload) - len(meas), "jobs_completed": len(done),
        "jobs_never_started": sum(1 for j in meas if j.first_grant_ms < 0),
        "utilization": round(sum(util) / max(1, len(util)), 4),
        "utilization_over_time": [[round(t / H - 1, 3), round(u, 4)] for t, u in w.samples if t >= H],
        "wait_p50_s": {t: pct(v, 50) for t, v in sorted(waits.items())},
        "wait_p99_s": {t: pct(v, 99) for t, v in sorted(waits.items())},
        "jct_p50_s": pct(jct, 50), "jct_p99_s": pct(jct, 99),
        "jct_p50_s_by_tier": {t: pct(v, 50) for t, v in sorted(jct_tier.items())},
        "small_tenant_wait_p99_s": pct(by_tenant.get("small", []), 99),
        "small_tenant_wait_p50_s": pct(by_tenant.get("small", []), 50),
        "flood_tenant_wait_p50_s": pct(by_tenant.get("flood", []), 50),
        "jain_fairness": round(sum(w.jain) / len(w.jain), 4) if w.jain else None,
        "preemptions": sum(j.preempted for j in workload),
        "drain_moves": w.counts.get("PreemptionRequested", 0) - sum(j.preempted for j in workload),
        "lost_work_gpu_h": round(sum(j.lost_work_ms * j.gpus * j.hosts for j in workload) / H, 1),
        "reservations": w.counts.get("ReservationMade", 0),
        "reservation_wait_p50_s": pct(w.res_wait, 50), "reservation_wait_p99_s": pct(w.res_wait, 99),
        "faults": faults, "node_drains": w.counts.get("NodeDrained", 0),
        "allocation_expired": w.counts.get("AllocationExpired", 0),
        "events": dict(sorted(w.counts.items())),
        "commands": len(lat), "placement_attempts": w.attempts,
        "decisions_per_s": round(len(cpu) / w.fold_cpu_s, 1) if w.fold_cpu_s else None,
        "decision_p50_ms": round(cpu[len(cpu) // 2] * 1000, 4) if cpu else None,
        "decision_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1000, 4) if cpu else None,
        "decision_wall_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 4) if lat else None,
        "fold_s": round(w.fold_s, 2), "fold_cpu_s": round(w.fold_cpu_s, 2), "wall_s": round(wall, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
    }


def run_sweep(gpus: int = 2000, loads: tuple[float, ...] = SWEEP_LOADS, seed: int = 42,
              policies: tuple[str, ...] = ("ours", "fifo", "bestfit"), hb_s: float = 300.0,
              progress: Any = None) -> dict[str, Any]:
    """The synthetic day at several offered loads (fractions of capacity), every policy at each."""
    out: dict[str, Any] = {"gpus": gpus, "seed": seed, "mean_job_gpu_s": MEAN_JOB_GPU_S, "loads": {}}
    for load in loads:
        n = jobs_for_load(load, gpus)
        runs = {}
        for pol in policies:
            r = run_day(gpus, n, seed, pol, True, hb_s)
            r.pop("utilization_over_time", None)
            runs[pol] = r
            if progress:
                progress(f"sweep {load:.0%} ({n} jobs) {pol}: utilization {r['utilization']}, "
                         f"enterprise p99 wait {r['wait_p99_s'].get('enterprise')} s, wall {r['wall_s']} s")
        out["loads"][f"{load:.2f}"] = {"load": load, "jobs": n, "policies": runs}
    return out
