"""The operator CLI against a live API: jobs, watch, attempts, stuck, queues, tenants, cluster, failures,
--json everywhere, --api-key; and `dagfold up --auth-file`, `dagfold worker --metrics-port` as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from dagfold.cli import app
from dagfold.services.api.auth import AuthConfig
from tests.api_support import T0, ApiHarness, LiveServer, accepted, ev, free_port, now_ms
from tests.cli_support import stop_process_groups

ROOT = Path(__file__).resolve().parents[1]
KEY = "k-ops-admin-000001"
TENANT_KEY = "k-ops-acme-000001"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiHarness, str]]:
    auth = AuthConfig.from_env(None, env={"DAGFOLD_API_KEYS": f"{KEY}:admin,{TENANT_KEY}:acme"})
    api = ApiHarness(tmp_path_factory.mktemp("cli"), auth=auth)
    now = now_ms()
    api.project(
        accepted("done", ["a", "b"], ts=now - 10_000),
        ev("TaskDispatched", job_id="done", task_id="a", attempt=1, ts_ms=now - 9000, queue="default"),
        ev("LeaseGranted", job_id="done", task_id="a", attempt=1, worker_id="w1", ts_ms=now - 9000,
           lease_deadline_ms=now + 20_000),
        ev("TaskFailed", job_id="done", task_id="a", attempt=1, worker_id="w1", ts_ms=now - 8000,
           reason="exit code 4", exit_code=4, final=True, stderr_tail="disk full"),
        ev("TaskSkipped", job_id="done", task_id="b", ts_ms=now - 8000, reason="upstream a failed"),
        ev("JobFailed", job_id="done", ts_ms=now - 8000, reason="1 task(s) failed; first: a: exit code 4"),
        accepted("stuck-job", ["s"], ts=now - 5000, tenant="beta"),
        ev("TaskDispatched", job_id="stuck-job", task_id="s", attempt=1, ts_ms=now - 5000, queue="io"),
        ev("LeaseGranted", job_id="stuck-job", task_id="s", attempt=1, worker_id="gone", ts_ms=now - 5000,
           lease_deadline_ms=now - 60_000),
    )
    with LiveServer(api.app) as srv:
        yield api, srv.url
    api.close()


def cli(url: str, *args: str, key: str | None = KEY) -> Any:
    env = {"COLUMNS": "200", "DAGFOLD_API": url, **({"DAGFOLD_API_KEY": key} if key else {})}
    return CliRunner().invoke(app, list(args), env=env)


def test_each_invocation_in_one_process_follows_its_own_columns(live: tuple[ApiHarness, str]) -> None:
    """A process that runs several commands follows each invocation's COLUMNS, whatever the environment was when
    dagfold.cli was imported: a pytest-xdist worker's has COLUMNS=80 and LINES=24 then (the controller's
    readline sets them), and rich had fixed the CLI's consoles at 80 columns for good."""
    _, url = live
    script = ("import json, sys\n"
              "from typer.testing import CliRunner\n"
              "from dagfold.cli import app\n"
              "env = {'DAGFOLD_API': sys.argv[1], 'DAGFOLD_API_KEY': sys.argv[2]}\n"
              "print(json.dumps([CliRunner().invoke(app, ['jobs'], env={**env, 'COLUMNS': c}).output\n"
              "                  for c in ('200', '80', '200')]))\n")
    env = {**os.environ, "COLUMNS": "80", "LINES": "24", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script, url, KEY], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    wide, narrow, wide_again = json.loads(r.stdout)
    for table in (wide, wide_again):  # 200 columns: the wide table, with tenant and duration
        assert "tenant" in table and "duration" in table and max(map(len, table.splitlines())) > 80, table
    assert "tenant" not in narrow and max(map(len, narrow.splitlines())) <= 80, narrow


def test_jobs_status_tasks_attempts(live: tuple[ApiHarness, str]) -> None:
    _, url = live
    r = cli(url, "jobs", "--json")
    assert r.exit_code == 0, r.output
    assert [j["job_id"] for j in json.loads(r.output)["jobs"]] == ["stuck-job", "done"]
    r = cli(url, "jobs", "--json", "--state", "failed", "--since", str(now_ms() - 60_000))
    assert [j["job_id"] for j in json.loads(r.output)["jobs"]] == ["done"]
    r = cli(url, "jobs")
    assert r.exit_code == 0 and "stuck-job" in r.output and "failed" in r.output
    r = cli(url, "status", "done")
    assert r.exit_code == 0 and "done: failed" in r.output and "exit code 4" in r.output
    r = cli(url, "tasks", "done", "--state", "skipped", "--json")
    assert [t["task_id"] for t in json.loads(r.output)] == ["b"]
    r = cli(url, "attempts", "done", "a")
    assert r.exit_code == 0 and "exit code 4" in r.output and "disk full" in r.output
    r = cli(url, "attempts", "done", "a", "--json")
    assert json.loads(r.output)[0]["worker_id"] == "w1"
    r = cli(url, "history", "done", "--json")
    assert [e["type"] for e in json.loads(r.output)][-1] == "JobFailed"


def test_operator_views(live: tuple[ApiHarness, str]) -> None:
    api, url = live
    r = cli(url, "stuck", "--json")
    assert [(t["job_id"], t["kind"]) for t in json.loads(r.output)["tasks"]] == [("stuck-job", "lease")]
    r = cli(url, "stuck")
    assert r.exit_code == 0 and "stuck-job" in r.output and "gone" in r.output
    r = cli(url, "queues", "--json")
    assert [(q["queue"], q["running"]) for q in json.loads(r.output)["queues"]] == [("io", 1)]
    assert "io" in cli(url, "queues").output
    r = cli(url, "tenants", "--json")
    assert [t["tenant"] for t in json.loads(r.output)["tenants"]] == ["acme", "beta"]
    assert "beta" in cli(url, "tenants").output
    r = cli(url, "failures", "--json")
    assert json.loads(r.output)["reasons"][0]["class"] == "exit code 4"
    assert "exit code 4" in cli(url, "failures").output
    r = cli(url, "cluster")
    assert r.exit_code == 0 and "no GPU cluster data yet" in r.output
    api.allocator({"type": "dagfold.allocator.NodeRegistered", "node_id": "gpu-1", "gpus": 8, "health": "healthy"},
                  {"type": "dagfold.allocator.AllocationGranted", "allocation_id": "x", "tenant": "acme",
                   "placements": [{"node_id": "gpu-1", "gpus": 8}]})
    r = cli(url, "cluster", "--nodes", "--json")
    data = json.loads(r.output)
    assert data["totals"]["allocated"] == 8 and data["nodes"][0]["node_id"] == "gpu-1"
    r = cli(url, "cluster", "--nodes")
    assert "8 of 8 healthy allocated" in r.output and "gpu-1" in r.output


def test_keys_and_tenant_scope(live: tuple[ApiHarness, str]) -> None:
    _, url = live
    r = cli(url, "jobs", key=None)
    assert r.exit_code == 1 and "401" in r.output and "unauthorized" in r.output
    r = cli(url, "jobs", "--json", key=TENANT_KEY)
    assert [j["job_id"] for j in json.loads(r.output)["jobs"]] == ["done"]
    r = cli(url, "status", "stuck-job", key=TENANT_KEY)  # another tenant's job: as if it did not exist
    assert r.exit_code == 1 and "no job 'stuck-job'" in r.output
    r = cli(url, "jobs", "--json", "--api-key", TENANT_KEY, key=None)
    assert r.exit_code == 0


def test_watch(live: tuple[ApiHarness, str]) -> None:
    api, url = live
    r = cli(url, "watch", "done")
    assert r.exit_code == 1 and "done: failed" in r.output
    api.project(accepted("w", ["x", "y"], ts=T0))

    def finish() -> None:
        time.sleep(0.5)
        api.project(ev("TaskDispatched", job_id="w", task_id="x", attempt=1, ts_ms=T0 + 1, queue="default"),
                    ev("LeaseGranted", job_id="w", task_id="x", attempt=1, worker_id="w", ts_ms=T0 + 2,
                       lease_deadline_ms=T0 + 3),
                    ev("TaskFailed", job_id="w", task_id="x", attempt=1, worker_id="w", ts_ms=T0 + 3,
                       reason="flaky", final=False))
        time.sleep(0.3)
        api.project(ev("TaskSucceeded", job_id="w", task_id="x", attempt=2, worker_id="w", ts_ms=T0 + 4),
                    ev("TaskSucceeded", job_id="w", task_id="y", attempt=1, worker_id="w", ts_ms=T0 + 5),
                    ev("JobSucceeded", job_id="w", ts_ms=T0 + 6))

    t = threading.Thread(target=finish, daemon=True)
    t.start()
    r = cli(url, "watch", "w", "--json", "--timeout", "20")
    t.join()
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert events[-1] == {"event": "end", "data": {"job_id": "w", "state": "succeeded"}}
    assert "TaskFailed" in [e["data"].get("type") for e in events if e["event"] == "history"]


def test_submit_repeated_returns_existing(live: tuple[ApiHarness, str], tmp_path: Path) -> None:
    api, url = live
    spec = tmp_path / "job.yaml"
    spec.write_text("tenant: acme\nidempotency_key: cli-1\ntasks:\n  - id: a\n")
    r = cli(url, "submit", str(spec), "--json")
    assert r.exit_code == 0, r.output
    job_id = json.loads(r.output)["job_id"]
    api.accept_submitted()
    r = cli(url, "submit", str(spec), "--json")
    assert json.loads(r.output)["job_id"] == job_id and json.loads(r.output)["state"] == "running"
    spec.write_text("tenant: acme\nidempotency_key: cli-1\ntasks:\n  - id: b\n")
    r = cli(url, "submit", str(spec))
    assert r.exit_code == 1 and "409" in r.output and "idempotency_conflict" in r.output


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "dagfold.cli", *args], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, **kw: Any) -> httpx.Response:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(url, timeout=2, **kw)
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer: {log.read_text()}")


def test_up_with_auth_file_and_worker_metrics(tmp_path: Path) -> None:
    auth = tmp_path / "keys.yaml"
    auth.write_text(f"keys:\n  {KEY}: admin\n  {TENANT_KEY}: acme\n"
                    "tenants:\n  acme: {handlers: [noop, sleep, shell]}\n")  # the diamond runs shell tasks
    port = free_port()
    log = tmp_path / "up.log"
    up = _start(["up", "--data", str(tmp_path / "data"), "--port", str(port), "--auth-file", str(auth),
                 "--workers", "1", "--handlers", "noop,sleep,shell"], log)
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_http(base + "/healthz", up, log).status_code == 200
        assert httpx.get(base + "/v1/jobs").status_code == 401
        r = httpx.post(base + "/v1/jobs", json={"tasks": [{"id": "a"}]}, headers={"X-API-Key": TENANT_KEY})
        assert r.status_code == 202 and r.json()["tenant"] == "acme"
        r = cli(base, "submit", str(ROOT / "examples" / "diamond.yaml"), "--wait", key=TENANT_KEY)
        assert r.exit_code == 0, r.output
        metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        for name in ('dagfold_events_folded_total{component="projector"}',
                     'dagfold_dispatch_latency_seconds_count{queue="default"}',
                     'dagfold_worker_tasks_total{outcome="succeeded",queue="default"}',
                     'dagfold_tenant_jobs{state="succeeded",tenant="acme"}'):
            assert name in metrics, name
    finally:
        stop_process_groups([up], 20)

    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [nope]\n")
    r = subprocess.run([sys.executable, "-m", "dagfold.cli", "up", "--data", str(tmp_path / "d2"), "--auth-file",
                        str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "keys" in r.stderr

    mport = free_port()
    wlog = tmp_path / "worker.log"
    worker = _start(["worker", "--data", str(tmp_path / "wdata"), "--metrics-port", str(mport)], wlog)
    try:
        text = _wait_http(f"http://127.0.0.1:{mport}/metrics", worker, wlog).text
        assert "# TYPE dagfold_worker_tasks_total counter" in text
        assert "# TYPE dagfold_dispatch_latency_seconds histogram" in text
    finally:
        stop_process_groups([worker], 20)
