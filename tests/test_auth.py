"""API keys and tenant isolation: a tenant sees and acts on its own jobs only; another tenant's job is
indistinguishable from a missing one (same 404, byte for byte); admin keys see everything."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dagfold.services.api.auth import AuthConfig, AuthConfigError, Principal
from tests.api_support import T0, ApiHarness, accepted, ev, now_ms

ACME, BETA, ADMIN = "k-acme-0123456789", "k-beta-0123456789", "k-admin-0123456789"
H = {t: {"Authorization": f"Bearer {k}"} for t, k in (("acme", ACME), ("beta", BETA), ("admin", ADMIN))}


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    f = tmp_path / "auth.yaml"
    f.write_text(f"""
keys:
  {ACME}: acme
  {BETA}: beta
  {ADMIN}: admin
tenants:
  beta: {{rate_per_s: 100, burst: 100, max_open_jobs: 5}}
""")
    return f


@pytest.fixture
def api(tmp_path: Path, auth_file: Path) -> Iterator[ApiHarness]:
    a = ApiHarness(tmp_path, auth=AuthConfig.from_env(auth_file, env={}))
    now = now_ms()
    a.project(accepted("a-job", ["t1", "t2"], tenant="acme", ts=now - 60_000),
              accepted("b-job", ["t1"], tenant="beta", ts=now - 50_000),
              ev("TaskDispatched", job_id="b-job", task_id="t1", attempt=1, ts_ms=now - 40_000, queue="default"),
              ev("LeaseGranted", job_id="b-job", task_id="t1", attempt=1, worker_id="wb", ts_ms=now - 40_000,
                 lease_deadline_ms=now - 20_000),
              ev("TaskFailed", job_id="a-job", task_id="t2", attempt=1, worker_id="wa", ts_ms=now - 30_000,
                 reason="exit code 1", exit_code=1, final=True))
    yield a
    a.close()


def test_keys_required(api: ApiHarness) -> None:
    for path in ("/v1/jobs", "/v1/jobs/a-job", "/v1/stuck", "/v1/queues", "/v1/tenants", "/v1/cluster",
                 "/v1/failures", "/metrics"):
        r = api.client.get(path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
    assert api.client.post("/v1/jobs", json={"tasks": [{"id": "a"}]}).status_code == 401
    assert api.client.get("/v1/jobs", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
    assert api.client.get("/v1/jobs", headers={"Authorization": f"Basic {ACME}"}).status_code == 401
    assert api.client.get("/v1/jobs", headers={"X-API-Key": ACME}).status_code == 200
    assert api.client.get("/v1/jobs", headers=H["acme"]).status_code == 200
    # open: liveness, the dashboard's static files, the OpenAPI document
    for path in ("/healthz", "/ui/", "/ui/static/app.js", "/openapi.json", "/docs"):
        assert api.client.get(path).status_code == 200, path
    schemes = api.client.get("/openapi.json").json()["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}
    assert api.commands() == []


def test_tenant_cannot_see_or_act_on_another_tenants_job(api: ApiHarness) -> None:
    c = api.client
    for path in ("", "/tasks", "/tasks/t1", "/tasks/t1/attempts", "/attempts", "/history", "/graph",
                 "/events?timeout_s=0.2"):
        mine = c.get(f"/v1/jobs/b-job{path}", headers=H["beta"])
        assert mine.status_code == 200, (path, mine.text)
        theirs = c.get(f"/v1/jobs/b-job{path}", headers=H["acme"])
        missing = c.get(f"/v1/jobs/x-job{path}", headers=H["acme"])
        assert theirs.status_code == missing.status_code == 404, path
        assert theirs.content == missing.content.replace(b"x-job", b"b-job"), path  # indistinguishable
        assert theirs.headers.get("content-length") == missing.headers.get("content-length")
    for action in ("cancel", "redrive"):
        theirs = c.post(f"/v1/jobs/b-job/{action}", headers=H["acme"])
        missing = c.post(f"/v1/jobs/x-job/{action}", headers=H["acme"])
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"]["reason"] == missing.json()["error"]["reason"].replace("x-job", "b-job")
    assert api.commands() == []  # nothing was sent on acme's behalf
    assert c.post("/v1/jobs/b-job/cancel", headers=H["beta"]).status_code == 202


def test_listings_are_scoped(api: ApiHarness) -> None:
    c = api.client
    ids = lambda r: [j["job_id"] for j in r.json()["jobs"]]  # noqa: E731
    assert ids(c.get("/v1/jobs", headers=H["acme"])) == ["a-job"]
    assert ids(c.get("/v1/jobs", headers=H["beta"])) == ["b-job"]
    assert ids(c.get("/v1/jobs", headers=H["admin"])) == ["b-job", "a-job"]
    assert ids(c.get("/v1/jobs", params={"tenant": "acme"}, headers=H["admin"])) == ["a-job"]
    assert ids(c.get("/v1/jobs", params={"tenant": "acme"}, headers=H["acme"])) == ["a-job"]
    r = c.get("/v1/jobs", params={"tenant": "beta"}, headers=H["acme"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"

    assert [t["task_id"] for t in c.get("/v1/stuck", headers=H["beta"]).json()["tasks"]] == ["t1"]
    assert c.get("/v1/stuck", headers=H["acme"]).json()["tasks"] == []
    assert len(c.get("/v1/stuck", headers=H["admin"]).json()["tasks"]) == 1
    assert [t["tenant"] for t in c.get("/v1/tenants", headers=H["acme"]).json()["tenants"]] == ["acme"]
    assert [t["tenant"] for t in c.get("/v1/tenants", headers=H["admin"]).json()["tenants"]] == ["acme", "beta"]
    beta = c.get("/v1/tenants", headers=H["beta"]).json()["tenants"][0]
    assert beta["limits"] == {"rate_per_s": 100.0, "burst": 100, "max_open_jobs": 5}
    assert c.get("/v1/queues", headers=H["acme"]).json()["queues"] == []
    assert [q["running"] for q in c.get("/v1/queues", headers=H["beta"]).json()["queues"]] == [1]
    assert [r["last_job_id"] for r in c.get("/v1/failures", headers=H["acme"]).json()["reasons"]] == ["a-job"]
    assert c.get("/v1/failures", headers=H["beta"]).json() == {"reasons": [], "recent": []}
    assert c.get("/metrics", headers=H["acme"]).status_code == 403
    assert "dagfold_tasks" in c.get("/metrics", headers=H["admin"]).text


def test_cluster_nodes_hide_other_tenants(api: ApiHarness) -> None:
    a = "dagfold.allocator."
    api.allocator({"type": a + "NodeRegistered", "node_id": "h1", "gpus": 8, "health": "healthy"},
                  {"type": a + "AllocationGranted", "allocation_id": "x1", "job_id": "a-job", "tenant": "acme",
                   "placements": [{"node_id": "h1", "gpus": 2}]},
                  {"type": a + "AllocationGranted", "allocation_id": "x2", "job_id": "b-job", "tenant": "beta",
                   "placements": [{"node_id": "h1", "gpus": 4}]})
    node = api.client.get("/v1/cluster/nodes", headers=H["acme"]).json()["nodes"][0]
    assert node["tenants"] == {"acme": 2, "other": 4} and list(node["allocations"]) == ["x1"]
    assert "b-job" not in json.dumps(node) and "beta" not in json.dumps(node)
    assert [t["tenant"] for t in api.client.get("/v1/cluster", headers=H["acme"]).json()["tenants"]] == ["acme"]
    node = api.client.get("/v1/cluster/nodes", headers=H["admin"]).json()["nodes"][0]
    assert node["tenants"] == {"acme": 2, "beta": 4}


def test_submit_forces_the_keys_tenant(api: ApiHarness) -> None:
    c = api.client
    r = c.post("/v1/jobs", json={"tasks": [{"id": "a"}]}, headers=H["acme"])
    assert r.status_code == 202 and r.json()["tenant"] == "acme"
    r = c.post("/v1/jobs", json={"tenant": "acme", "tasks": [{"id": "a"}]}, headers=H["acme"])
    assert r.status_code == 202
    r = c.post("/v1/jobs", json={"tenant": "default", "tasks": [{"id": "a"}]}, headers=H["acme"])
    assert r.status_code == 202 and r.json()["tenant"] == "acme"  # the examples say "default"
    r = c.post("/v1/jobs", json={"tenant": "beta", "tasks": [{"id": "a"}]}, headers=H["acme"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_mismatch"
    assert [cmd["spec"]["tenant"] for cmd in api.commands()] == ["acme", "acme", "acme"]
    # same idempotency key, two tenants: two different jobs (IDs derive from tenant and key)
    ka = c.post("/v1/jobs", json={"idempotency_key": "k1", "tasks": [{"id": "a"}]}, headers=H["acme"]).json()
    kb = c.post("/v1/jobs", json={"idempotency_key": "k1", "tasks": [{"id": "a"}]}, headers=H["beta"]).json()
    assert ka["job_id"] != kb["job_id"]
    # a tenant re-using another tenant's explicit job ID hears it at once (409), never 202 and then 404 forever
    r = c.post("/v1/jobs", json={"id": "b-job", "tasks": [{"id": "zz"}]}, headers=H["acme"])
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_id_taken"
    admin = c.post("/v1/jobs", json={"tenant": "beta", "tasks": [{"id": "a"}]}, headers=H["admin"])
    assert admin.status_code == 202 and admin.json()["tenant"] == "beta"


def test_auth_config_sources(tmp_path: Path) -> None:
    assert not AuthConfig.from_env(None, env={}).enabled
    conf = AuthConfig.from_env(None, env={"DAGFOLD_API_KEYS": "key-one-123:acme, key-two-123:admin"})
    assert conf.lookup("key-one-123") == Principal("acme", "acme")
    assert conf.lookup("key-two-123") == Principal("admin", None, admin=True)
    assert conf.lookup("key-one-12") is None
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"key-three-12": {"tenant": "admin"}, "key-four-123": {"role": "admin"}}))
    conf = AuthConfig.from_env(j, env={})
    assert conf.lookup("key-three-12") == Principal("admin", "admin")  # a tenant named admin
    p = conf.lookup("key-four-123")
    assert p is not None and p.admin
    for bad in ("keys: [1, 2]", "short: acme", "keys: {key-five-1234: {}}", "{not yaml", "tenants: 3\nkeys: {}"):
        f = tmp_path / "bad.yaml"
        f.write_text(bad)
        with pytest.raises(AuthConfigError):
            AuthConfig.from_env(f, env={})
    with pytest.raises(AuthConfigError):
        AuthConfig.from_env(tmp_path / "missing.yaml", env={})
    with pytest.raises(AuthConfigError):
        AuthConfig.from_env(None, env={"DAGFOLD_API_KEYS": "no-colon-here"})


def test_open_api_without_keys(tmp_path: Path) -> None:
    a = ApiHarness(tmp_path)
    try:
        a.project(accepted("j", ["a"], tenant="acme", ts=T0))
        assert a.client.get("/v1/jobs/j").status_code == 200
        assert a.client.get("/metrics").status_code == 200
        r = a.client.post("/v1/jobs", json={"tenant": "anyone", "tasks": [{"id": "a"}]})
        assert r.status_code == 202 and r.json()["tenant"] == "anyone"
    finally:
        a.close()


def test_sse_needs_the_key(api: ApiHarness) -> None:
    assert api.client.get("/v1/jobs/a-job/events").status_code == 401
    assert isinstance(api.client, httpx.Client)
