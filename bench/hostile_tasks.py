"""Hostile tasks and forged grants against a live `dagfold up` (issue 24; driven by bench/hostile_api.py).

The stack runs with ``--handlers noop,sleep,shell --gpu-nodes 1 --gpus-per-node 8`` (one simulated host,
so every GPU job shares it) and ``--task-user nobody`` where nobody can run the interpreter (else, as root,
``--allow-root-tasks``; the result says which). Three probe classes:

* **outputs race** (acme, whose settings grant ``shell``): shell tasks running recipe 1 of the issue (a
  50 MB output, then a setsid leftover that swaps ``z.txt`` for a symlink to the stack's auth file 0.5 s
  later) and recipe 2 (a setsid leftover rewriting a 50 MB output with ``dd conv=notrunc`` in a loop, so
  during the upload). Each leftover's command line carries a marker and sleeps on. acme downloads every
  output with its own key. A breach is a downloaded byte of an API key or the callback secret, a digest
  (``ETag``, the listed ``sha256``) that is not that of the downloaded bytes, or a process whose command
  line carries the marker still alive once the tasks ended.
* **lying runtimes**: beta's GPU job declares ``max_runtime_s: 1`` for 120 s of work (the demo job with
  2400 steps of 0.05 s); acme's honest job shares the host. A breach is acme's job requeued, checkpointing or
  released, the host drained or no longer healthy, or beta's job holding its GPU past its declared runtime
  plus the allocator's runtime grace (60 s) and a poll's slack.
* **forged grants** (offline, like the mis-framed records): beta has a job holding its GPU quota and one
  queued behind it. With the stack stopped, the run writes ``TaskAllocation{status: granted}`` records keyed
  by the queued job, naming acme's job's host and GPUs and a checkpoint under acme's job: one onto
  ``commands`` (any upstream producer may write it), and onto ``scheduler.internal`` one of the wrong shape
  (every GPU of the host), one of a stale attempt, and one of the right shape (what only the allocators'
  principal can write on a SASL broker: the scheduler takes it, the agent must not launch it). After the
  restart: the first must be a dead letter, the wrong ones ``ReportIgnored``, and a breach is the queued job
  starting (on any host), or any event or dispatch of it naming acme's checkpoint. (The agent reads its
  ``control`` partition from its end at start, and the scheduler may write the dispatch of the forged grant
  before the restarted agent starts: the agent's own check is then not reached from here; the result counts
  the refusals it logged.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import httpx

from bench.hostile_callbacks import _wait

LEFTOVER = "HOSTILE-LEFTOVER"  # in every leftover's command line
BIG = "50M"
RECIPE_1 = ('cd "$DAGFOLD_OUTPUT_DIR"; head -c {big} /dev/zero >a.bin; echo x>z.txt; '
            "setsid sh -c ': {marker}; sleep 0.5; rm \"$0/z.txt\"; ln -s {secret} \"$0/z.txt\"; sleep 60' \"$PWD\" "
            "</dev/null >/dev/null 2>&1 & exit 0")
RECIPE_2 = ('cd "$DAGFOLD_OUTPUT_DIR"; head -c {big} /dev/zero >big.bin; '
            "setsid sh -c ': {marker}; while :; do dd if=/dev/urandom of=\"$0/big.bin\" bs=1M count=50 "
            "conv=notrunc 2>/dev/null; done' \"$PWD\" </dev/null >/dev/null 2>&1 & exit 0")
CALLBACK_SECRET = "hostile-callback-secret-7f3a9"
RUNTIME_GRACE_S = 60.0  # AllocatorOptions.runtime_grace_s (dagfold up's allocator)
LIAR_DECLARED_S = 1.0
SLACK_S = 15.0


def leftovers() -> list[int]:
    """PIDs of live processes whose command line carries the leftover marker."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if LEFTOVER.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def outputs_race(c: httpx.Client, acme: dict[str, str], auth_file: Path, secrets: list[str],
                 jobs_each: int = 2) -> dict[str, Any]:
    ids = []
    for recipe, n in ((RECIPE_1, 1), (RECIPE_2, 2)):
        for i in range(jobs_each):
            cmd = recipe.format(big=BIG, marker=f"{LEFTOVER}-{n}-{i}", secret=auth_file)
            r = c.post("/v1/jobs", headers=acme, json={"tasks": [{"id": "t", "handler": "shell",
                                                                  "args": {"cmd": cmd}}]})
            assert r.status_code == 202, r.text
            ids.append(r.json()["job_id"])

    def ended(job_id: str) -> dict[str, Any] | None:
        j: dict[str, Any] = c.get(f"/v1/jobs/{job_id}", headers=acme).json()
        return j if j.get("state") in ("succeeded", "failed", "cancelled") else None

    states: dict[str, int] = {}
    refused = checked = leaked = mismatched = downloaded = 0
    names: list[str] = []
    for job_id in ids:
        j = _wait(functools.partial(ended, job_id), 120) or {}
        states[j.get("state", "timeout")] = states.get(j.get("state", "timeout"), 0) + 1
    alive = leftovers()  # every task has ended: any marked process is a leftover that outlived its task
    for job_id in ids:
        task = c.get(f"/v1/jobs/{job_id}/tasks/t", headers=acme).json()
        for out in task.get("outputs") or []:
            names.append(out["name"])
            h = hashlib.sha256()
            tail = b""
            with c.stream("GET", f"/v1/jobs/{job_id}/tasks/t/outputs/{out['name']}", headers=acme) as r:
                etag = r.headers.get("etag", "").strip('"')
                for chunk in r.iter_bytes():
                    h.update(chunk)
                    window = tail + chunk
                    leaked += any(s.encode() in window for s in secrets)
                    tail = window[-64:]
                    downloaded += len(chunk)
                status = r.status_code
            checked += 1
            refused += int(status != 200)
            mismatched += int(status == 200 and (h.hexdigest() != out.get("sha256") or h.hexdigest() != etag))
    return {"jobs": len(ids), "states": states, "outputs_downloaded": checked, "output_names": sorted(set(names)),
            "downloads_not_200": refused, "bytes_downloaded": downloaded,
            "secret_bytes_in_downloads": leaked, "digest_mismatches": mismatched,
            "leftovers_alive_after_tasks_ended": len(alive), "breaches": leaked + mismatched + len(alive)}


def gpu_job(c: httpx.Client, key: dict[str, str], steps: int, gpus: int, max_runtime_s: float,
            checkpoint: bool = False) -> str:
    r = c.post("/v1/gpu-jobs", headers=key, json={
        "model": "m", "params": {"steps": steps, "step_s": 0.05},
        "resources": {"gpus": gpus, "max_runtime_s": max_runtime_s, "checkpoint": checkpoint}})
    assert r.status_code == 202, r.text
    job_id: str = r.json()["job_id"]
    return job_id


def start_gpu_jobs(c: httpx.Client, acme: dict[str, str], beta: dict[str, str]) -> dict[str, str]:
    """acme's honest job (2 GPUs), beta's liar (1 GPU), beta's holder (2 GPUs: its quota of 3 is full) and
    beta's queued job (2 GPUs, waits on the quota)."""
    jobs = {"honest": gpu_job(c, acme, 100_000, 2, 3600, checkpoint=True)}
    _wait(lambda: c.get(f"/v1/gpu-jobs/{jobs['honest']}", headers=acme).json().get("allocation"), 60)
    jobs["liar"] = gpu_job(c, beta, 2400, 1, LIAR_DECLARED_S)
    jobs["holder"] = gpu_job(c, beta, 100_000, 2, 3600)
    _wait(lambda: all(c.get(f"/v1/gpu-jobs/{jobs[k]}", headers=beta).json().get("allocation")
                      for k in ("liar", "holder")), 60)
    jobs["queued"] = gpu_job(c, beta, 20, 2, 60)
    return jobs


def _task(c: httpx.Client, key: dict[str, str], job_id: str) -> dict[str, Any]:
    j: dict[str, Any] = c.get(f"/v1/gpu-jobs/{job_id}", headers=key).json()
    return j


def history(c: httpx.Client, key: dict[str, str], job_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = c.get(f"/v1/jobs/{job_id}/history", headers=key, params=params).json()
        out += page.get("events", [])
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def lying_runtimes(c: httpx.Client, acme: dict[str, str], beta: dict[str, str], admin: dict[str, str],
                   jobs: dict[str, str]) -> dict[str, Any]:
    """Waits until beta's liar has ended (or its declared runtime, the grace and the slack have passed)."""
    liar = _task(c, beta, jobs["liar"])
    started = (liar["task"] or {}).get("started_ms") or liar.get("created_ms") or 0
    limit_s = LIAR_DECLARED_S + RUNTIME_GRACE_S + SLACK_S
    left = max(started / 1000 + limit_s - time.time(), 1.0)
    liar = _wait(lambda: (lambda j: j if j["state"] in ("succeeded", "failed", "cancelled") else None)(
        _task(c, beta, jobs["liar"])), left) or _task(c, beta, jobs["liar"])
    ended = liar.get("ended_ms")
    held_s = round((ended - started) / 1000, 1) if ended and started else None
    honest = _task(c, acme, jobs["honest"])
    htask = honest["task"] or {}
    hist = [e["type"] for e in history(c, acme, jobs["honest"])]
    nodes = c.get("/v1/cluster/nodes", headers=admin).json()["nodes"]
    health = sorted({str(n.get("health")) for n in nodes})
    moved = int(bool(htask.get("requeues")) or htask.get("state") != "running"
                or any(t in hist for t in ("TaskRequeued", "TaskCheckpointing", "TaskReleased")))
    breaches = moved + int(health != ["healthy"]) + int(held_s is None or held_s > limit_s)
    return {"liar_declared_s": LIAR_DECLARED_S, "liar_work_s": 2400 * 0.05, "runtime_grace_s": RUNTIME_GRACE_S,
            "liar_state": liar["state"], "liar_reason": (liar.get("reason") or "")[:120],
            "liar_held_gpu_s": held_s, "honest_state": htask.get("state"), "honest_requeues": htask.get("requeues"),
            "honest_progress": htask.get("progress"), "node_health": health, "breaches": breaches}


def forged_grants(c: httpx.Client, acme: dict[str, str], jobs: dict[str, str],
                  artifacts: Path) -> dict[str, Any]:
    """What the forged records name (taken before the stack stops): acme's job's host, GPUs, checkpoint."""
    honest = _task(c, acme, jobs["honest"])
    alloc = honest.get("allocation") or {}
    hosts = alloc.get("hosts") or []
    node = hosts[0]["node_id"] if hosts else "default-node-0"
    gpus = list(hosts[0]["gpu_indices"]) if hosts else [0, 1]
    ckpt = (artifacts / "acme" / jobs["honest"] / "run" / "checkpoints" / "step-5.json").as_uri()
    return {"node": node, "gpus": gpus, "checkpoint_uri": ckpt, "alloc_id": alloc.get("alloc_id")}


def _grant(job_id: str, node: str, gpus: list[int], ckpt: str, attempt: int = 1) -> dict[str, Any]:
    return {"type": "dagfold.command.TaskAllocation", "job_id": job_id, "task_id": "run", "attempt": attempt,
            "pool": "default", "ts_ms": int(time.time() * 1000), "status": "granted", "alloc_id": "forged-1",
            "epoch": 1, "hosts": [{"node_id": node, "gpu_indices": gpus, "gpu_milli": 1000}],
            "reason": "", "checkpoint_uri": ckpt, "cause_offset": 0}


def produce_forged(data_dir: Path, queued: str, target: dict[str, Any]) -> dict[str, int]:
    """The forged grants, into the stopped stack's embedded log (as produce_misframed does)."""
    from dagfold.codec import default_codec
    from dagfold.config import COMMANDS, SCHEDULER_INTERNAL
    from dagfold.log.embedded import EmbeddedLog

    codec = default_codec()
    node, gpus, ckpt = target["node"], target["gpus"], target["checkpoint_uri"]
    log = EmbeddedLog(data_dir / "log")
    prod = log.producer("hostile-upstream")
    try:
        prod.send(COMMANDS, queued.encode(), codec.encode(_grant(queued, node, gpus, ckpt)))
        for rec in (_grant(queued, node, list(range(8)), ckpt),        # every GPU of the host: not the shape asked
                    _grant(queued, node, gpus, ckpt, attempt=2),       # an attempt the scheduler never made
                    _grant(queued, node, gpus, ckpt)):                 # the right shape, acme's GPUs and checkpoint
            prod.send(SCHEDULER_INTERNAL, queued.encode(), codec.encode(rec))
        prod.flush()
    finally:
        prod.close()
        log.close()
    return {"on_commands": 1, "on_scheduler_internal": 3}


def check_forged(c: httpx.Client, beta: dict[str, str], admin: dict[str, str], queued: str,
                 target: dict[str, Any], up_log: Path, grant_wait_s: float = 30.0) -> dict[str, Any]:
    """After the restart: the dead letter, the ignored reports, the agent's refusal; the job never started."""
    def dead() -> list[dict[str, Any]]:
        page = c.get("/v1/deadletters", headers=admin, params={"limit": 500}).json()
        return [d for d in page["deadletters"] if d.get("key") == queued]

    dl = _wait(dead, 60) or []
    ignored = _wait(lambda: [e for e in history(c, admin, queued) if e["type"] == "ReportIgnored"], 60) or []
    time.sleep(grant_wait_s + 5)  # the agent waits this long for the allocator's grant of a dispatch
    hist = history(c, admin, queued)
    task = _task(c, admin, queued)
    log_text = up_log.read_text(errors="replace") if up_log.exists() else ""
    refused = [ln for ln in log_text.splitlines() if queued in ln and "refused" in ln]
    started = any(e["type"] in ("TaskStarted", "TaskSucceeded") for e in hist)
    ckpt_named = target["checkpoint_uri"] in str(hist) or target["checkpoint_uri"] in str(task)
    dl_ok = any("taken only from scheduler.internal" in d["reason"] for d in dl)
    return {"forged_on": target, "dead_letters_on_commands": len(dl), "dead_letter_reason_ok": dl_ok,
            "report_ignored": [e.get("detail", "")[:80] for e in ignored],
            "taken_from_scheduler_internal": any(e["type"] == "TaskAllocated" for e in hist),
            "agent_refusals_logged": len(refused), "queued_job_state": (task.get("task") or {}).get("state"),
            "queued_job_started": started, "victim_checkpoint_named": ckpt_named,
            "breaches": int(started) + int(ckpt_named) + int(not dl_ok) + int(len(ignored) < 2)}


def forged_in_log(data_dir: Path, queued: str, target: dict[str, Any], forged: dict[str, Any]) -> None:
    """With the stack stopped again: every event and control record of the queued job, read from the log
    itself (the history's details are shortened): the dispatches it got and whether acme's checkpoint is
    named anywhere."""
    from dagfold.codec import default_codec
    from dagfold.config import CONTROL, EVENTS
    from dagfold.log import TopicPartition
    from dagfold.log.embedded import EmbeddedLog

    codec = default_codec()
    log = EmbeddedLog(data_dir / "log")
    mine = []
    try:
        for topic in (EVENTS, CONTROL):
            for p in range(log.partitions(topic)):
                for r in log.read(TopicPartition(topic, p), 0, 10_000_000):
                    rec = codec.decode(r.value)
                    if rec.get("job_id") == queued:
                        mine.append(rec)
    finally:
        log.close()
    named = target["checkpoint_uri"] in str(mine)
    forged["dispatches"] = [{k: d.get(k) for k in ("node_id", "alloc_id", "gpu_indices", "resume_checkpoint")}
                            for d in mine if d["type"].endswith("GpuTaskDispatch")]
    forged["victim_checkpoint_in_log"] = named
    forged["breaches"] += int(named) + int(any(r["type"].endswith("TaskStarted") for r in mine))


def secrets(keys: dict[str, str]) -> list[str]:
    return [*keys.values(), CALLBACK_SECRET, os.environ.get("DAGFOLD_CALLBACK_SECRET", CALLBACK_SECRET)]
