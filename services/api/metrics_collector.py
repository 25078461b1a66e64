"""Gauges computed from the read models at scrape time.

Why not gauges set by the projector: these are functions of the projected
state, so reading them at scrape time makes them right after a restart, equal
to what the API shows, and free when nobody scrapes. Each collect() reads a few
small key ranges (tenant usage, queue counters, cluster totals) and the due
part of the deadline index, never all tasks.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dagfold.clock import now_ms
from dagfold.projections.cluster import ClusterModel
from dagfold.projections.operator import QUEUE_STATES, OperatorModel

STUCK_SCAN_LIMIT = 1000
STUCK_GRACE_MS = 5000


class ReadModelCollector(Collector):
    def __init__(self, ops: OperatorModel, cluster: ClusterModel) -> None:
        self.ops = ops
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        tasks = GaugeMetricFamily("dagfold_tasks", "Tasks by state, from the read model.", labels=["state"])
        jobs = GaugeMetricFamily("dagfold_jobs", "Jobs by state, from the read model.", labels=["state"])
        t_tasks = GaugeMetricFamily("dagfold_tenant_tasks", "Tasks by tenant and state.", labels=["tenant", "state"])
        t_jobs = GaugeMetricFamily("dagfold_tenant_jobs", "Jobs by tenant and state.", labels=["tenant", "state"])
        totals: dict[str, dict[str, int]] = {"tasks": {}, "jobs": {}}
        for u in self.ops.tenants():
            for state, n in u["tasks"].items():
                t_tasks.add_metric([u["tenant"], state], n)
                totals["tasks"][state] = totals["tasks"].get(state, 0) + n
            for state, n in u["jobs"].items():
                t_jobs.add_metric([u["tenant"], state], n)
                totals["jobs"][state] = totals["jobs"].get(state, 0) + n
        for state, n in totals["tasks"].items():
            tasks.add_metric([state], n)
        for state, n in totals["jobs"].items():
            jobs.add_metric([state], n)
        yield from (tasks, jobs, t_tasks, t_jobs)

        depth = GaugeMetricFamily("dagfold_queue_depth", "Runnable tasks waiting in a dispatch queue.",
                                  labels=["queue"])
        qtasks = GaugeMetricFamily("dagfold_queue_tasks", "Open tasks of a queue by state.", labels=["queue", "state"])
        age = GaugeMetricFamily("dagfold_queue_oldest_runnable_age_seconds",
                                "Wait of the longest-waiting runnable task of a queue.", labels=["queue"])
        now = now_ms()
        for q in self.ops.queues():
            depth.add_metric([q["queue"]], q["runnable"])
            for s in QUEUE_STATES:
                qtasks.add_metric([q["queue"], s], q[s])
            oldest = self.ops.oldest_runnable_ms(q["queue"])
            age.add_metric([q["queue"]], max(now - oldest, 0) / 1000 if oldest is not None else 0.0)
        yield from (depth, qtasks, age)

        stuck = self.ops.stuck(now, grace_ms=STUCK_GRACE_MS, limit=STUCK_SCAN_LIMIT)
        sg = GaugeMetricFamily("dagfold_stuck_tasks", "Open tasks past a deadline (lease, start-to-close, "
                               f"schedule-to-start, backoff) by more than 5 s; capped at {STUCK_SCAN_LIMIT}.",
                               labels=["kind"])
        kinds: dict[str, int] = {}
        for item in stuck:
            kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
        for kind in ("lease", "start_to_close", "schedule_to_start", "backoff"):
            sg.add_metric([kind], kinds.get(kind, 0))
        yield sg

        tot = self.cluster.totals()
        if tot is None:
            return  # no allocator events: no GPU metrics rather than zeros that look like an empty cluster
        gpus = GaugeMetricFamily("dagfold_gpus", "GPUs in the cluster model by state.", labels=["state"])
        gpus.add_metric(["total"], tot["gpus"])
        gpus.add_metric(["healthy"], tot["healthy_gpus"])
        gpus.add_metric(["allocated"], tot["allocated"])
        yield gpus
        ratio = GaugeMetricFamily("dagfold_gpu_allocation_ratio", "Allocated GPUs over healthy GPUs.")
        ratio.add_metric([], tot["allocated"] / tot["healthy_gpus"] if tot["healthy_gpus"] else 0.0)
        yield ratio
        utils = [n["utilization"] for n in self.cluster.nodes(limit=1000).items if n.get("utilization") is not None]
        if utils:
            util = GaugeMetricFamily("dagfold_gpu_utilization_ratio",
                                     "Mean GPU utilisation reported by node agents (first 1000 nodes).")
            util.add_metric([], sum(utils) / len(utils))
            yield util
        tg = GaugeMetricFamily("dagfold_tenant_gpus", "GPUs allocated per tenant.", labels=["tenant"])
        for t in self.cluster.tenants():
            tg.add_metric([t["tenant"]], t["gpus"])
        yield tg
