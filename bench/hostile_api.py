"""A hostile-input run against a live `dagfold up` (issue 12, "Done when"): answers, crashes, memory.

Starts `dagfold up` (embedded log, two workers) on a free port, then sends every hostile request of
tests/test_security_api.py many times over: the 525-byte YAML alias bomb, 10,000-deep JSON and YAML on both
submission routes, NaN/Infinity numbers, booleans as numbers, identifiers with NUL/ESC/'/'/'..'/1 MB, a
9 MiB YAML body, text/plain and form bodies, a rebound Host, cross-origin Origins, unicode digits in query
parameters, paths with encoded separators, all with tenant beta's key (auth file: acme, beta, admin). Each
round beta also probes tenant acme's job and settings (every job route, cancel/redrive/retry, its job ID,
its tenant, a higher tier, shell, /metrics, every listing): an isolation breach is a 2xx to a job route,
acme's marker in any answer, or acme's name in a listing. Reports the answers by status class, the
breaches, whether the process is still alive and answering, its peak RSS growth (VmHWM after minus VmRSS
before), and the CPU time per request. Results: bench/results/hostile_api.json.

Callbacks and record framing (issue 24, bench/hostile_callbacks.py): each round beta also submits jobs
whose callback_url is a denied literal address (a 2xx is a breach); after the rounds, callbacks to a name
resolving to loopback, beta's dripping receivers against acme's callback, and (with the stack stopped and
started again) every command body framed with every other command's fingerprint in the log.

Tasks and grants (issue 24, bench/hostile_tasks.py; the stack runs shell tasks as user nobody and one
simulated 8-GPU host): acme's shell tasks racing their outputs (a symlink swapped in for the auth file, an
output rewritten during its upload, setsid leftovers), beta's GPU job lying about its runtime next to
acme's, and (with the stack stopped, like the framing probe) grants forged for beta's queued GPU job naming
acme's GPUs and checkpoint, on ``commands`` and on ``scheduler.internal``.

    python -m bench.hostile_api [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import hostile_callbacks as hc
from bench import hostile_tasks as ht

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "hostile_api.json"


def _requests() -> list[tuple[str, str, dict[str, str], bytes | None]]:
    from tests.test_security_api import ALIAS_BOMB, BAD_FIELDS, BAD_TASK_FIELDS

    deep = "[" * 10_000 + "]" * 10_000
    deep_doc = f'{{"tasks": [{{"id": "a", "args": {{"x": {deep}}}}}], "model": "m"}}'.encode()
    js, ya = {"content-type": "application/json"}, {"content-type": "application/yaml"}
    reqs: list[tuple[str, str, dict[str, str], bytes | None]] = [
        ("POST", "/v1/jobs", ya, ALIAS_BOMB.encode()),
        ("POST", "/v1/jobs", js, deep_doc), ("POST", "/v1/jobs", ya, deep_doc), ("POST", "/v1/gpu-jobs", js, deep_doc),
        ("POST", "/v1/jobs", js, b'{"tasks": [{"id": "a", "resources": {"gpus": 1, "max_runtime_s": Infinity}}]}'),
        ("POST", "/v1/jobs", js, b'{"tasks": [{"id": "a", "retry": {"max_attempts": true}}]}'),
        ("POST", "/v1/jobs", ya, b"tasks: [{id: a, args: {x: .nan}}]"),
        ("POST", "/v1/jobs", {"content-type": "text/plain"}, b"tasks: [{id: a, handler: shell, args: {cmd: id}}]"),
        ("POST", "/v1/jobs", {"content-type": "application/x-www-form-urlencoded"}, b"tasks=x"),
        ("POST", "/v1/jobs", {**js, "origin": "http://attacker.example"}, b'{"tasks": [{"id": "a"}]}'),
        ("POST", "/v1/jobs", {**js, "sec-fetch-site": "cross-site"}, b'{"tasks": [{"id": "a"}]}'),
        ("GET", "/v1/jobs", {"host": "attacker.example"}, None),
        ("GET", "/v1/jobs?created_after=%C2%B2", {}, None), ("GET", "/v1/failures?since=%C2%B9%C2%B2", {}, None),
        ("POST", "/v1/jobs/JOB%2Fredrive%23/cancel", {}, None), ("GET", "/v1/jobs/%2E%2E/history", {}, None),
    ]
    for field, value in BAD_FIELDS:
        reqs.append(("POST", "/v1/jobs", js, json.dumps({field: value, "tasks": [{"id": "a"}]}).encode()))
    for field, value in BAD_TASK_FIELDS:
        reqs.append(("POST", "/v1/jobs", js, json.dumps({"tasks": [{"id": "a", field: value}]}).encode()))
    return reqs


# Tenants of the run's auth file: the hostile requests come with beta's key (a rate high enough that its
# bodies are parsed, not refused by the rate limit); acme owns a job that beta tries to reach.
KEYS = {"admin": "hostile-admin-key-000001", "acme": "hostile-acme-key-0000001", "beta": "hostile-beta-key-0000001"}
AUTH_FILE = f"""keys: {{{KEYS['admin']}: admin, {KEYS['acme']}: acme, {KEYS['beta']}: beta}}
tenants:
  acme: {{handlers: [noop, sleep, shell, gpu]}}
  beta: {{rate_per_s: 1000000, burst: 1000000, max_tier: free, gpu_quota: {{default: 3}}}}
"""
# one simulated GPU host, so that every GPU job shares it
UP_ARGS = ["--handlers", "noop,sleep,shell", "--gpu-nodes", "1", "--gpus-per-node", "8"]


def task_user_args() -> list[str]:
    """Task processes as nobody where the run is root's and nobody can run this interpreter (the GPU jobs are
    `python -m dagfold.services.agent.demo_job`); else, as root, root tasks opted in (stated in the results)."""
    if os.geteuid() != 0:
        return []
    exe = Path(sys.executable).resolve()
    if all(p.stat().st_mode & 0o001 for p in (exe, *exe.parents)):
        return ["--task-user", "nobody"]
    return ["--allow-root-tasks"]
VICTIM = "acme-private-job"
MARKER = "ACME-SECRET"  # in the victim job's name and labels: never in an answer to beta


def _isolation_probes() -> list[tuple[str, str, bytes | None, bool]]:
    """(method, path, JSON body, is a listing) that beta sends about acme's job and tenant. A job route must
    answer 4xx; a listing may answer 2xx but must not show acme's job."""
    j = f"/v1/jobs/{VICTIM}"
    probes: list[tuple[str, str, bytes | None, bool]] = [
        ("GET", j, None, False), ("GET", j + "/tasks", None, False), ("GET", j + "/tasks/a", None, False),
        ("GET", j + "/tasks/a/attempts", None, False), ("GET", j + "/attempts", None, False),
        ("GET", j + "/history", None, False), ("GET", j + "/graph", None, False),
        ("GET", j + "/events?timeout_s=1", None, False), ("GET", j + "/tasks/a/outputs/result.json", None, False),
        ("GET", f"/v1/gpu-jobs/{VICTIM}", None, False), ("POST", j + "/cancel", None, False),
        ("POST", j + "/redrive", None, False), ("POST", j + "/tasks/a/retry", None, False),
        ("POST", j + "/tasks/a/mark-succeeded", None, False), ("POST", f"/v1/gpu-jobs/{VICTIM}/cancel", None, False),
        ("GET", "/v1/jobs?tenant=acme", None, False), ("GET", "/v1/tenants/acme/entitlements", None, False),
        ("PUT", "/v1/tenants/beta/entitlements", b'{"max_tier": "enterprise"}', False),
        ("GET", "/metrics", None, False),
        ("POST", "/v1/jobs", json.dumps({"id": VICTIM, "tasks": [{"id": "b"}]}).encode(), False),
        ("POST", "/v1/jobs", json.dumps({"tenant": "acme", "tasks": [{"id": "b"}]}).encode(), False),
        ("POST", "/v1/jobs", json.dumps({"tier": "enterprise", "tasks": [{"id": "b"}]}).encode(), False),
        ("POST", "/v1/jobs", json.dumps({"tasks": [{"id": "b", "handler": "shell", "args": {"cmd": "id"}}]}
                                        ).encode(), False),
    ]
    for path in ("/v1/jobs", "/v1/failures", "/v1/queues", "/v1/stuck", "/v1/tenants", "/v1/cluster",
                 "/v1/deadletters", f"/v1/jobs?id_prefix={VICTIM[:4]}", "/v1/jobs?name=ACME"):
        probes.append(("GET", path, None, True))
    return probes


def _breach(r: httpx.Response, listing: bool) -> bool:
    """An answer that gave beta something of acme's: a 2xx to a job route, acme's marker anywhere, or the
    tenant's name in a listing (its jobs, usage or settings)."""
    return (not listing and r.is_success) or MARKER in r.text or (listing and "acme" in r.text)


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    from tests.api_support import free_port

    tmp = Path(tempfile.mkdtemp(prefix="dagfold-hostile-"))
    port = free_port()
    auth = tmp / "auth.yaml"
    auth.write_text(AUTH_FILE)
    auth.chmod(0o600)
    from tests.callback_support import Receiver

    task_user = task_user_args()
    up_log = tmp / "up.log"  # the agent's refusals of forged dispatches are warnings there

    def start() -> subprocess.Popen[bytes]:
        with up_log.open("ab") as err:
            p = subprocess.Popen([sys.executable, "-m", "dagfold", "up", "--data", str(tmp / "data"), "--port",
                                  str(port), "--auth-file", str(auth), *UP_ARGS, *task_user],
                                 env={**os.environ, **hc.ENV, "DAGFOLD_CALLBACK_SECRET": ht.CALLBACK_SECRET},
                                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        until = time.monotonic() + 120
        while time.monotonic() < until:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        return p

    url = f"http://127.0.0.1:{port}"
    canary, slow = Receiver("127.0.0.1").__enter__(), Receiver("127.0.0.2").__enter__()
    proc = start()
    try:
        deadline = time.monotonic() + 120
        victim = httpx.post(url + "/v1/jobs", headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=30,
                            json={"id": VICTIM, "name": f"{MARKER}-name", "labels": {"s": f"{MARKER}-label"},
                                  "tasks": [{"id": "a"}]})
        assert victim.status_code == 202, victim.text
        while time.monotonic() < deadline:  # acme's job has run (it has attempts, a history)
            got = httpx.get(f"{url}/v1/jobs/{VICTIM}", headers={"Authorization": f"Bearer {KEYS['acme']}"})
            if got.status_code == 200 and got.json()["state"] == "succeeded":
                break
            time.sleep(0.3)
        time.sleep(2)  # let start-up settle before the baseline
        reqs = _requests()
        probes = _isolation_probes()
        callback_probes = hc.submission_probes(canary.port, port)
        rss0, cpu0 = _status_kb(proc.pid, "VmRSS"), _cpu_s(proc.pid)
        classes: Counter[str] = Counter()
        breaches: Counter[str] = Counter()
        beta = {"Authorization": f"Bearer {KEYS['beta']}"}
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(args.rounds):
                for method, path, headers, body in reqs:
                    r = c.request(method, path, headers={**beta, **headers}, content=body)
                    classes[f"{r.status_code // 100}xx"] += 1
                for method, path, body, listing in probes:
                    r = c.request(method, path, headers={**beta, "content-type": "application/json"}, content=body)
                    classes[f"{r.status_code // 100}xx"] += 1
                    if _breach(r, listing):
                        breaches[f"{method} {path} -> {r.status_code}"] += 1
                for method, path, body in callback_probes:
                    r = c.request(method, path, headers={**beta, "content-type": "application/json"}, content=body)
                    classes[f"{r.status_code // 100}xx"] += 1
                    if r.is_success:
                        breaches[f"callback_url {body.decode()} -> {r.status_code}"] += 1
        cpu1, hwm = _cpu_s(proc.pid), _status_kb(proc.pid, "VmHWM")
        alive = proc.poll() is None and httpx.get(url + "/healthz", timeout=5).status_code == 200
        n = sum(classes.values())
        acme = {"Authorization": f"Bearer {KEYS['acme']}"}
        admin = {"Authorization": f"Bearer {KEYS['admin']}"}
        with httpx.Client(base_url=url, timeout=60) as c:
            t0 = time.monotonic()
            gpu_jobs = ht.start_gpu_jobs(c, acme, beta)  # the liar runs out its runtime meanwhile
            race = ht.outputs_race(c, acme, auth, ht.secrets(KEYS))
            delivery = hc.delivery_probes(c, beta, canary)
            slowness = hc.slow_probe(c, beta, acme, slow)
            lying = ht.lying_runtimes(c, acme, beta, admin, gpu_jobs)
            target = ht.forged_grants(c, acme, gpu_jobs, tmp / "data" / "artifacts")
            queued_state = c.get(f"/v1/gpu-jobs/{gpu_jobs['queued']}", headers=beta).json()["task"]["state"]
            live_s = round(time.monotonic() - t0, 1)
        os.killpg(proc.pid, signal.SIGTERM)  # the framing probe writes the stopped stack's log, then starts it again
        proc.wait(60)
        framing: dict[str, Any] = hc.produce_misframed(tmp / "data")
        forged: dict[str, Any] = ht.produce_forged(tmp / "data", gpu_jobs["queued"], target)
        proc = start()
        with httpx.Client(base_url=url, timeout=60) as c:
            framing["dead_letters"] = hc.count_framing_dead_letters(c, admin, framing["codec_refuses"])
            framing["breaches"] = max(framing["codec_refuses"] - framing["dead_letters"], 0)
            forged.update(ht.check_forged(c, beta, admin, gpu_jobs["queued"], target, up_log),
                          queued_state_before=queued_state)
            alive_after = proc.poll() is None and c.get("/healthz").status_code == 200
        result: dict[str, Any] = {
            "requests": n, "distinct_requests": len(reqs) + len(probes), "rounds": args.rounds,
            "answers": dict(sorted(classes.items())),
            "isolation_probes": len(probes) * args.rounds, "isolation_breaches": sum(breaches.values()),
            "breaches": dict(breaches),
            "process_alive_and_answering": alive, "rss_before_mb": round(rss0 / 1024, 1),
            "peak_rss_growth_mb": round((hwm - rss0) / 1024, 1),
            "cpu_ms_per_request": round((cpu1 - cpu0) * 1000 / n, 2), "load_average": os.getloadavg(),
            "callback_submission_probes": len(callback_probes) * args.rounds,
            "callback_delivery": delivery, "callback_slow_receivers": slowness, "misframed_records": framing,
            "callback_and_framing_breaches": delivery["breaches"] + slowness["breaches"] + framing["breaches"],
            "outputs_race": race, "lying_runtimes": lying, "forged_grants": forged,
            "task_and_grant_breaches": race["breaches"] + lying["breaches"] + forged["breaches"],
            "task_classes_live_s": live_s, "task_user": " ".join(task_user) or "the run's user",
            "alive_after_restart": alive_after,
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        canary.__exit__(None, None, None)
        slow.__exit__(None, None, None)
    ht.forged_in_log(tmp / "data", gpu_jobs["queued"], target, forged)
    result["task_and_grant_breaches"] = race["breaches"] + lying["breaches"] + forged["breaches"]
    shutil.rmtree(tmp, ignore_errors=True)  # 200 MB of task outputs
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
