"""Knobs of the allocator fold, frozen: a process builds them once and passes them down.

Policies are options of one core, not forks of the code: the simulator's
baselines (FIFO without backfill, best-fit) are the same fold with other values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dagfold.tenants import Entitlements, pool_quotas, type_quotas, weights

PLACEMENTS = ("frag", "bestfit", "firstfit")
HEALTH_OK = "ok"
DRAIN_HEALTH = frozenset({"throttled", "ecc_errors", "xid", "slow"})
STICKY_HEALTH = frozenset({"ecc_errors", "xid"})  # hardware errors: drained until the node re-registers


@dataclass(frozen=True)
class AllocatorOptions:
    """Everything that changes a decision of the allocator fold."""

    pool: str = "default"
    # Priority tiers, highest first. strict_tiers=False puts every request in one queue (FIFO baseline).
    tiers: tuple[str, ...] = ("enterprise", "standard", "free")
    strict_tiers: bool = True
    # Weighted DRF within a tier; GPU is the dominant resource. Unknown tenants get default_weight.
    fair_share: bool = True
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    # Optional per-tenant cap on GPUs in use (whole GPUs; shared GPUs count their fraction), and per GPU type
    # (tenant -> type -> GPUs). Settings folded from the log (SetTenantEntitlements) replace a tenant's.
    tenant_quota_gpus: Mapping[str, float] = field(default_factory=dict)
    tenant_type_quota_gpus: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    placement: str = "frag"  # frag | bestfit | firstfit
    # frag: small best-fit term that breaks near-ties towards packing. FGD protocol, seed 42, 0.01 -> 0.001:
    # default 4.59 -> 4.33% unallocated (0.1: 4.99%, 0.0001: 4.37%), multigpu50 2.78 -> 2.81%, gpuspec33
    # 5.24 -> 5.75% (its target is 7%; the default trace's is the tightest)
    frag_pack_weight: float = 0.001
    # frag: weight of the change in a host's GPU milli that its free CPU cannot serve at the learned mix's
    # CPU per GPU (profile.stranded). FGD protocol, seeds 42-51, 0 -> 4: multigpu50 2.81 -> 2.45% unallocated,
    # default 4.34 -> 4.17%, gpuspec33 5.58 -> 5.36% (docs/gpu-scheduling.md §7.1, fifth pass)
    frag_balance_weight: float = 4.0
    # frag: weight of the change in the expected idle milli of the GPU that takes a share (profile.remainder_waste).
    # FGD protocol, seeds 42-51, 0 -> 20: default 4.17 -> 3.90% unallocated, multigpu50 2.45 -> 2.32%,
    # gpuspec33 5.36 -> 5.44% (docs/gpu-scheduling.md §7.1, fifth pass; 100: default erratic, 4.06% stdev 0.29)
    frag_remainder_weight: float = 20.0
    backfill: bool = True
    preemption: bool = True
    # Tiers that may preempt lower tiers, and after how long a wait (seconds). Others never preempt.
    preempt_after_s: Mapping[str, float] = field(default_factory=lambda: {"enterprise": 0.0, "standard": 600.0})
    # Leases: allocations live as long as their node's lease, renewed by node heartbeats.
    lease_s: float = 30.0
    # A heartbeat that brings nothing new (same health, cordoned GPUs and checkpoints, perf near the fleet
    # average, node up) is recorded only when it moves the lease deadline by at least this much (None:
    # lease_s / 4, Kubernetes' node-lease ratio). Hosts heartbeat far more often than their lease needs;
    # unrecorded heartbeats write no event and no state, so a node is declared lost between
    # lease_s - renew and lease_s after its last heartbeat.
    lease_renew_s: float | None = None
    # perf further than this fraction from its GPU type's average is always recorded (it moves the average)
    perf_record_tolerance: float = 0.05
    grace_s: float = 30.0  # preemption and drain: checkpoint request -> forced stop
    runtime_grace_s: float = 60.0  # an allocation is stopped at max_runtime_s + this
    # An allocation its first host's heartbeats do not list this long after the grant is requeued
    # (dispatch lost, process never started); None: never.
    orphan_grace_s: float | None = 60.0
    reject_unfittable: bool = True  # RequestRejected when no registered node could ever hold it
    # Bounded work per decision (Slurm's bf_max_job_test idea): p99 decision time stays flat.
    pass_budget: int = 32  # placement attempts per scheduling pass
    pass_examine_limit: int = 40  # queued requests a pass looks at (placed, skipped or failed)
    arrival_examine_limit: int = 16  # the same after an arrival alone (no capacity was freed)
    tenant_lookahead: int = 8  # queued requests per tenant a pass may look past a blocked one
    reservation_scan_limit: int = 32  # partly free hosts examined for a reservation (plus the free-at index)
    preempt_scan_limit: int = 64  # hosts examined to find preemption victims
    # Learned request-shape distribution (frag placement).
    profile_refresh: int = 1024  # recompute class weights every N requests (after 16, 64, 256)
    profile_max_classes: int = 128
    # A refresh replaces the classes only if their weights moved by at least this total variation distance:
    # each replacement re-scores every signature for every shape (placement's rankings), and once the mix
    # is learned the refreshes only chase sampling noise (FGD protocol, default trace, seed 42: 0.16 between
    # the profiles at 1,024 and 256 requests, 0.012 between 8,192 and 7,168). Seed 42, 0.05 -> 0.1:
    # default 4.40 -> 4.38% unallocated (0, every refresh: 4.43%), multigpu50 2.81 -> 2.80%, gpuspec33
    # 5.76 -> 5.67%; decision p99 CPU 2.5 -> 2.3, 2.1 -> 1.7, 5.1 -> 4.5 ms (machine at load 45-55)
    profile_drift: float = 0.1
    profile_max_keys: int = 4096
    # Write TaskAllocation commands for the scheduler (grants, requeues, rejections, expiries). The
    # simulator, which has no scheduler, turns it off.
    notify_scheduler: bool = True
    # Gray failures.
    undrain_ok_heartbeats: int = 3  # a throttled/slow node returns after N healthy heartbeats
    slow_perf_ratio: float = 0.5  # perf below this fraction of the fleet average drains the node
    # Jobs' paces (AllocationStatus.pace: progress against the runtime each job declared) find a host slow
    # only when jobs of this many tenants on it go below the ratio: one tenant's declaration is a claim
    # about its own job, never a verdict on the host its neighbours share (docs/gpu-scheduling.md).
    slow_min_tenants: int = 2

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {self.placement!r}")
        if not self.tiers:
            raise ValueError("at least one tier is needed")

    def lease_renew_ms(self) -> int:
        return int((self.lease_s / 4 if self.lease_renew_s is None else self.lease_renew_s) * 1000)

    def tier_rank(self, tier: str) -> int | None:
        """0 for the highest tier; None for an unknown tier. All 0 when tiers are not strict."""
        try:
            r = self.tiers.index(tier)
        except ValueError:
            return None
        return r if self.strict_tiers else 0

    def weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, self.default_weight))

    def quota_milli(self, tenant: str) -> int | None:
        q = self.tenant_quota_gpus.get(tenant)
        return None if q is None else int(q * 1000)

    def type_quota_milli(self, tenant: str) -> dict[str, int]:
        return {t: int(q * 1000) for t, q in self.tenant_type_quota_gpus.get(tenant, {}).items()}


def options_for_pool(pool: str, tenants: Mapping[str, Entitlements], **knobs: Any) -> AllocatorOptions:
    """The options of ``pool``'s allocator with the tenants' fair-share weights and the pool's GPU quotas
    (per pool and per ``pool/type``).

    ``dagfold up --gpu-nodes`` and ``dagfold allocator`` build them from the auth file's ``tenants:``
    (the same settings the API and the scheduler enforce): the settings at start. The API also writes
    them, and every admin change, through the log (``SetTenantEntitlements`` on ``allocator.commands``),
    and what the fold folded from the log replaces a tenant's settings here (``PoolState.weight``).
    """
    return AllocatorOptions(pool=pool, tenant_weights=weights(tenants), tenant_quota_gpus=pool_quotas(tenants, pool),
                            tenant_type_quota_gpus=type_quotas(tenants, pool), **knobs)
