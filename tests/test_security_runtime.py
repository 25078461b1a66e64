"""Trust boundaries of capabilities, entitlements, the task runtime and the log (issue 12), black-box.

Through HTTP (the API over an embedded log), the log (the scheduler fold, as an
upstream producer's records reach it) and processes (``dagfold up``). Each
case failed on the code before the fix: shell ran for anyone, ``sleep {secs:
1}`` was accepted, a free tenant could submit at ``enterprise``, an open API
gave each new tenant name its own rate bucket, a task inherited the service's
environment (auth file path, secrets), NaN progress was folded.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold.codec import default_codec
from dagfold.commands import set_tenant_entitlements, settings_keys
from dagfold.config import COMMANDS
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.log.base import TopicPartition, partition_for
from dagfold.services.api.admission import AdmissionConfig
from dagfold.services.api.auth import AuthConfig
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.worker.handlers import HandlerRegistry, default_registry
from dagfold.tenants import Entitlements
from tests.api_support import ApiHarness
from tests.cli_support import DAGFOLD, ROOT, free_port

ADMIN_KEY = "admin-key-0123456789"
A_KEY = "tenant-a-key-0123456789"  # tenant "alpha": granted shell, any tier
B_KEY = "tenant-b-key-0123456789"  # tenant "beta": free tier, default handlers (no shell)


def auth_file(tmp: Path) -> Path:
    f = tmp / "auth.yaml"
    f.write_text(f"""
keys:
  {ADMIN_KEY}: admin
  {A_KEY}: alpha
  {B_KEY}: beta
tenants:
  alpha: {{handlers: [noop, sleep, shell]}}
  beta: {{max_tier: free, weight: 0.5, gpu_quota: {{default: 2}}}}
""")
    f.chmod(0o600)
    return f


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def shell_job(cmd: str, **extra: Any) -> dict[str, Any]:
    return {"tasks": [{"id": "s", "handler": "shell", "args": {"cmd": cmd}}], **extra}


def spec(doc: dict[str, Any]) -> dict[str, Any]:
    return to_job_spec(parse_spec(doc))


@pytest.fixture
def api(tmp_path: Path) -> Any:
    a = ApiHarness(tmp_path, auth=AuthConfig.from_env(auth_file(tmp_path), env={}),
                   handlers=HandlerRegistry.with_builtins(shell=True))
    yield a
    a.close()


# -- bullet 1: handlers are capabilities -------------------------------------------------------------


def test_shell_is_not_a_default_capability(tmp_path: Path) -> None:
    assert "shell" not in default_registry()
    a = ApiHarness(tmp_path, handlers=default_registry())  # open API; workers without shell
    try:
        r = a.client.post("/v1/jobs", json=shell_job("id"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "handler_not_enabled", r.text
        assert "shell" in r.json()["error"]["reason"]
        assert a.client.post("/v1/jobs", json={"tasks": [{"id": "n", "handler": "noop"}]}).status_code == 202
        assert [c["type"] for c in a.commands()] == ["dagfold.command.SubmitJob"]  # the refused one wrote nothing
    finally:
        a.close()


def test_shell_only_for_tenants_granted_it(api: ApiHarness) -> None:
    r = api.client.post("/v1/jobs", json=shell_job('cat "$DAGFOLD_AUTH_FILE"'), headers=h(B_KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "handler_not_allowed", r.text
    assert "beta" in r.json()["error"]["reason"]
    assert api.client.post("/v1/jobs", json=shell_job("echo hi"), headers=h(A_KEY)).status_code == 202


def test_handler_args_are_checked_at_submission(api: ApiHarness) -> None:
    for task in ({"id": "t", "handler": "sleep", "args": {"secs": 1}},
                 {"id": "t", "handler": "sleep", "args": {"seconds": "1"}},
                 {"id": "t", "handler": "shell", "args": {"cmd": 1}},
                 {"id": "t", "handler": "shell", "args": {"cmd": "id", "env": {"DAGFOLD_JOB_ID": "x"}}}):
        r = api.client.post("/v1/jobs", json={"tasks": [task]}, headers=h(A_KEY))
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_args", (task, r.text)
    # an upstream producer's SubmitJob gets the same rules from the scheduler
    hs = FoldHarness()
    hs.submit(spec({"id": "J", "tasks": [{"id": "t", "handler": "sleep", "args": {"secs": 1}}]}))
    rejected = hs.events[-1]
    assert rejected["type"] == "dagfold.event.JobRejected" and rejected["code"] == "invalid_args"
    assert "secs" in rejected["reason"] and hs.job("J") is None


def test_custom_handler_args_check_runs_at_submission(tmp_path: Path) -> None:
    reg = HandlerRegistry.with_builtins()
    reg.register("resize", lambda ctx: None,
                 args_check=lambda args: None if isinstance(args.get("width"), int) else "resize: width is required")
    a = ApiHarness(tmp_path, handlers=reg)
    try:
        r = a.client.post("/v1/jobs", json={"tasks": [{"id": "r", "handler": "resize", "args": {}}]})
        assert r.status_code == 422 and "width" in r.json()["error"]["reason"]
        ok = a.client.post("/v1/jobs", json={"tasks": [{"id": "r", "handler": "resize", "args": {"width": 3}}]})
        assert ok.status_code == 202
    finally:
        a.close()


def test_worker_cli_refuses_an_unknown_handler_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([*DAGFOLD, "worker", "--data", str(tmp_path), "--handlers", "noop,rm-rf"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown handler 'rm-rf'" in r.stderr and "Traceback" not in r.stderr


# -- bullet 5: entitlements --------------------------------------------------------------------------


def test_tier_above_the_tenants_highest_is_refused(api: ApiHarness) -> None:
    r = api.client.post("/v1/jobs", json={"tier": "enterprise", "tasks": [{"id": "a"}]}, headers=h(B_KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tier_not_allowed", r.text
    r = api.client.post("/v1/gpu-jobs", json={"model": "m", "tier": "standard"}, headers=h(B_KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tier_not_allowed", r.text
    assert api.client.post("/v1/jobs", json={"tier": "free", "tasks": [{"id": "a"}]}, headers=h(B_KEY)).status_code \
        == 202
    assert api.client.post("/v1/jobs", json={"tier": "enterprise", "tasks": [{"id": "a"}]},
                           headers=h(A_KEY)).status_code == 202


def test_upstream_submitjob_is_checked_against_entitlements_from_the_log() -> None:
    hs = FoldHarness()
    ent = Entitlements.parse({"max_tier": "free", "handlers": ["noop"]}).to_record()
    for cmd in set_tenant_entitlements("beta", ent, 1):
        hs.process(cmd)
    assert hs.events[-1]["type"] == "dagfold.event.TenantEntitlementsSet"
    hs.submit(spec({"id": "J1", "tenant": "beta", "tier": "enterprise", "tasks": [{"id": "a"}]}))
    assert (hs.events[-1]["type"], hs.events[-1]["code"]) == ("dagfold.event.JobRejected", "tier_not_allowed")
    hs.submit(spec({"id": "J2", "tenant": "beta", "tier": "free",
                    "tasks": [{"id": "a", "handler": "shell", "args": {"cmd": "id"}}]}))
    assert (hs.events[-1]["type"], hs.events[-1]["code"]) == ("dagfold.event.JobRejected", "handler_not_allowed")
    hs.submit(spec({"id": "J3", "tenant": "beta", "tier": "free", "tasks": [{"id": "a"}]}))
    assert hs.job("J3") is not None and hs.job("J1") is None and hs.job("J2") is None
    hs.submit(spec({"id": "J4", "tenant": "other", "tier": "enterprise", "tasks": [{"id": "a"}]}))
    assert hs.job("J4") is not None  # no settings for the tenant: not restricted
    assert hs.replayed_digest() == hs.digest()  # replay sees the same settings


def test_auth_file_settings_do_not_undo_admin_changes_on_restart() -> None:
    hs = FoldHarness()
    file_ent = Entitlements.parse({"max_tier": "free"}).to_record()
    admin_ent = Entitlements.parse({"max_tier": "standard"}).to_record()
    for ent, source in ((file_ent, "auth_file"), (admin_ent, "admin_api"), (file_ent, "auth_file")):
        for cmd in set_tenant_entitlements("beta", ent, 1, source):
            hs.process(cmd)
    assert [e.get("source") for e in hs.events] == ["auth_file", "admin_api"]  # the restart changed nothing
    hs.submit(spec({"id": "J", "tenant": "beta", "tier": "standard", "tasks": [{"id": "a"}]}))
    assert hs.job("J") is not None


def test_settings_commands_reach_every_partition() -> None:
    keys = settings_keys(8)
    assert sorted(partition_for(k.encode(), 8) for k in keys) == list(range(8))


def test_admin_api_writes_entitlements_through_the_log(api: ApiHarness) -> None:
    body = {"max_tier": "standard", "handlers": ["noop"], "weight": 3, "gpu_quota": {"default/h100": 4},
            "max_open_jobs": 1}
    assert api.client.put("/v1/tenants/beta/entitlements", json=body, headers=h(B_KEY)).status_code == 403
    bad = api.client.put("/v1/tenants/beta/entitlements", json={"max_tier": "gold"}, headers=h(ADMIN_KEY))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_entitlements"
    nan = api.client.put("/v1/tenants/beta/entitlements", content=b'{"weight": NaN}',
                         headers={**h(ADMIN_KEY), "Content-Type": "application/json"})
    assert nan.status_code in (400, 422), nan.text
    r = api.client.put("/v1/tenants/beta/entitlements", json=body, headers=h(ADMIN_KEY))
    assert r.status_code == 202, r.text
    cmds = [c for c in api.commands() if c["type"] == "dagfold.command.SetTenantEntitlements"]
    assert len(cmds) == api.config.partitions and {c["tenant"] for c in cmds} == {"beta"}
    # each on its own partition, keyed so that the scheduler accepts it there
    for p in range(api.config.partitions):
        recs = api.log.read(TopicPartition(COMMANDS, p), 0, 100)
        assert [default_codec().decode(x.value)["job_id"] for x in recs] == [settings_keys(4)[p]]
    # folded by the scheduler and projected, the API answers from the log's copy
    hs = FoldHarness()
    for c in cmds:
        hs.process(c)
    api.project(*[e for e in hs.events])
    got = api.client.get("/v1/tenants/beta/entitlements", headers=h(B_KEY)).json()
    assert got["entitlements"]["max_tier"] == "standard" and got["source"] == "admin_api"
    r = api.client.post("/v1/jobs", json={"tier": "standard", "tasks": [{"id": "a"}]}, headers=h(B_KEY))
    assert r.status_code == 202, r.text  # was free in the auth file
    r = api.client.post("/v1/jobs", json={"tier": "free", "tasks": [{"id": "a"}]}, headers=h(B_KEY))
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_queued_jobs"  # the new cap, live
    assert api.client.get("/v1/tenants/alpha/entitlements", headers=h(B_KEY)).status_code == 403


def test_open_api_rate_limit_is_not_bypassed_by_new_tenant_names(tmp_path: Path) -> None:
    a = ApiHarness(tmp_path, admission=AdmissionConfig(rate_per_s=1, burst=5, max_open_jobs=10_000))
    try:
        codes = [a.client.post("/v1/jobs", json={"tenant": f"t{i}", "tasks": [{"id": "a"}]}).status_code
                 for i in range(30)]
        assert codes.count(202) <= 6 and codes.count(429) >= 24, codes
    finally:
        a.close()


def test_allocator_options_take_weights_and_quotas_from_the_auth_file(tmp_path: Path) -> None:
    from dagfold.services.allocator.options import options_for_pool

    opts = options_for_pool("default", AuthConfig.from_env(auth_file(tmp_path), env={}).limits)
    assert opts.weight("beta") == 0.5 and opts.quota_milli("beta") == 2000 and opts.quota_milli("alpha") is None


BAD_AUTH_ENTRIES = [
    ("keys: {k-0123456789: '[/bold]'}", "key ...6789: tenant '[/bold]' may contain only"),
    ("keys: {k-0123456789: {tenant: 'a/b'}}", "key ...6789: tenant 'a/b' may contain only"),
    ("tenants: {'..': {weight: 1}}", "tenants: tenant '..' is reserved"),
    ('tenants: {"t\\e[31m": {weight: 1}}', "tenants: tenant 't\\x1b[31m' may contain only"),
    ("tenants: {acme: {handlers: [noop, 'rm -rf']}}", "tenant 'acme': handlers: handler 'rm -rf' may contain only"),
    ("tenants: {acme: {handlers: ['']}}", "tenant 'acme': handlers: handler must not be empty"),
    ("tenants: {acme: {gpu_quota: {'p[x]': 1}}}", "tenant 'acme': gpu_quota: pool 'p[x]' may contain only"),
    ("tenants: {acme: {gpu_quota: {'default/h 100': 1}}}",
     "tenant 'acme': gpu_quota: gpu_type 'h 100' may contain only"),
    ("tenants: {acme: {gpu_quota: {'default/..': 1}}}", "tenant 'acme': gpu_quota: gpu_type '..' is reserved"),
    ("tenants: {acme: {max_tier: gold}}", "tenant 'acme': max_tier must be one of"),
]


@pytest.mark.parametrize(("text", "message"), BAD_AUTH_ENTRIES)
def test_auth_file_identifiers_are_checked_by_the_rules_table(tmp_path: Path, text: str, message: str) -> None:
    from dagfold.services.api.auth import AuthConfigError

    f = tmp_path / "auth.yaml"
    f.write_text(text + "\n")
    with pytest.raises(AuthConfigError) as err:
        AuthConfig.from_env(f, env={})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("command", [["allocator"], ["up", "--port", str(free_port())]])
def test_a_bad_auth_file_entry_stops_start_up_in_one_line(tmp_path: Path, command: list[str]) -> None:
    f = tmp_path / "auth.yaml"
    f.write_text("keys: {k-0123456789: acme}\ntenants: {acme: {handlers: [noop, 'sh;id']}}\n")
    r = subprocess.run([*DAGFOLD, *command, "--data", str(tmp_path / "d"), "--auth-file", str(f)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "handler 'sh;id' may contain only" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())  # nothing started


# -- bullet 8: reports and numbers from the log -------------------------------------------------------


def test_forged_report_from_another_worker_and_nan_progress_change_nothing() -> None:
    hs = FoldHarness()
    hs.submit(spec({"id": "J", "tasks": [{"id": "a"}]}))
    d = hs.dispatched.popleft()
    hs.report("Started", d, "w1")
    before = hs.digest()
    hs.report("Succeeded", d, "forger")
    hs.report("Failed", d, "forger", retryable=False)
    for bad in (float("nan"), float("inf"), -float("inf"), 7.0):
        hs.report("Heartbeat", d, "w1", progress=bad)
    assert hs.digest() == before
    assert hs.event_types()[-6:] == ["ReportIgnored"] * 6
    assert hs.task("J", "a")["state"] == "running"
    hs.report("Heartbeat", d, "w1", progress=0.5)
    assert hs.event_types()[-1] == "LeaseExtended"


def test_nan_max_runtime_from_an_upstream_producer_is_rejected() -> None:
    hs = FoldHarness()
    s = spec({"id": "J", "tasks": [{"id": "a", "handler": "gpu", "resources": {"gpus": 1}}]})
    s["tasks"][0]["resources"]["max_runtime_s"] = float("inf")
    hs.submit(s)
    assert (hs.events[-1]["type"], hs.events[-1]["code"]) == ("dagfold.event.JobRejected", "invalid_field")


# -- bullet 2: tasks run without the service's secrets ------------------------------------------------


def _wait_job(base: str, key: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/v1/jobs/{job_id}", headers=h(key), timeout=5)
        if r.status_code == 200 and r.json()["state"] not in ("running",):
            return dict(r.json())
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish")


def test_a_shell_task_cannot_reach_the_services_secrets(tmp_path: Path) -> None:
    """`dagfold up --auth-file` with shell granted to tenant alpha: its task looks for the secrets.

    Running as root (as here), the stack also gets ``--task-user nobody``: the task then cannot read the
    data folder or the auth file even by their absolute paths (visible in /proc/*/cmdline)."""
    data, auth = tmp_path / "data", auth_file(tmp_path)
    root = os.geteuid() == 0
    port = free_port()
    env = {**os.environ, "DAGFOLD_CALLBACK_SECRET": "callback-secret-5up3r",
           "DAGFOLD_API_KEYS": "env-key-0123456789:admin"}
    args = ["up", "--data", str(data), "--port", str(port), "--auth-file", str(auth), "--workers", "1",
            "--handlers", "noop,sleep,shell", "--task-dir", str(tmp_path)]
    if root:
        args += ["--task-user", "nobody"]
    logf = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen([*DAGFOLD, *args], cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        cmd = (f'env; echo "PWD=$(pwd)"; id -u; cat "$DAGFOLD_AUTH_FILE"; ls -a .dagfold; '
               f'cat {auth}; ls {data}; cat {data}/callbacks-secret; cat /proc/$PPID/environ; exit 0')
        r = httpx.post(base + "/v1/jobs", json=shell_job(cmd), headers=h(A_KEY), timeout=10)
        assert r.status_code == 202, r.text
        job = _wait_job(base, A_KEY, r.json()["job_id"])
        assert job["state"] == "succeeded", job
        att = httpx.get(f"{base}/v1/jobs/{job['job_id']}/tasks/s/attempts", headers=h(A_KEY)).json()["attempts"][0]
        out = att.get("stdout_tail", "") + att.get("stderr_tail", "")
        assert "DAGFOLD_JOB_ID=" in out  # the task's own variables are there
        for secret in ("DAGFOLD_AUTH_FILE", "DAGFOLD_API_KEYS", "DAGFOLD_CALLBACK_SECRET", "callback-secret-5up3r",
                       "env-key-0123456789", "DAGFOLD_DATA="):
            assert secret not in out.split("PWD=")[0], secret  # not in the environment
        pwd = out.split("PWD=")[1].split("\n")[0]
        assert pwd.startswith(str(tmp_path / "dagfold-attempt-")) and not Path(pwd).exists()  # fresh, removed
        if root:
            assert "\n65534\n" in out
            for secret in (ADMIN_KEY, B_KEY, "callback-secret-5up3r", "env-key-0123456789"):
                assert secret not in out, secret
            assert "Permission denied" in out
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        logf.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_allocator_rejects_non_finite_runtime_and_ignores_non_finite_perf(bad: float) -> None:
    from dagfold.services.allocator.harness import AllocatorHarness

    h = AllocatorHarness()
    h.register("n0")
    h.request("r", gpus=1, max_runtime_s=bad)  # was a fold error (int(inf)) or an allocation without a limit
    assert "max_runtime_s" in h.of_type("RequestRejected")[-1]["reason"]
    h.heartbeat("n0", perf=bad)  # recorded or not (a heartbeat with nothing new is not), never as a number
    assert all(e["perf"] is None for e in h.of_type("NodeHeartbeatRecorded")) and not h.fold.state.perf
    assert h.replayed_digest() == h.digest()
