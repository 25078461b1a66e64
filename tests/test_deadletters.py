"""Dead letters visible and recoverable: /v1/deadletters (admin only with auth), `dagfold deadletters`
(list, --since, --json, show, resubmit), paging, hostile records shown bounded and as text, and a
dead-lettered SubmitJob resubmitted and run to success. Embedded-log stack in this process."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from dagfold.cli import app
from dagfold.codec import default_codec
from dagfold.commands import cancel_job, submit_job
from dagfold.config import COMMANDS, Config
from dagfold.deadletters import PREVIEW_CHARS
from dagfold.services.api.app import create_app
from dagfold.services.api.auth import AuthConfig
from dagfold.services.stack import Stack, StackOptions
from tests.cli_support import free_port

HOSTILE = b"<script>alert(1)</script>[red]boom[/red]" + b"\x00" * 5000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str, str]]:
    port = free_port()
    cfg = Config.from_env(log_url="embedded", data_dir=tmp_path_factory.mktemp("dl") / "data", api_port=port)
    with Stack(cfg, StackOptions(workers=1, callbacks=False)) as st:
        codec = default_codec()
        spec = {"job_id": "dl-job-1", "tenant": "acme", "tasks": [{"id": "a", "handler": "noop"}]}
        from dagfold.jobspec import parse_spec, to_job_spec

        job_spec = to_job_spec(parse_spec({"id": "dl-job-1", "tenant": "acme", "tasks": spec["tasks"]}))
        prod = st.log.producer("upstream")  # type: ignore[union-attr]
        # a SubmitJob keyed by something else than its job ID (an upstream producer's bug): dead-lettered
        prod.send(COMMANDS, b"orders/42", codec.encode(submit_job(job_spec, source="upstream")))
        prod.send(COMMANDS, b"dl-hostile", HOSTILE)  # not Avro at all
        prod.send(COMMANDS, b"other-key", codec.encode(cancel_job("dl-job-1")))  # misrouted, not a SubmitJob
        prod.flush()
        prod.close()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{url}/v1/deadletters").json()["deadletters"]) < 3:
            assert time.monotonic() < deadline, "the scheduler did not dead-letter the three records"
            time.sleep(0.2)
        yield st, url, str(port)


def _by_type(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The three dead letters as (CancelJob, undecodable, SubmitJob)."""
    by = {d["record_type"]: d for d in items}
    return [by["dagfold.command.CancelJob"], by[None], by["dagfold.command.SubmitJob"]]


def cli(url: str, *args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", "DAGFOLD_API": url})


def test_list_api_and_cli(stack: tuple[Stack, str, str]) -> None:
    _, url, _ = stack
    items = httpx.get(f"{url}/v1/deadletters").json()["deadletters"]
    assert sorted(str(d["record_type"]) for d in items) == [
        "None", "dagfold.command.CancelJob", "dagfold.command.SubmitJob"]
    assert [d["ts_ms"] for d in items] == sorted((d["ts_ms"] for d in items), reverse=True)  # newest first
    cancel, hostile, submit = _by_type(items)
    assert submit["source_topic"] == COMMANDS and submit["service"] == "scheduler"
    assert submit["reason"].startswith("record key b'orders/42' is not the job ID")
    assert submit["job_id"] == "dl-job-1" and submit["job_state"] is None and submit["resubmittable"]
    assert '"handler": "noop"' in submit["preview"] and submit["key"] == "orders/42"
    assert hostile["reason"] and hostile["preview"].startswith("undecodable")
    assert "<script>" not in hostile["preview"] and len(hostile["preview"]) <= PREVIEW_CHARS
    assert hostile["value_bytes"] == len(HOSTILE) and not hostile["resubmittable"]
    assert {d["source_offset"] for d in items} == {submit["source_offset"], hostile["source_offset"],
                                                    cancel["source_offset"]}

    # paging: one at a time, newest first, no repeats, then no cursor
    seen, cursor = [], None
    while True:
        page = httpx.get(f"{url}/v1/deadletters", params={"limit": 1, **({"cursor": cursor} if cursor else {})}).json()
        seen += [d["id"] for d in page["deadletters"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == [d["id"] for d in items]
    future = int(time.time() * 1000) + 60_000
    assert httpx.get(f"{url}/v1/deadletters", params={"since": future}).json() == {"deadletters": [],
                                                                                   "next_cursor": None}
    assert httpx.get(f"{url}/v1/deadletters", params={"cursor": "x"}).status_code == 400
    assert httpx.get(f"{url}/v1/deadletters/zz-1").status_code == 400
    assert httpx.get(f"{url}/v1/deadletters/0-999999").status_code == 404
    assert httpx.get(f"{url}/v1/deadletters/{submit['id']}").json()["id"] == submit["id"]

    r = cli(url, "deadletters", "--json")
    assert r.exit_code == 0 and [d["id"] for d in json.loads(r.stdout)] == [d["id"] for d in items]
    r = cli(url, "deadletters")
    assert r.exit_code == 0 and "is not the job ID" in r.stdout and "commands/" in r.stdout
    assert "3 dead letter(s)" in r.stdout
    r = cli(url, "deadletters", "--since", str(future))
    assert r.exit_code == 0 and "no dead letters" in r.stdout
    r = cli(url, "deadletters", "show", hostile["id"])
    assert r.exit_code == 0 and "undecodable" in r.stdout and "[red]" not in r.stdout
    assert (Path(__file__).parents[1] / "services/api/static/deadletters.js").exists()
    assert httpx.get(f"{url}/ui/static/deadletters.js").status_code == 200


def test_resubmit_after_fix(stack: tuple[Stack, str, str]) -> None:
    st, url, _ = stack
    cancel, hostile, submit = _by_type(httpx.get(f"{url}/v1/deadletters").json()["deadletters"])
    r = cli(url, "deadletters", "resubmit", hostile["id"])
    assert r.exit_code == 2 and "undecodable" in r.output
    r = cli(url, "deadletters", "resubmit", cancel["id"])
    assert r.exit_code == 1 and "not_resubmittable" in r.output
    r = cli(url, "deadletters", "resubmit", submit["id"])
    assert r.exit_code == 0 and "resubmitted" in r.stdout and "dl-job-1" in r.stdout, r.output
    job = st.wait_job("dl-job-1", 30)
    assert job is not None and job["state"] == "succeeded" and job["tenant"] == "acme"
    r = cli(url, "deadletters", "resubmit", submit["id"], "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["resubmitted"] is False  # idempotent
    shown = httpx.get(f"{url}/v1/deadletters/{submit['id']}").json()
    assert shown["job_state"] == "succeeded"


def test_admin_only_with_auth(stack: tuple[Stack, str, str]) -> None:
    st, _, _ = stack
    auth = AuthConfig.from_env(None, env={"DAGFOLD_API_KEYS": "k-admin-0000001:admin,k-acme-00000001:acme"})
    api = create_app(st.log, st.read_model, st.config, auth=auth)
    with TestClient(api, base_url="http://127.0.0.1") as c:
        assert c.get("/v1/deadletters").status_code == 401
        r = c.get("/v1/deadletters", headers={"Authorization": "Bearer k-acme-00000001"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert c.post("/v1/deadletters/0-0/resubmit",
                      headers={"Authorization": "Bearer k-acme-00000001"}).status_code == 403
        r = c.get("/v1/deadletters", headers={"Authorization": "Bearer k-admin-0000001"})
        assert r.status_code == 200 and len(r.json()["deadletters"]) == 3
