"""A hostile-input run against a live `dagfold up` (issue 12, "Done when"): answers, crashes, memory.

Starts `dagfold up` (embedded log, two workers) on a free port, then sends every hostile request of
tests/test_security_api.py many times over: the 525-byte YAML alias bomb, 10,000-deep JSON and YAML on both
submission routes, NaN/Infinity numbers, booleans as numbers, identifiers with NUL/ESC/'/'/'..'/1 MB, a
9 MiB YAML body, text/plain and form bodies, a rebound Host, cross-origin Origins, unicode digits in query
parameters, paths with encoded separators. Reports the answers by status class, whether the process is
still alive and answering, its peak RSS growth (VmHWM after minus VmRSS before), and the CPU time per hostile
request. Results: bench/results/hostile_api.json.

    python -m bench.hostile_api [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

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
    proc = subprocess.Popen([sys.executable, "-m", "dagfold", "up", "--data", str(tmp / "data"), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        time.sleep(2)  # let start-up settle before the baseline
        reqs = _requests()
        rss0, cpu0 = _status_kb(proc.pid, "VmRSS"), _cpu_s(proc.pid)
        classes: Counter[str] = Counter()
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(args.rounds):
                for method, path, headers, body in reqs:
                    r = c.request(method, path, headers=headers, content=body)
                    classes[f"{r.status_code // 100}xx"] += 1
        cpu1, hwm = _cpu_s(proc.pid), _status_kb(proc.pid, "VmHWM")
        alive = proc.poll() is None and httpx.get(url + "/healthz", timeout=5).status_code == 200
        n = sum(classes.values())
        result: dict[str, Any] = {
            "requests": n, "distinct_requests": len(reqs), "rounds": args.rounds,
            "answers": dict(sorted(classes.items())),
            "process_alive_and_answering": alive, "rss_before_mb": round(rss0 / 1024, 1),
            "peak_rss_growth_mb": round((hwm - rss0) / 1024, 1),
            "cpu_ms_per_request": round((cpu1 - cpu0) * 1000 / n, 2), "load_average": os.getloadavg(),
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
