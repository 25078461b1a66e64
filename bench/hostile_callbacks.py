"""Hostile callbacks and mis-framed records against a live `dagfold up` (issue 24; driven by bench/hostile_api.py).

Three probe classes:

* **callback destinations at submission** (every round, tenant beta): ``callback_url`` at 127.0.0.1 (the
  canary receiver and the API's own port), ``2130706433``, ``0x7f.1``, ``127.1``, ``[::1]``,
  ``[::ffff:127.0.0.1]``, ``localhost``, 10.0.0.1, 192.168.1.1, 169.254.169.254: a breach is a 2xx.
* **callback destinations at delivery** (once): GPU jobs whose ``callback_url`` is a DNS name resolving to
  127.0.0.1 (this machine's host name), cancelled so that their callbacks are sent: a breach is any request
  at the canary receiver on 127.0.0.1, or a status that shows more than ``refused_destination``.
* **slow receivers** (once): beta submits 12 jobs whose receiver (on 127.0.0.2, the one range the run
  allows) sends one byte a second; then acme submits one whose receiver answers at once. A breach is acme's
  callback arriving later than one attempt deadline after its job ended, a drip answer read to its end (an
  attempt outliving its deadline), or beta holding more than its share of the delivery slots.
* **mis-framed records** (once, offline): HTTP cannot choose a record's framing (the API encodes), so the
  run stops `dagfold up`, produces every command schema's body under every other command schema's
  fingerprint straight into the embedded log's ``commands`` topic (what an upstream producer with write
  access could do), starts `dagfold up` again and reads ``/v1/deadletters``: a breach is a record the codec
  refuses that did not become a dead letter.
"""

from __future__ import annotations

import functools
import io
import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

# the notifier's settings for the run: loopback is denied but for 127.0.0.2 (the slow and fast receivers)
ALLOWED = "127.0.0.2/32"
TIMEOUT_S = 2.0
TENANT_SLOTS = 4
ENV = {"DAGFOLD_CALLBACK_ALLOW": ALLOWED, "DAGFOLD_CALLBACK_TIMEOUT_S": str(TIMEOUT_S),
       "DAGFOLD_CALLBACK_MAX_ATTEMPTS": "2", "DAGFOLD_CALLBACK_BASE_BACKOFF_S": "0.2",
       "DAGFOLD_CALLBACK_MAX_BACKOFF_S": "0.5", "DAGFOLD_CALLBACK_CONCURRENCY": "8",
       "DAGFOLD_CALLBACK_TENANT_CONCURRENCY": str(TENANT_SLOTS)}
SLOW_JOBS = 12
DRIP_MS = 1000


def submission_probes(canary_port: int, api_port: int) -> list[tuple[str, str, bytes]]:
    """(method, path, JSON body) of jobs whose callback_url is a denied literal: each must answer 4xx."""
    import json

    urls = [f"http://127.0.0.1:{canary_port}/x", f"http://127.0.0.1:{api_port}/v1/jobs",
            f"http://2130706433:{canary_port}/", f"http://0x7f.1:{canary_port}/", f"http://127.1:{canary_port}/",
            f"http://[::1]:{canary_port}/", f"http://[::ffff:127.0.0.1]:{canary_port}/",
            f"http://localhost:{canary_port}/", "http://10.0.0.1/hook", "https://192.168.1.1/hook",
            "http://169.254.169.254/latest/meta-data/", "http://100.64.0.1/", "http://[fd00::1]/"]
    out = []
    for u in urls:
        out.append(("POST", "/v1/jobs", json.dumps({"tasks": [{"id": "a"}], "callback_url": u}).encode()))
        out.append(("POST", "/v1/gpu-jobs", json.dumps({"model": "m", "pool": "hostile", "callback_url": u}).encode()))
    return out


def _wait(cond: Callable[[], Any], timeout_s: float, poll_s: float = 0.2) -> Any:
    """``cond()``'s first truthy value within ``timeout_s``, else None (the probe reports what it saw)."""
    from tests.api_support import wait_until

    try:
        return wait_until(cond, timeout_s=timeout_s, interval_s=poll_s)
    except AssertionError:
        return None


def delivery_probes(c: httpx.Client, beta: dict[str, str], canary: Any) -> dict[str, Any]:
    """GPU jobs calling back to a DNS name that resolves to loopback: refused at delivery, shown coarsely."""
    name = socket.gethostname()
    addrs = sorted({i[4][0] for i in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)})
    ids = []
    for i in range(3):
        r = c.post("/v1/gpu-jobs", headers=beta, json={"model": "m", "pool": "hostile",
                                                        "callback_url": f"http://{name}:{canary.port}/n{i}"})
        if r.status_code == 202:
            ids.append(r.json()["job_id"])
    for job_id in ids:
        c.post(f"/v1/gpu-jobs/{job_id}/cancel", headers=beta)
    shown: dict[str, Any] = {}
    breaches = 0

    def ended(job_id: str) -> dict[str, Any] | None:
        cb: dict[str, Any] = c.get(f"/v1/gpu-jobs/{job_id}", headers=beta).json().get("callback", {})
        return cb if cb.get("state") in ("gave_up", "delivered") else None

    for job_id in ids:
        cb = _wait(functools.partial(ended, job_id), 60) or {}
        shown[job_id] = cb
        if cb.get("state") != "gave_up" or cb.get("failure") != "refused_destination" or \
                {"last_status", "last_error", "reason"} & set(cb):
            breaches += 1
    breaches += len(canary.requests)
    return {"name": name, "resolves_to": addrs, "jobs": len(ids), "statuses": list(shown.values())[:1],
            "canary_requests": len(canary.requests), "breaches": breaches}


def slow_probe(c: httpx.Client, beta: dict[str, str], acme: dict[str, str], slow: Any) -> dict[str, Any]:
    """12 of beta's callbacks to a receiver dripping a byte a second, then one of acme's to a fast one."""
    for i in range(SLOW_JOBS):
        c.post("/v1/jobs", headers=beta,
               json={"tasks": [{"id": "a"}], "callback_url": slow.url(f"/drip/{DRIP_MS}/{i}")})
    _wait(lambda: slow.dripping >= min(TENANT_SLOTS, SLOW_JOBS), 60, 0.05)
    r = c.post("/v1/jobs", headers=acme, json={"tasks": [{"id": "a"}], "callback_url": slow.url("/hook/acme")})
    job_id = r.json()["job_id"]
    got = _wait(lambda: [q for q in slow.requests if q.path == "/hook/acme"], 60, 0.02)
    ended = _wait(lambda: c.get(f"/v1/jobs/{job_id}", headers=acme).json().get("ended_ms"), 30)
    wait_s = round(got[0].at - ended / 1000, 3) if got and ended else None
    _wait(lambda: slow.dripping == 0 and len([q for q in slow.requests if q.path.startswith("/drip/")])
          >= SLOW_JOBS * 2, 120, 0.2)  # every slow delivery tried twice and cut off
    breaches = int(wait_s is None or wait_s > TIMEOUT_S) + slow.finished + int(slow.most_dripping > TENANT_SLOTS)
    return {"slow_jobs": SLOW_JOBS, "drip_byte_every_ms": DRIP_MS, "attempt_deadline_s": TIMEOUT_S,
            "tenant_slots": TENANT_SLOTS, "other_tenant_callback_wait_s": wait_s,
            "most_slow_attempts_at_once": slow.most_dripping, "drip_answers_read_to_the_end": slow.finished,
            "slow_attempts": len([q for q in slow.requests if q.path.startswith("/drip/")]), "breaches": breaches}


def produce_misframed(data_dir: Path) -> dict[str, int]:
    """Every command body under every other command fingerprint, into the stopped stack's embedded log."""
    import fastavro
    from fastavro.utils import generate_many

    from dagfold.codec import MAGIC, default_codec
    from dagfold.config import COMMANDS
    from dagfold.exceptions import CodecError
    from dagfold.log.embedded import EmbeddedLog

    codec = default_codec()
    commands = [n for n in codec.names() if n.startswith("dagfold.command.")]
    random.seed(24)
    log = EmbeddedLog(data_dir / "log")
    prod = log.producer("hostile-upstream")
    sent = refused = 0
    try:
        for writer in commands:
            rs = codec.schema(writer)
            for rec in generate_many(rs.parsed, 2):
                buf = io.BytesIO()
                fastavro.schemaless_writer(buf, rs.parsed, rec)
                for framing in commands:
                    if framing == writer:
                        continue
                    value = MAGIC + codec.schema(framing).fingerprint + buf.getvalue()
                    try:
                        codec.decode(value)
                    except CodecError:
                        refused += 1
                        prod.send(COMMANDS, f"misframed-{sent}".encode(), value)
                        sent += 1
        prod.flush()
    finally:
        prod.close()
        log.close()
    return {"command_schemas": len(commands), "misframed_records": sent, "codec_refuses": refused}


def count_framing_dead_letters(c: httpx.Client, admin: dict[str, str], expected: int) -> int:
    """Dead letters from ``commands`` whose reason is a framing or body error (waits for ``expected``)."""
    def count() -> int:
        n, cursor = 0, None
        while True:
            params: dict[str, Any] = {"limit": 500}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/deadletters", headers=admin, params=params).json()
            n += sum(1 for d in page["deadletters"] if (d.get("key") or "").startswith("misframed-")
                     and any(w in d["reason"] for w in ("bytes after the record", "corrupt")))
            cursor = page.get("next_cursor")
            if not cursor:
                return n

    found = _wait(lambda: (lambda k: k if k >= expected else None)(count()), 120, 1.0)
    return found if found is not None else count()
