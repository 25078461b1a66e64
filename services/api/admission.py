"""Admission control of submissions: a token bucket and a cap on open jobs, per tenant.

Why in the API: a flood must be refused before it costs the scheduler
anything, and cheaply enough (no body parsing when the key names the tenant)
that the other tenants' requests are not slowed. A refusal is 429 with
``Retry-After`` (seconds until a token, or a fixed pause for the cap).

The cap counts a tenant's jobs that are not finished in the read model plus
the submissions this API sent that the projector has not shown yet, so a
burst faster than the projection cannot overshoot it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dagfold import metrics
from dagfold.services.api.errors import ApiError
from dagfold.tenants import Entitlements

MAX_BUCKETS = 10_000
CALLER_PREFIX = "\0caller:"  # bucket keys of callers; a tenant name cannot contain NUL
IN_FLIGHT_TTL_S = 60.0
CAP_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class AdmissionConfig:
    """Defaults for every tenant; ``tenants`` overrides them one by one."""

    rate_per_s: float = 20.0
    burst: int = 50
    max_open_jobs: int = 10_000
    tenants: Mapping[str, Entitlements] | None = None

    @classmethod
    def from_env(cls, tenants: Mapping[str, Entitlements] | None = None) -> AdmissionConfig:
        env = os.environ
        return cls(rate_per_s=float(env.get("DAGFOLD_SUBMIT_RATE", cls.rate_per_s)),
                   burst=int(env.get("DAGFOLD_SUBMIT_BURST", cls.burst)),
                   max_open_jobs=int(env.get("DAGFOLD_MAX_OPEN_JOBS", cls.max_open_jobs)),
                   tenants=tenants)

    def limits(self, tenant: str) -> tuple[float, int, int]:
        t = (self.tenants or {}).get(tenant) or Entitlements()
        return (self.rate_per_s if t.rate_per_s is None else t.rate_per_s,
                self.burst if t.burst is None else t.burst,
                self.max_open_jobs if t.max_open_jobs is None else t.max_open_jobs)


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = max(burst, 1)
        self.tokens = float(self.burst)
        self.at = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 if granted, else seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate if self.rate > 0 else 3600.0


class Admission:
    """Per-tenant rate limit and open-jobs cap; thread-safe."""

    def __init__(self, config: AdmissionConfig, open_jobs: Callable[[str], int],
                 job_known: Callable[[str], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._open_jobs = open_jobs
        self._job_known = job_known
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._in_flight: dict[str, dict[str, float]] = {}

    def check_rate(self, tenant: str, caller: str | None = None) -> None:
        """Take a submission token of ``tenant`` or raise 429.

        ``caller``: an unauthenticated caller (the open API), who may name any tenant: it takes a token
        of its own bucket first (the default limits), so naming a new tenant per request gains nothing.
        """
        if caller is not None:
            self._take(CALLER_PREFIX + caller, self.config.rate_per_s, self.config.burst, f"caller {caller!r}")
        rate, burst, _ = self.config.limits(tenant)
        self._take(tenant, rate, burst, f"tenant {tenant!r}")

    def _take(self, key: str, rate: float, burst: int, who: str) -> None:
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(rate, burst, now)
                if len(self._buckets) > MAX_BUCKETS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
            wait = bucket.take(now)
        if wait > 0:
            metrics.API_ADMISSION_REJECTIONS.labels("rate_limited").inc()
            raise ApiError(429, "rate_limited",
                           f"{who} exceeds {rate:g} submissions/s (burst {burst}); retry in {wait:.2f}s",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def _pending(self, tenant: str, now: float) -> int:
        """Submissions sent but not yet in the read model (expired after a minute)."""
        sent = self._in_flight.get(tenant)
        if not sent:
            return 0
        for job_id, at in list(sent.items()):
            if now - at > IN_FLIGHT_TTL_S or self._job_known(job_id):
                del sent[job_id]
        return len(sent)

    def check_open_jobs(self, tenant: str) -> None:
        """Raise 429 if ``tenant`` already has its cap of unfinished jobs."""
        _, _, cap = self.config.limits(tenant)
        now = self._clock()
        with self._lock:
            pending = self._pending(tenant, now)
        open_jobs = self._open_jobs(tenant) + pending
        if open_jobs >= cap:
            metrics.API_ADMISSION_REJECTIONS.labels("too_many_queued_jobs").inc()
            raise ApiError(429, "too_many_queued_jobs",
                           f"tenant {tenant!r} has {open_jobs} unfinished jobs, the limit is {cap}; "
                           "retry when some finish", headers={"Retry-After": str(CAP_RETRY_AFTER_S)})

    def submitted(self, tenant: str, job_id: str) -> None:
        with self._lock:
            self._in_flight.setdefault(tenant, {})[job_id] = self._clock()
