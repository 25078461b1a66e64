"""Admission control: per-tenant token bucket and open-jobs cap (429 + Retry-After); a flood from one
tenant does not slow the API for the others."""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from dagfold.services.api.admission import Admission, AdmissionConfig, TokenBucket
from dagfold.services.api.auth import AuthConfig, TenantLimits
from tests.api_support import ApiHarness, LiveServer, accepted


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == 0.5  # one token every 0.5 s
    assert b.take(0.25) == 0.25
    assert b.take(0.5) == 0.0
    assert b.take(10.0) == 0.0 and b.tokens == 2.0  # refilled to the burst, minus the one taken


def test_rate_limit_429_with_retry_after(tmp_path: Path) -> None:
    a = ApiHarness(tmp_path, admission=AdmissionConfig(rate_per_s=0.5, burst=2, max_open_jobs=100))
    try:
        spec = {"tenant": "acme", "tasks": [{"id": "a"}]}
        assert [a.client.post("/v1/jobs", json=spec).status_code for _ in range(2)] == [202, 202]
        r = a.client.post("/v1/jobs", json=spec)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert r.headers["retry-after"] == "2" and "anonymous" in r.json()["error"]["reason"]
        # the open API's caller is one identity: naming another tenant does not give it a new bucket
        # (tenants' own buckets are shown with keys: test_flood_from_one_tenant_does_not_slow_the_others)
        assert a.client.post("/v1/jobs", json={**spec, "tenant": "beta"}).status_code == 429
        assert len(a.commands()) == 2
        assert 'dagfold_api_admission_rejections_total{reason="rate_limited"}' in a.client.get("/metrics").text
    finally:
        a.close()


def _acme_capped(tmp_path: Path, cap: int) -> ApiHarness:
    """An API whose tenant acme may have ``cap`` open jobs (50 for the others), rates out of the way."""
    limits = {"acme": TenantLimits(max_open_jobs=cap)}
    return ApiHarness(tmp_path, admission=AdmissionConfig(rate_per_s=1000, burst=1000, max_open_jobs=50,
                                                          tenants=limits))


def test_open_jobs_cap(tmp_path: Path) -> None:
    a = _acme_capped(tmp_path, 3)
    try:
        a.project(accepted("old-1", ["a"]), accepted("old-2", ["a"]))  # two running jobs of acme
        assert a.client.post("/v1/jobs", json={"tenant": "acme", "tasks": [{"id": "a"}]}).status_code == 202
        # the third is still in flight (not projected): it counts, so the fourth is refused
        r = a.client.post("/v1/jobs", json={"tenant": "acme", "tasks": [{"id": "a"}]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_queued_jobs"
        assert r.headers["retry-after"] == "5" and "limit is 3" in r.json()["error"]["reason"]
        assert a.client.post("/v1/jobs", json={"tenant": "beta", "tasks": [{"id": "a"}]}).status_code == 202
        # a job finishing frees a slot
        a.accept_submitted()
        from tests.api_support import ev

        a.project(ev("JobSucceeded", job_id="old-1", ts_ms=1))
        assert a.client.post("/v1/jobs", json={"tenant": "acme", "tasks": [{"id": "a"}]}).status_code == 202
    finally:
        a.close()


def test_a_paused_job_still_counts_against_the_open_jobs_cap(tmp_path: Path) -> None:
    """Pausing is not finishing: a tenant that pauses its jobs cannot queue more than its cap."""
    from tests.api_support import ev

    a = _acme_capped(tmp_path, 2)
    try:
        a.project(accepted("p-1", ["a"]), accepted("p-2", ["a"]))
        a.project(ev("JobPaused", job_id="p-1", ts_ms=1), ev("JobPaused", job_id="p-2", ts_ms=1))
        r = a.client.post("/v1/jobs", json={"tenant": "acme", "tasks": [{"id": "a"}]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_queued_jobs", r.text
        r = a.client.get("/v1/tenants")
        assert r.status_code == 200, r.text
        [acme] = [t for t in r.json()["tenants"] if t["tenant"] == "acme"]
        assert acme["open_jobs"] == 2 and acme["jobs"]["paused"] == 2, acme
    finally:
        a.close()


def test_in_flight_submissions_expire(tmp_path: Path) -> None:
    clock = [0.0]
    adm = Admission(AdmissionConfig(max_open_jobs=2), open_jobs=lambda t: 0, job_known=lambda j: False,
                    clock=lambda: clock[0])
    adm.submitted("acme", "j1")
    adm.submitted("acme", "j2")
    try:
        adm.check_open_jobs("acme")
        raise AssertionError("expected 429")
    except Exception as exc:
        assert getattr(exc, "status_code", None) == 429
    clock[0] = 61.0
    adm.check_open_jobs("acme")  # entries older than a minute no longer count


def _flood(url: str, seconds: float, out: Any) -> None:
    """One flooding process: 4 threads posting as fast as they can; puts its status-code counts on ``out``."""
    codes: dict[int, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k-flood-0000001",
                                                 "content-type": "application/json"}) as c:
            while time.monotonic() < deadline:
                code = c.post("/v1/jobs", content=SPEC).status_code
                with lock:
                    codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(codes)


SPEC = b'{"tasks": [{"id": "a"}, {"id": "b", "depends_on": ["a"]}]}'


def test_flood_from_one_tenant_does_not_slow_the_others(tmp_path: Path) -> None:
    """Tenant 'flood' hammers the API from another process; tenant 'calm' keeps its latency and gets 202s."""
    keys = {"k-flood-0000001": "flood", "k-calm-00000001": "calm"}
    auth = AuthConfig.from_env(None, env={"DAGFOLD_API_KEYS": ",".join(f"{k}:{t}" for k, t in keys.items())})
    a = ApiHarness(tmp_path, auth=auth, admission=AdmissionConfig(rate_per_s=5, burst=5, max_open_jobs=10_000))
    ctx = multiprocessing.get_context("spawn")
    try:
        with LiveServer(a.app) as srv:
            def calm_latencies(n: int) -> list[float]:
                out = []
                with httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer k-calm-00000001",
                                                             "content-type": "application/json"}) as c:
                    for _ in range(n):
                        t = time.perf_counter()
                        r = c.post("/v1/jobs", content=SPEC)
                        out.append(time.perf_counter() - t)
                        assert r.status_code == 202, r.text
                        time.sleep(0.21)  # within calm's 5/s
                return out

            baseline = calm_latencies(5)
            results = ctx.Queue()
            flood_s = 3.0
            proc = ctx.Process(target=_flood, args=(srv.url, flood_s, results))
            proc.start()
            time.sleep(0.8)  # the flood is under way (process start-up included)
            during = calm_latencies(8)
            codes = results.get(timeout=30)
            proc.join(10)
    finally:
        a.close()
    flood_total = sum(codes.values())
    assert flood_total > 100, codes  # it really was a flood
    assert codes.get(202, 0) <= 5 + 5 * flood_s + 2, codes  # burst + rate x time, no more
    assert codes.get(429, 0) > 0.8 * flood_total, codes
    # calm: every request admitted, and not slowed beyond noise on a shared 2-core machine
    assert statistics.median(during) < statistics.median(baseline) + 0.1, (baseline, during)
    assert max(during) < 1.0, during
