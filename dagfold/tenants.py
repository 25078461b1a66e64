"""Tenant entitlements: what a tenant may use (tiers, handlers) and how much (weight, quotas, rates).

One type for every place that needs them: the auth file and the admin API
write them, the API checks submissions and admission against them, the
scheduler's fold checks an upstream producer's SubmitJob against the copy it
folded from the log (``SetTenantEntitlements`` commands, one per partition),
and the GPU allocator takes the fair-share weights and GPU quotas.

Auth file section (every field optional)::

    tenants:
      acme:
        max_tier: standard            # highest priority tier (enterprise > standard > free)
        handlers: [noop, sleep, shell] # default: every handler but shell
        weight: 2                     # fair-share weight on the GPU pools (default 1)
        gpu_quota: {default: 16, default/h100: 8}   # GPUs in use, per pool or pool/type
        rate_per_s: 5                 # submissions per second (token bucket)
        burst: 10
        max_open_jobs: 100

A field left out means "no restriction" for tiers, quotas and limits (the
deployment's defaults apply to rates and the open-jobs cap) and "every
handler but the unsafe ones" for handlers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dagfold.rules import check_id

TIERS: tuple[str, ...] = ("enterprise", "standard", "free")
"""Priority tiers, highest first (the allocator's default order)."""

UNSAFE_HANDLERS = frozenset({"shell"})
"""Handlers that run code named by the job: never granted by default (see services.worker.capabilities)."""

_FIELDS = ("max_tier", "handlers", "weight", "gpu_quota", "rate_per_s", "burst", "max_open_jobs")


class EntitlementsError(ValueError):
    """A tenant's settings are malformed (the message names the field)."""


def tier_rank(tier: str) -> int | None:
    """0 for the highest tier, None for an unknown one."""
    try:
        return TIERS.index(tier)
    except ValueError:
        return None


@dataclass(frozen=True)
class Entitlements:
    """One tenant's settings; None/empty fields do not restrict."""

    max_tier: str | None = None
    handlers: tuple[str, ...] | None = None
    weight: float | None = None
    gpu_quota: Mapping[str, float] = field(default_factory=dict)
    rate_per_s: float | None = None
    burst: int | None = None
    max_open_jobs: int | None = None

    # -- decisions ------------------------------------------------------------
    def tier_refusal(self, tier: str) -> str | None:
        """Why this tenant may not submit at ``tier``; None if it may."""
        if self.max_tier is None:
            return None
        want, top = tier_rank(tier), tier_rank(self.max_tier)
        if want is None or top is None or want < top:
            return f"tier {tier!r} is above this tenant's highest tier {self.max_tier!r}"
        return None

    def may_use(self, handler: str) -> bool:
        if self.handlers is None:
            return handler not in UNSAFE_HANDLERS
        return handler in self.handlers

    def handler_refusal(self, handler: str) -> str | None:
        if self.may_use(handler):
            return None
        if self.handlers is None:
            return (f"handler {handler!r} runs commands from the job spec: it must be granted to the tenant "
                    "(handlers: [..., shell] in the auth file or the admin API)")
        return f"handler {handler!r} is not granted to this tenant (granted: {', '.join(self.handlers) or 'none'})"

    # -- records ----------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """The Avro ``dagfold.common.Entitlements`` record (also the JSON of the admin API)."""
        return {"max_tier": self.max_tier, "handlers": list(self.handlers) if self.handlers is not None else None,
                "weight": self.weight, "gpu_quota": dict(self.gpu_quota), "rate_per_s": self.rate_per_s,
                "burst": self.burst, "max_open_jobs": self.max_open_jobs}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Entitlements:
        """From a decoded record (trusted shape; ``parse`` checks untrusted input)."""
        h = rec.get("handlers")
        return cls(max_tier=rec.get("max_tier"), handlers=tuple(h) if h is not None else None,
                   weight=rec.get("weight"), gpu_quota=dict(rec.get("gpu_quota") or {}),
                   rate_per_s=rec.get("rate_per_s"), burst=rec.get("burst"), max_open_jobs=rec.get("max_open_jobs"))

    @classmethod
    def parse(cls, doc: Any, where: str = "tenant") -> Entitlements:
        """From untrusted input (auth file, admin API, a log record): EntitlementsError names the field."""
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise EntitlementsError(f"{where}: settings must be a mapping")
        unknown = sorted(set(map(str, doc)) - set(_FIELDS))
        if unknown:
            raise EntitlementsError(f"{where}: unknown setting {unknown[0]!r} (known: {', '.join(_FIELDS)})")
        tier = doc.get("max_tier")
        if tier is not None and tier not in TIERS:
            raise EntitlementsError(f"{where}: max_tier must be one of {', '.join(TIERS)}, got {tier!r}")
        handlers = doc.get("handlers")
        if handlers is not None:
            if not isinstance(handlers, list | tuple) or len(handlers) > 256:
                raise EntitlementsError(f"{where}: handlers must be a list of handler names")
            for h in handlers:
                bad = check_id("handler", h)
                if bad:
                    raise EntitlementsError(f"{where}: handlers: {bad}")
            handlers = tuple(dict.fromkeys(handlers))
        quota = doc.get("gpu_quota") or {}
        if not isinstance(quota, Mapping) or len(quota) > 1024:
            raise EntitlementsError(f"{where}: gpu_quota must map pool or pool/type to a number of GPUs")
        for k, v in quota.items():
            if not isinstance(k, str) or not k or k.count("/") > 1 or not _finite(v, 0):
                raise EntitlementsError(f"{where}: gpu_quota.{str(k)[:60]!r}: a number of GPUs >= 0 per pool "
                                        "or pool/type")
            pool, _, gtype = k.partition("/")
            bad = check_id("pool", pool) or (check_id("gpu_type", gtype) if "/" in k else None)
            if bad:
                raise EntitlementsError(f"{where}: gpu_quota: {bad}")
        weight = doc.get("weight")
        if weight is not None and not (_finite(weight, 0) and weight > 0):
            raise EntitlementsError(f"{where}: weight must be a finite number > 0")
        rate = doc.get("rate_per_s")
        if rate is not None and not _finite(rate, 0):
            raise EntitlementsError(f"{where}: rate_per_s must be a finite number >= 0")
        for name in ("burst", "max_open_jobs"):
            v = doc.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**31 - 1):
                raise EntitlementsError(f"{where}: {name} must be a whole number >= 0")
        return cls(max_tier=tier, handlers=handlers, weight=float(weight) if weight is not None else None,
                   gpu_quota={k: float(v) for k, v in quota.items()},
                   rate_per_s=float(rate) if rate is not None else None, burst=doc.get("burst"),
                   max_open_jobs=doc.get("max_open_jobs"))


def _finite(v: Any, low: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= low


DEFAULT = Entitlements()


def pool_quotas(tenants: Mapping[str, Entitlements], pool: str) -> dict[str, float]:
    """Per-tenant GPU quotas of ``pool`` (the ``pool`` entries; ``pool/type`` ones are per type)."""
    return {t: e.gpu_quota[pool] for t, e in tenants.items() if pool in e.gpu_quota}


def type_quotas(tenants: Mapping[str, Entitlements], pool: str) -> dict[str, dict[str, float]]:
    """Per-tenant, per-GPU-type quotas of ``pool`` (``pool/type`` entries)."""
    out: dict[str, dict[str, float]] = {}
    for t, e in tenants.items():
        for k, v in e.gpu_quota.items():
            p, sep, gtype = k.partition("/")
            if sep and p == pool:
                out.setdefault(t, {})[gtype] = v
    return out


def weights(tenants: Mapping[str, Entitlements]) -> dict[str, float]:
    return {t: e.weight for t, e in tenants.items() if e.weight is not None}


# -- settings folded from the log (the scheduler's partitions and the allocators' pools alike) -----------------

def entitlements_digest(rec: Mapping[str, Any]) -> str:
    """A stable digest of an Entitlements record (sorted JSON)."""
    return hashlib.sha256(json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def settings_unchanged(old: Mapping[str, Any] | None, rec: Mapping[str, Any], source: str) -> bool:
    """Whether a SetTenantEntitlements of ``rec`` from ``source`` changes nothing of the stored ``old``
    (``{ent, file}``, see ``stored_settings``). The auth file's settings, re-sent at every API start,
    change nothing when the file did not change: later admin changes stand."""
    if old is None:
        return False
    if source == "auth_file" and old.get("file") == entitlements_digest(rec):
        return True
    return bool(old["ent"] == rec and (source != "auth_file" or old.get("file") == entitlements_digest(rec)))


def stored_settings(old: Mapping[str, Any] | None, rec: Mapping[str, Any], source: str) -> dict[str, Any]:
    """What a TenantEntitlementsSet event stores: the settings, and the digest of the auth file's last ones."""
    file_digest = entitlements_digest(rec) if source == "auth_file" else (old or {}).get("file")
    return {"ent": rec, "file": file_digest}
