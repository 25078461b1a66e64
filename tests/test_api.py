"""The HTTP API on an embedded log: submissions become commands, reads come from the read model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dagfold.codec import default_codec, make
from dagfold.config import COMMANDS, EVENTS, Config
from dagfold.jobspec import job_id_for
from dagfold.log.base import TopicPartition, partition_for
from dagfold.log.embedded import EmbeddedLog
from dagfold.projections import Projector, ReadModel
from dagfold.services.api import create_app

T0 = 1_700_000_000_000

YAML_SPEC = """\
tenant: acme
idempotency_key: nightly-2024-01-01
failure_policy: fail_fast
tasks:
  - id: extract
    handler: shell
    args: {cmd: "echo hi"}
  - id: load
    depends_on: [extract]
    queue: io
"""


class Api:
    def __init__(self, tmp: Path, max_body_bytes: int | None = None) -> None:
        self.config = Config(partitions=4)
        self.log = EmbeddedLog(tmp / "log")
        self.log.create_topics(self.config.core_topics())
        self.projector = Projector(self.log, tmp / "read")
        self.rm = ReadModel(self.projector.store)
        self.app = create_app(self.log, self.rm, self.config, max_body_bytes=max_body_bytes)
        self.client = TestClient(self.app, base_url="http://127.0.0.1")

    def commands(self) -> list[tuple[int, bytes, dict[str, Any]]]:
        out = []
        for p in range(self.log.partitions(COMMANDS)):
            for r in self.log.read(TopicPartition(COMMANDS, p), 0, 1000):
                assert r.key is not None
                out.append((r.partition, r.key, default_codec().decode(r.value)))
        return out

    def project(self, *events: dict[str, Any]) -> None:
        producer = self.log.producer("test")
        for e in events:
            producer.send(EVENTS, e["job_id"].encode(), default_codec().encode(e))
        producer.flush()
        self.projector.catch_up(timeout_s=10)

    def close(self) -> None:
        self.client.close()
        self.projector.close()
        self.log.close()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = Api(tmp_path)
    yield a
    a.close()


def accepted(job_id: str, task_ids: list[str], ts: int = T0) -> dict[str, Any]:
    tasks = [make("dagfold.common.TaskSpec", task_id=t, handler="noop") for t in task_ids]
    spec = make("dagfold.common.JobSpec", job_id=job_id, tenant="acme", tasks=tasks)
    return make("dagfold.event.JobAccepted", job_id=job_id, ts_ms=ts, spec=spec)


def assert_error(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "reason"}
    if code is not None:
        assert body["error"]["code"] == code
    err: dict[str, Any] = body["error"]
    return err


def test_submit_json_produces_submit_job(api: Api) -> None:
    spec = {"id": "job-json", "tenant": "acme", "tasks": [{"id": "a"}, {"id": "b", "depends_on": ["a"]}]}
    resp = api.client.post("/v1/jobs", json=spec)
    assert resp.status_code == 202, resp.text
    assert resp.json()["job_id"] == "job-json" and resp.json()["state"] == "submitted"
    assert resp.headers["location"] == "/v1/jobs/job-json"
    [(partition, key, rec)] = api.commands()
    assert key == b"job-json" and partition == partition_for(key, api.config.partitions)
    assert rec["type"] == "dagfold.command.SubmitJob" and rec["source"] == "api"
    assert rec["spec"]["job_id"] == "job-json" and rec["spec"]["tenant"] == "acme"
    assert [t["task_id"] for t in rec["spec"]["tasks"]] == ["a", "b"]
    assert rec["spec"]["tasks"][1]["depends_on"] == ["a"]
    assert rec["submitted_at_ms"] > T0


@pytest.mark.parametrize("ctype", ["application/yaml", "text/yaml", "application/x-yaml"])
def test_submit_yaml(api: Api, ctype: str) -> None:
    resp = api.client.post("/v1/jobs", content=YAML_SPEC, headers={"content-type": ctype})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["job_id"]
    assert job_id == job_id_for("acme", "nightly-2024-01-01")  # idempotency key -> stable job ID
    [(_, key, rec)] = api.commands()
    assert key == job_id.encode()
    assert rec["spec"]["failure_policy"] == "fail_fast"
    assert json.loads(rec["spec"]["tasks"][0]["args_json"]) == {"cmd": "echo hi"}
    assert rec["spec"]["tasks"][1]["queue"] == "io"


def test_cyclic_spec_422_names_cycle(api: Api) -> None:
    spec = {"tasks": [{"id": "a", "depends_on": ["c"]}, {"id": "b", "depends_on": ["a"]},
                      {"id": "c", "depends_on": ["b"]}]}
    err = assert_error(api.client.post("/v1/jobs", json=spec), 422, "cycle")
    cycle = err["reason"].removeprefix("dependency cycle: ").split(" -> ")
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["a", "b", "c"]  # any rotation of a -> b -> c
    err = assert_error(api.client.post("/v1/jobs", json={"tasks": [{"id": "a", "depends_on": ["zz"]}]}), 422,
                       "unknown_dependency")
    assert "'zz'" in err["reason"]
    assert api.commands() == []


def test_malformed_specs_400(api: Api) -> None:
    err = assert_error(api.client.post("/v1/jobs", content="tasks: [a, {", headers={"content-type": "text/yaml"}),
                       400, "invalid_spec")
    assert "YAML" in err["reason"]
    err = assert_error(api.client.post("/v1/jobs", json={"tasks": [{"id": "a", "bogus_field": 1}]}), 400,
                       "invalid_spec")
    assert "tasks.0.bogus_field" in err["reason"]
    err = assert_error(api.client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}),
                       400, "invalid_spec")
    assert "JSON" in err["reason"]
    assert_error(api.client.post("/v1/jobs", content=b"", headers={"content-type": "application/json"}), 400)
    err = assert_error(api.client.post("/v1/jobs", json={"tasks": []}), 400, "invalid_spec")
    assert "tasks" in err["reason"]
    assert api.commands() == []


def test_body_limit_413(tmp_path: Path) -> None:
    a = Api(tmp_path, max_body_bytes=1024)
    try:
        big = {"tasks": [{"id": f"t{i}"} for i in range(200)]}
        assert_error(a.client.post("/v1/jobs", json=big), 413, "payload_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is checked
            yield json.dumps(big).encode()

        assert_error(a.client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"}),
                     413, "payload_too_large")
        assert a.client.post("/v1/jobs", json={"tasks": [{"id": "a"}]}).status_code == 202
    finally:
        a.close()


def test_unknown_job_404(api: Api) -> None:
    err = assert_error(api.client.get("/v1/jobs/nope"), 404, "not_found")
    assert "nope" in err["reason"]
    assert_error(api.client.get("/v1/jobs/nope/tasks"), 404, "not_found")
    assert_error(api.client.get("/v1/jobs/nope/history"), 404, "not_found")
    assert_error(api.client.get("/v1/jobs/nope/tasks/a/attempts"), 404, "not_found")
    assert_error(api.client.post("/v1/jobs/nope/cancel"), 404, "not_found")
    assert_error(api.client.get("/v1/no/such/route"), 404)
    assert_error(api.client.delete("/v1/jobs"), 405)
    assert api.commands() == []


def test_reads_after_projection(api: Api) -> None:
    api.project(
        accepted("j1", ["a", "b", "c"], ts=T0),
        accepted("j2", ["x"], ts=T0 + 5),
        make("dagfold.event.TaskDispatched", job_id="j1", task_id="a", attempt=1, ts_ms=T0 + 10, queue="default"),
        make("dagfold.event.LeaseGranted", job_id="j1", task_id="a", attempt=1, worker_id="w1", ts_ms=T0 + 20,
             lease_deadline_ms=T0 + 30_020),
        make("dagfold.event.TaskSucceeded", job_id="j1", task_id="a", attempt=1, worker_id="w1", ts_ms=T0 + 50),
        make("dagfold.event.JobRejected", job_id="j3", ts_ms=T0 + 7, tenant="beta", code="cycle",
             reason="dependency cycle: a -> a"),
    )
    job = api.client.get("/v1/jobs/j1").json()
    assert job["state"] == "running" and job["counts"]["succeeded"] == 1 and job["counts"]["pending"] == 2
    assert job["progress"] == pytest.approx(33.33) and job["total_tasks"] == 3

    tasks = api.client.get("/v1/jobs/j1/tasks", params={"limit": 2}).json()
    assert [t["task_id"] for t in tasks["tasks"]] == ["a", "b"] and tasks["next_cursor"]
    rest = api.client.get("/v1/jobs/j1/tasks", params={"limit": 2, "cursor": tasks["next_cursor"]}).json()
    assert [t["task_id"] for t in rest["tasks"]] == ["c"] and rest["next_cursor"] is None
    done = api.client.get("/v1/jobs/j1/tasks", params={"state": "succeeded"}).json()
    assert [t["task_id"] for t in done["tasks"]] == ["a"]
    assert api.client.get("/v1/jobs/j1/tasks/a").json()["worker_id"] == "w1"
    assert_error(api.client.get("/v1/jobs/j1/tasks/zz"), 404, "not_found")

    attempts = api.client.get("/v1/jobs/j1/tasks/a/attempts").json()["attempts"]
    assert [(x["attempt"], x["outcome"], x["worker_id"]) for x in attempts] == [(1, "succeeded", "w1")]

    hist = api.client.get("/v1/jobs/j1/history").json()
    assert [e["type"] for e in hist["events"]] == ["JobAccepted", "TaskDispatched", "LeaseGranted",
                                                   "TaskSucceeded"]
    assert hist["next_cursor"] is None

    listing = api.client.get("/v1/jobs").json()
    assert [j["job_id"] for j in listing["jobs"]] == ["j3", "j2", "j1"]
    assert [j["job_id"] for j in api.client.get("/v1/jobs", params={"tenant": "acme"}).json()["jobs"]] == [
        "j2", "j1"]
    rejected = api.client.get("/v1/jobs", params={"state": "rejected"}).json()["jobs"]
    assert [(j["job_id"], j["code"]) for j in rejected] == [("j3", "cycle")]
    page = api.client.get("/v1/jobs", params={"limit": 1}).json()
    page2 = api.client.get("/v1/jobs", params={"limit": 1, "cursor": page["next_cursor"]}).json()
    assert [j["job_id"] for j in page2["jobs"]] == ["j2"]

    assert_error(api.client.get("/v1/jobs", params={"limit": 5000}), 400, "invalid_request")
    assert_error(api.client.get("/v1/jobs", params={"state": "bogus"}), 400, "invalid_request")
    assert_error(api.client.get("/v1/jobs", params={"cursor": "!!!"}), 400, "invalid_cursor")


def test_cancel_produces_cancel_job(api: Api) -> None:
    api.project(accepted("j1", ["a"]))
    resp = api.client.post("/v1/jobs/j1/cancel", json={"reason": "no longer needed"})
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"job_id": "j1", "state": "cancel_requested"}
    assert api.client.post("/v1/jobs/j1/cancel").status_code == 202  # body optional
    cmds = api.commands()
    assert [(k, r["type"]) for _, k, r in cmds] == [(b"j1", "dagfold.command.CancelJob")] * 2
    assert cmds[0][2]["reason"] == "no longer needed" and cmds[1][2]["reason"] == "cancelled by user"
    assert cmds[0][0] == partition_for(b"j1", api.config.partitions)

    assert_error(api.client.post("/v1/jobs/j1/redrive"), 409, "not_redrivable")
    api.project(make("dagfold.event.JobCancelled", job_id="j1", ts_ms=T0 + 1, reason="no longer needed"))
    assert_error(api.client.post("/v1/jobs/j1/cancel"), 409, "job_finished")
    assert api.client.post("/v1/jobs/j1/redrive").status_code == 202
    assert api.commands()[-1][2]["type"] == "dagfold.command.RedriveJob"


def test_health_and_openapi(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    schema = api.client.get("/openapi.json").json()
    assert "/v1/jobs" in schema["paths"] and "JobSpecIn" in schema["components"]["schemas"]
    assert "TaskSpecIn" in schema["components"]["schemas"]
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert api.client.get("/docs").status_code == 200
