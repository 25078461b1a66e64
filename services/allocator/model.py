"""Typed views of the pool's records: nodes, allocations, requests.

The store holds plain dicts (msgpack); the fold works on these views, which the
in-memory index keeps decoded. ``record()`` gives the exact dict written to
the store, always built field by field in the same order, so that a state
rebuilt by replaying events encodes to the same bytes as the live one.
"""

from __future__ import annotations

from typing import Any

FULL = 1000  # milli of one whole GPU


class NodeView:
    """One GPU host: inventory, free capacity per GPU, lease and health."""

    __slots__ = ("allocs", "cordoned", "cpu", "cpu_free", "draining_reason", "free", "gpu_type", "health", "id",
                 "incarnation", "lease_until", "mem", "mem_free", "ok_streak", "state")

    def __init__(self, node_id: str, gpu_type: str, gpus: int, cpu: int, mem: int, incarnation: int,
                 lease_until: int) -> None:
        self.id = node_id
        self.gpu_type = gpu_type
        self.free: list[int] = [FULL] * gpus
        self.cpu = cpu
        self.mem = mem
        self.cpu_free = cpu
        self.mem_free = mem
        self.incarnation = incarnation
        self.lease_until = lease_until
        self.state = "up"  # up | draining | lost
        self.draining_reason: str | None = None
        self.health = "ok"
        self.ok_streak = 0
        self.allocs: list[str] = []
        # GPUs reported unhealthy one by one: each holds FULL less in ``free`` (at most 0, so nothing is
        # ever placed on it, and grants/releases on it keep adding up); the node's other GPUs serve on
        self.cordoned: list[int] = []

    @property
    def gpus(self) -> int:
        return len(self.free)

    def full_gpus(self) -> int:
        return sum(1 for f in self.free if f == FULL)

    def free_milli(self) -> int:
        return sum(self.free)

    def record(self) -> dict[str, Any]:
        return {"gpu_type": self.gpu_type, "free": list(self.free), "cpu": self.cpu, "mem": self.mem,
                "cpu_free": self.cpu_free, "mem_free": self.mem_free, "incarnation": self.incarnation,
                "lease_until": self.lease_until, "state": self.state, "reason": self.draining_reason,
                "health": self.health, "ok_streak": self.ok_streak, "allocs": list(self.allocs),
                "cordoned": list(self.cordoned)}

    @classmethod
    def from_record(cls, node_id: str, r: dict[str, Any]) -> NodeView:
        n = cls(node_id, r["gpu_type"], 0, r["cpu"], r["mem"], r["incarnation"], r["lease_until"])
        n.free = list(r["free"])
        n.cpu_free, n.mem_free = r["cpu_free"], r["mem_free"]
        n.state, n.draining_reason, n.health, n.ok_streak = r["state"], r["reason"], r["health"], r["ok_streak"]
        n.allocs = list(r["allocs"])
        n.cordoned = list(r.get("cordoned", []))
        return n


class Part:
    """The share of one host in an allocation: GPU indices and milli per GPU."""

    __slots__ = ("gpus", "milli", "node")

    def __init__(self, node: str, gpus: list[int], milli: int) -> None:
        self.node = node
        self.gpus = gpus
        self.milli = milli

    def record(self) -> dict[str, Any]:
        return {"node_id": self.node, "gpu_indices": list(self.gpus), "gpu_milli": self.milli}


class RequestView:
    """A request for a gang: ``hosts`` hosts, each with ``gpus`` GPUs (or a ``milli`` share of one)."""

    __slots__ = ("attempt", "checkpoint", "cpu", "gpu_shape", "gpu_types", "gpus", "grants", "hosts",
                 "job_id", "key", "max_runtime_ms", "mem", "milli", "queued_ms", "ran_ms", "resume", "seq", "shape",
                 "submitted_ms", "task_id", "tenant", "tier", "total_milli")

    def __init__(self, key: str, r: dict[str, Any]) -> None:
        self.key = key
        self.job_id: str = r["job_id"]
        self.task_id: str = r["task_id"]
        self.attempt: int = r["attempt"]
        self.tenant: str = r["tenant"]
        self.tier: str = r["tier"]
        self.gpus: int = r["gpus"]
        self.gpu_types: tuple[str, ...] = tuple(dict.fromkeys(r["gpu_type"]))  # a set, in order (openb has "a|b|b")
        self.hosts: int = r["hosts"]
        self.milli: int = r["gpu_milli"]
        self.cpu: int = r["cpu_milli"]
        self.mem: int = r["memory_mib"]
        self.max_runtime_ms: int | None = r["max_runtime_ms"]
        self.checkpoint: bool = r["checkpoint"]
        self.submitted_ms: int = r["submitted_ms"]
        self.seq: int = r["seq"]
        self.queued_ms: int = r["queued_ms"]
        self.resume: str | None = r["resume"]
        self.grants: int = r["grants"]
        # time its earlier allocations held GPUs: max_runtime_ms counts across grants (runtime_budget_ms)
        self.ran_ms: int = r.get("ran_ms", 0)
        # The shape never changes, so what derives from it is computed once, here.
        per_gpu = self.milli if self.gpus == 1 else FULL
        # GPU milli the whole gang holds: the DRF and quota currency
        self.total_milli = self.hosts * self.gpus * per_gpu
        # requests with equal shapes fit or fail alike (placement depends on nothing else)
        self.shape: tuple[Any, ...] = (self.gpu_types, self.gpus, self.milli, self.hosts, self.cpu, self.mem)
        # the GPU part of the shape: what the capacity index can rule out without looking at hosts
        self.gpu_shape: tuple[tuple[str, ...], int, int, int] = (self.gpu_types, self.gpus, per_gpu, self.hosts)

    def per_gpu_milli(self) -> int:
        return self.milli if self.gpus == 1 else FULL

    def runtime_left_ms(self, runtime_grace_ms: int) -> int | None:
        """How long its next allocation may hold GPUs: the declared ``max_runtime_ms`` plus the grace,
        once, less what its earlier allocations held (None: unbounded). A limit per grant restarted
        with every requeue, so a job slower than it declared, moved by drains, never stopped."""
        if self.max_runtime_ms is None:
            return None
        return max(0, self.max_runtime_ms - self.ran_ms) + runtime_grace_ms

    def record(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "task_id": self.task_id, "attempt": self.attempt, "tenant": self.tenant,
                "tier": self.tier, "gpus": self.gpus, "gpu_type": list(self.gpu_types), "hosts": self.hosts,
                "gpu_milli": self.milli, "cpu_milli": self.cpu, "memory_mib": self.mem,
                "max_runtime_ms": self.max_runtime_ms, "checkpoint": self.checkpoint,
                "submitted_ms": self.submitted_ms, "seq": self.seq, "queued_ms": self.queued_ms,
                "resume": self.resume, "grants": self.grants, **({"ran_ms": self.ran_ms} if self.ran_ms else {})}


class AllocView:
    """A granted gang: its request, its parts on hosts, its epoch and its checkpoint state."""

    __slots__ = ("epoch", "granted_ms", "id", "last_ckpt_ms", "last_ckpt_uri", "parts", "preempt_deadline",
                 "preempt_reason", "req", "state")

    def __init__(self, alloc_id: str, req: RequestView, parts: list[Part], epoch: int, granted_ms: int) -> None:
        self.id = alloc_id
        self.req = req
        self.parts = parts
        self.epoch = epoch
        self.granted_ms = granted_ms
        self.state = "running"  # running | preempting
        self.preempt_deadline: int | None = None
        self.preempt_reason: str | None = None
        self.last_ckpt_ms: int | None = None  # stored apart, under keys.ckpt (heartbeats update it often)
        self.last_ckpt_uri: str | None = req.resume

    def end_by_ms(self, runtime_grace_ms: int) -> int | None:
        """Latest time this allocation can still hold its GPUs (None: unbounded)."""
        if self.preempt_deadline is not None:
            return self.preempt_deadline
        left = self.req.runtime_left_ms(runtime_grace_ms)
        return None if left is None else self.granted_ms + left

    def record(self) -> dict[str, Any]:
        return {"req_key": self.req.key, "req": self.req.record(), "parts": [p.record() for p in self.parts],
                "epoch": self.epoch, "granted_ms": self.granted_ms, "state": self.state,
                "preempt_deadline": self.preempt_deadline, "preempt_reason": self.preempt_reason}

    @classmethod
    def from_record(cls, alloc_id: str, r: dict[str, Any]) -> AllocView:
        req = RequestView(r["req_key"], r["req"])
        parts = [Part(p["node_id"], list(p["gpu_indices"]), p["gpu_milli"]) for p in r["parts"]]
        a = cls(alloc_id, req, parts, r["epoch"], r["granted_ms"])
        a.state, a.preempt_deadline, a.preempt_reason = r["state"], r["preempt_deadline"], r["preempt_reason"]
        return a
