"""PoolState: one pool's state as the fold sees it.

The store (through a PartitionTransaction) is the truth. For speed the fold
also keeps decoded views and derived indexes in memory: the capacity index,
per-tier tenant queues, tenant usage, the tier->hosts map used to find
preemption victims, and the due-timer heap. They are a cache with two rules:

* appliers are the only writers, and each applier changes the store record and
  its cached view together (``put_*`` below);
* the cache is rebuilt from the store whenever it may disagree with it: when a
  store is opened, after a command's writes were rolled back, and after the
  runner dropped an uncommitted transaction (``AllocatorFold.reload``).

Reads never go to the store in the hot path, and nothing here scans all hosts.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import Any

from sortedcontainers import SortedList

from dagfold.services.allocator import keys
from dagfold.services.allocator.capacity import CapacityIndex
from dagfold.services.allocator.model import AllocView, NodeView, RequestView
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.profile import (
    Class,
    Groups,
    empty_profile,
    gpu_per_cpu,
    group_classes,
    to_classes,
)
from dagfold.services.allocator.scoring import Scorer
from dagfold.state import PartitionTransaction, Store
from dagfold.tenants import Entitlements, type_quotas

NEVER = 1 << 62


def empty_meta() -> dict[str, Any]:
    return {"epoch": 0, "seq": 0, "reservations": {}}


class PoolState:
    """Transaction-backed state of one pool plus its in-memory indexes (see module docstring)."""

    def __init__(self, opts: AllocatorOptions) -> None:
        self.opts = opts
        self.txn: PartitionTransaction | None = None
        self._put: Callable[[bytes, Any], None] = self._unbound_put  # the bound transaction's put
        # tier -> rank (a function of the options only; unknown tiers are added when first seen)
        self.ranks: dict[str, int] = {t: self.rank_of_tier(t) for t in opts.tiers}
        self._clear()

    def _clear(self) -> None:
        self.meta: dict[str, Any] = empty_meta()
        self.profile: dict[str, Any] = empty_profile()
        self.classes: list[Class] = []
        self.groups: Groups = []
        self.weight_scale = 1  # the groups' integer weights are float weights times this (profile.group_classes)
        self.scorer: Scorer | None = None  # the groups as the scoring kernel's tables (a cache, built on first use)
        self.gpu_per_cpu = 0.0  # the learned mix's GPU milli per mCPU (profile.gpu_per_cpu)
        self.shape_counts: dict[str, int] = {}
        self.perf: dict[str, float] = {}
        self.rankings: dict[tuple[Any, ...], Any] = {}  # frag: part shape -> placement.Ranking (a cache)
        self.nodes: dict[str, NodeView] = {}
        self.allocs: dict[str, AllocView] = {}
        self.requests: dict[str, RequestView] = {}
        self.alloc_of_req: dict[str, str] = {}
        self.by_job: dict[str, set[str]] = {}  # job -> request keys (queued or allocated)
        self.capacity = CapacityIndex()
        # tier rank -> tenant -> [(seq, req key)], sorted (bisect: appends at the end, reads at the head)
        self.queues: dict[int, dict[str, list[tuple[int, str]]]] = {}
        self.queued_shapes: dict[int, dict[tuple[Any, ...], int]] = {}  # rank -> GPU shape -> queued requests
        self.shapes_version = 0  # bumped when a GPU shape appears in or leaves queued_shapes
        # rank -> ((capacity version, shapes version), the queued GPU shapes the capacity index does not rule out)
        self.feasible_memo: dict[int, tuple[tuple[int, int], set[tuple[Any, ...]]]] = {}
        self.usage: dict[tuple[str, str], int] = {}  # (tier, tenant) -> milli
        self.tenant_usage: dict[str, int] = {}  # tenant -> milli, all tiers (quotas)
        self.tier_nodes: dict[int, dict[str, int]] = {}  # rank -> host -> allocations of that rank
        self.tier_hosts: dict[int, SortedList] = {}  # rank -> the hosts of tier_nodes[rank], sorted (victim scan)
        self.timers: dict[tuple[str, str], int] = {}
        self.timer_heap: list[tuple[int, str, str]] = []
        self.gpu_types: dict[str, int] = {}  # registered type -> max GPUs on one host
        self.type_sizes: dict[str, dict[int, int]] = {}  # registered type -> {GPUs on a host: hosts}
        self.type_gpus: dict[str, int] = {}  # registered type -> GPUs (any state)
        self.max_cpu = 0
        self.max_mem = 0
        # up hosts by the time all their allocations will have ended (runtime limits): reservations of whole hosts
        self.free_at: SortedList = SortedList()
        self.free_at_of: dict[str, int] = {}
        # Tenant entitlements folded from the log ({ent, file} per tenant; they replace the options' settings of
        # that tenant), their decoded form, and what derives from them, memoised per tenant until they change
        self.tenant_settings: dict[str, dict[str, Any]] = {}
        self.ents: dict[str, Entitlements] = {}
        self._weights: dict[str, float] = {}  # tenant -> weight
        self._type_quotas: dict[str, dict[str, int]] = {}  # tenant -> GPU type -> milli
        self.has_quotas = bool(self.opts.tenant_quota_gpus or self.opts.tenant_type_quota_gpus)
        self.type_usage: dict[tuple[str, str], int] = {}  # (tenant, GPU type) -> milli in use (per-type quotas)

    # -- transaction ------------------------------------------------------------
    def bind(self, txn: PartitionTransaction) -> None:
        if txn is not self.txn:
            self.txn = txn
            self._put = txn.put

    def unbind(self) -> None:
        """Forget the transaction (it was dropped): writes fail until the next ``bind``."""
        self.txn = None
        self._put = self._unbound_put

    def _unbound_put(self, key: bytes, value: Any) -> None:
        raise AssertionError("PoolState used outside a transaction")

    # -- records ----------------------------------------------------------------
    def put_meta(self) -> None:
        """Write a fresh copy: a value handed to the transaction is never mutated afterwards
        (its rollback keeps references to old values)."""
        m = self.meta
        self._put(keys.META, {"epoch": m["epoch"], "seq": m["seq"],
                              "reservations": {t: dict(v) for t, v in m["reservations"].items()}})

    def count_shape(self, key: str, n: int, active: list[Any] | None) -> None:
        """One more request of shape ``key`` (None: not counted); a new ``active`` list replaces the classes."""
        if key:
            c = self.shape_counts.get(key, 0) + 1
            self.shape_counts[key] = c
            self._put(keys.shape(key), c)
        if active is not None:
            self.profile = {"n": n, "active": active}
            self.classes = to_classes(active)
            self.regroup()
        else:
            self.profile = {"n": n, "active": self.profile["active"]}
        self._put(keys.PROFILE, self.profile)

    def put_node(self, n: NodeView, *, capacity_changed: bool = True) -> None:
        """Write a node and re-bucket it in the capacity index (unless only its lease or health changed)."""
        self.nodes[n.id] = n
        self._put(keys.node(n.id), n.record())
        if capacity_changed:
            self.capacity.update(n)
            self.refresh_free_at(n)

    def put_ckpt(self, a: AllocView) -> None:
        self._put(keys.ckpt(a.id), [a.last_ckpt_ms, a.last_ckpt_uri])

    def put_perf(self, gpu_type: str, value: float) -> None:
        """The fleet average of a GPU type; written only when it changed (a steady fleet's heartbeats leave the
        average as it is, and a write that changes nothing is a put and an encode per heartbeat)."""
        if self.perf.get(gpu_type) == value:
            return
        self.perf[gpu_type] = value
        self._put(keys.perf(gpu_type), value)

    def refresh_free_at(self, n: NodeView) -> None:
        old = self.free_at_of.pop(n.id, None)
        if old is not None:
            self.free_at.remove((old, n.id))
        if n.state != "up":
            return
        grace = int(self.opts.runtime_grace_s * 1000)
        t = 0
        for aid in n.allocs:
            end = self.allocs[aid].end_by_ms(grace)
            if end is None:
                t = NEVER
                break
            t = max(t, end)
        self.free_at_of[n.id] = t
        self.free_at.add((t, n.id))

    def put_alloc(self, a: AllocView) -> None:
        self.allocs[a.id] = a
        self._put(keys.alloc(a.id), a.record())

    def drop_alloc(self, a: AllocView) -> None:
        if a.last_ckpt_ms is not None:
            self._put(keys.ckpt(a.id), None)
        self.allocs.pop(a.id, None)
        self.alloc_of_req.pop(a.req.key, None)
        self._unlink_job(a.req.job_id, a.req.key)
        self._put(keys.alloc(a.id), None)

    def put_request(self, r: RequestView) -> None:
        """Queue (or re-queue) a request."""
        self.requests[r.key] = r
        self._put(keys.request(r.key), r.record())
        self._enqueue(r)
        self.by_job.setdefault(r.job_id, set()).add(r.key)

    def drop_request(self, r: RequestView, *, keep_job_link: bool = False) -> None:
        self.requests.pop(r.key, None)
        self._put(keys.request(r.key), None)
        rank = self.rank(r.tier)
        q = self.queues.get(rank, {}).get(r.tenant)
        item = (r.seq, r.key)
        i = -1 if q is None else bisect_left(q, item)
        if q is not None and i < len(q) and q[i] == item:
            del q[i]
            if not q:
                del self.queues[rank][r.tenant]
            shapes = self.queued_shapes[rank]
            gs = r.gpu_shape
            c = shapes[gs] - 1
            if c:
                shapes[gs] = c
            else:
                del shapes[gs]
                self.shapes_version += 1
        if not keep_job_link:
            self._unlink_job(r.job_id, r.key)

    def add_usage(self, tier: str, tenant: str, milli: int) -> None:
        k = (tier, tenant)
        v = self.usage.get(k, 0) + milli
        self.usage[k] = v
        self.tenant_usage[tenant] = self.tenant_usage.get(tenant, 0) + milli
        self._put(keys.usage(tier, tenant), v if v else None)
        if not v:
            del self.usage[k]

    def set_timer(self, kind: str, target: str, due: int | None) -> None:
        """Replace the (kind, target) timer; None clears it. The heap is cleaned lazily."""
        old = self.timers.pop((kind, target), None)
        if old is not None:
            self._put(keys.timer(old, kind, target), None)
        if due is not None:
            self.timers[(kind, target)] = due
            self._put(keys.timer(due, kind, target), 1)
            heapq.heappush(self.timer_heap, (due, kind, target))
            if len(self.timer_heap) > 2 * len(self.timers) + 64:
                # Live, the runtime scans the store's index and never pops this heap; each heartbeat
                # re-sets a lease timer, so rebuild it from the live timers (amortised O(1) per call).
                self.timer_heap = [(d, k, t) for (k, t), d in self.timers.items()]
                heapq.heapify(self.timer_heap)

    def put_tenant(self, tenant: str, stored: dict[str, Any]) -> None:
        """A tenant's entitlements as folded from the log (``{ent, file}``): its weight and quotas from now on."""
        self._set_tenant(tenant, stored)
        self._put(keys.tenant(tenant), stored)

    def _set_tenant(self, tenant: str, stored: dict[str, Any]) -> None:
        self.tenant_settings[tenant] = stored
        ent = self.ents[tenant] = Entitlements.from_record(stored["ent"])
        self._weights.pop(tenant, None)
        self._type_quotas.pop(tenant, None)
        self.has_quotas = self.has_quotas or bool(ent.gpu_quota)

    # -- derived indexes ----------------------------------------------------------
    def weight(self, tenant: str) -> float:
        """The tenant's fair-share weight: from the log's settings, else ``opts.weight``; memoised."""
        w = self._weights.get(tenant)
        if w is None:
            ent = self.ents.get(tenant)
            if ent is None:
                w = self.opts.weight(tenant)
            else:
                w = ent.weight if ent.weight is not None else self.opts.default_weight
            self._weights[tenant] = w
        return w

    def quota_milli(self, tenant: str) -> int | None:
        """The tenant's cap on GPU milli in use in this pool (None: none)."""
        ent = self.ents.get(tenant)
        if ent is None:
            return self.opts.quota_milli(tenant)
        q = ent.gpu_quota.get(self.opts.pool)
        return None if q is None else int(q * 1000)

    def type_quotas(self, tenant: str) -> dict[str, int]:
        """The tenant's caps on GPU milli in use per GPU type of this pool (``pool/type``), memoised."""
        q = self._type_quotas.get(tenant)
        if q is None:
            ent = self.ents.get(tenant)
            if ent is None:
                q = self.opts.type_quota_milli(tenant)
            else:
                pool = self.opts.pool
                q = {t: int(v * 1000) for t, v in type_quotas({tenant: ent}, pool).get(tenant, {}).items()}
            self._type_quotas[tenant] = q
        return q

    def _count_types(self, a: AllocView, sign: int) -> None:
        """Add (or take away) ``a``'s GPU milli per GPU type of its hosts to its tenant's ``type_usage``."""
        tenant = a.req.tenant
        for p in a.parts:
            n = self.nodes.get(p.node)
            if n is None or not p.gpus:
                continue
            k = (tenant, n.gpu_type)
            v = self.type_usage.get(k, 0) + sign * p.milli * len(p.gpus)
            if v:
                self.type_usage[k] = v
            else:
                self.type_usage.pop(k, None)

    def rank_of_tier(self, tier: str) -> int:
        known = self.opts.tier_rank(tier)
        return len(self.opts.tiers) if known is None else known

    def rank(self, tier: str) -> int:
        r = self.ranks.get(tier)
        if r is None:
            r = self.ranks[tier] = self.rank_of_tier(tier)
        return r

    def _enqueue(self, r: RequestView) -> None:
        rank = self.rank(r.tier)
        insort(self.queues.setdefault(rank, {}).setdefault(r.tenant, []), (r.seq, r.key))
        shapes = self.queued_shapes.setdefault(rank, {})
        gs = r.gpu_shape
        c = shapes.get(gs, 0)
        shapes[gs] = c + 1
        if not c:
            self.shapes_version += 1

    def _unlink_job(self, job_id: str, key: str) -> None:
        s = self.by_job.get(job_id)
        if s is not None:
            s.discard(key)
            if not s:
                del self.by_job[job_id]

    def link_alloc(self, a: AllocView) -> None:
        self.alloc_of_req[a.req.key] = a.id
        self._count_types(a, 1)
        self.by_job.setdefault(a.req.job_id, set()).add(a.req.key)
        rank = self.rank(a.req.tier)
        tn = self.tier_nodes.setdefault(rank, {})
        for p in a.parts:
            c = tn.get(p.node, 0)
            tn[p.node] = c + 1
            if not c:
                hosts = self.tier_hosts.get(rank)
                if hosts is None:
                    hosts = self.tier_hosts[rank] = SortedList()
                hosts.add(p.node)

    def unlink_alloc_nodes(self, a: AllocView) -> None:
        self._count_types(a, -1)
        rank = self.rank(a.req.tier)
        tn = self.tier_nodes.get(rank, {})
        for p in a.parts:
            c = tn.get(p.node, 0) - 1
            if c > 0:
                tn[p.node] = c
            elif tn.pop(p.node, None) is not None:
                self.tier_hosts[rank].remove(p.node)

    def regroup(self) -> None:
        """Recompute the scoring groups (new profile or new inventory); scores are recomputed lazily."""
        self.groups, self.weight_scale = group_classes(self.classes, self.type_gpus,
                                                       max(self.gpu_types.values(), default=8))
        self.gpu_per_cpu = gpu_per_cpu(self.classes)
        self.scorer = None
        self.rankings.clear()

    def register_type(self, n: NodeView, new: bool) -> None:
        bigger = n.gpus > max(self.gpu_types.values(), default=8)  # the weights' scale may have to shrink
        self.gpu_types[n.gpu_type] = max(self.gpu_types.get(n.gpu_type, 0), n.gpus)
        if new:
            self.type_gpus[n.gpu_type] = self.type_gpus.get(n.gpu_type, 0) + n.gpus
        if (new or bigger) and self.classes:
            self.regroup()
        self.max_cpu = max(self.max_cpu, n.cpu)
        self.max_mem = max(self.max_mem, n.mem)
        if new:
            sizes = self.type_sizes.setdefault(n.gpu_type, {})
            sizes[n.gpus] = sizes.get(n.gpus, 0) + 1

    def due_timers(self, now_ms: int) -> Iterator[tuple[int, str, str]]:
        """Pop every live timer due at or before ``now_ms`` (the caller folds a TimerFired for each)."""
        h = self.timer_heap
        while h and h[0][0] <= now_ms:
            due, kind, target = heapq.heappop(h)
            if self.timers.get((kind, target)) == due:
                yield due, kind, target

    def next_timer_ms(self) -> int | None:
        h = self.timer_heap
        while h and self.timers.get((h[0][1], h[0][2])) != h[0][0]:
            heapq.heappop(h)
        return h[0][0] if h else None

    # -- loading ------------------------------------------------------------------
    def load(self, store: Store, txn: PartitionTransaction | None = None) -> None:
        """Rebuild every view and index from the store (plus this transaction's writes, if given)."""
        self._clear()
        written = txn.written_keys() if txn is not None else set()

        def scan(prefix: bytes) -> Iterator[tuple[bytes, Any]]:
            end = keys.prefix_end(prefix)
            seen = set()
            for k, _ in store.range(prefix, end):
                seen.add(k)
            seen.update(k for k in written if prefix <= k < end)
            getter = txn if txn is not None else PartitionTransaction(store)
            for k in sorted(seen):
                v = getter.get(k)
                if v is not None:
                    yield k, v

        getter = txn if txn is not None else PartitionTransaction(store)
        self.meta = getter.get(keys.META) or empty_meta()
        self.profile = getter.get(keys.PROFILE) or empty_profile()
        self.classes = to_classes(self.profile["active"])
        for k, v in scan(keys.SHAPE_PREFIX):
            self.shape_counts[k[len(keys.SHAPE_PREFIX):].decode()] = v
        for k, v in scan(keys.NODE_PREFIX):
            n = NodeView.from_record(k[len(keys.NODE_PREFIX):].decode(), v)
            self.nodes[n.id] = n
            self.capacity.add(n)
            self.register_type(n, True)
        for k, v in scan(keys.ALLOC_PREFIX):
            a = AllocView.from_record(k[len(keys.ALLOC_PREFIX):].decode(), v)
            self.allocs[a.id] = a
            self.link_alloc(a)
        for k, v in scan(keys.CKPT_PREFIX):
            ca = self.allocs.get(k[len(keys.CKPT_PREFIX):].decode())
            if ca is not None:
                ca.last_ckpt_ms, ca.last_ckpt_uri = v[0], v[1]
        for k, v in scan(keys.PERF_PREFIX):
            self.perf[k[len(keys.PERF_PREFIX):].decode()] = v
        for k, v in scan(keys.TENANT_PREFIX):
            self._set_tenant(k[len(keys.TENANT_PREFIX):].decode(), v)
        for n in self.nodes.values():
            self.refresh_free_at(n)
        self.regroup()
        for k, v in scan(keys.REQ_PREFIX):
            r = RequestView(k[len(keys.REQ_PREFIX):].decode(), v)
            self.requests[r.key] = r
            self._enqueue(r)
            self.by_job.setdefault(r.job_id, set()).add(r.key)
        for k, v in scan(keys.USAGE_PREFIX):
            _, tier, tenant = k.decode().split(keys.S, 2)
            self.usage[(tier, tenant)] = v
            self.tenant_usage[tenant] = self.tenant_usage.get(tenant, 0) + v
        for k, _ in scan(keys.TIMER_PREFIX):
            due, kind, target = keys.parse_timer(k)
            self.timers[(kind, target)] = due
            self.timer_heap.append((due, kind, target))
        heapq.heapify(self.timer_heap)
