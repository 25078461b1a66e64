"""The HTTP API's trust boundary, black-box (issue 12: bullets 3, 4, 6, 7 and the 5xx cases).

Every test sends what an attacker or a careless client would (through HTTP, the CLI or the log as an upstream
producer writes it) and checks the answer: a 4xx naming the rule, never a 5xx, a crash or another tenant's
data. Each one failed on b705dec: the API read any body as YAML and checked neither Host nor Origin, expanded
YAML aliases, raised RecursionError on deep documents, accepted free-form identifiers, let a tenant write into
another tenant's job history, and the CLI put IDs into paths unescaped and read data as rich markup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from dagfold.cli import app as cli_app
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.parsing import MAX_DEPTH
from dagfold.services.api.auth import AuthConfig
from dagfold.services.api.guard import GuardConfig
from dagfold.services.scheduler.harness import FoldHarness
from tests.api_support import T0, ApiHarness, LiveServer, accepted, ev, free_port

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"acme": "k-sec-acme-000001", "beta": "k-sec-beta-000001", "admin": "k-sec-admin-00001"}
H = {who: {"Authorization": f"Bearer {k}"} for who, k in KEYS.items()}
JSON = {"content-type": "application/json"}
YAML = {"content-type": "application/yaml"}
SPEC = {"tasks": [{"id": "a"}]}

# The 525-byte billion-laughs document of the issue: nine levels of nine aliases (9^9 strings once expanded).
ALIAS_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{c}: &{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    + ["tasks: [{id: x, args: {v: *i}}]"])


class Shared(ApiHarness):
    baseline = 0

    def sent_nothing(self) -> bool:
        """No command reached the log since the test began."""
        return len(self.commands()) == self.baseline


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    a = Shared(tmp_path_factory.mktemp("sec"))
    yield a
    a.close()


@pytest.fixture
def api(_shared: Shared) -> Shared:
    """One API for the module (a harness per case cost a second each); each test sees its own baseline."""
    _shared.baseline = len(_shared.commands())
    return _shared


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[ApiHarness]:
    env = {"DAGFOLD_API_KEYS": ",".join(f"{k}:{who}" for who, k in KEYS.items())}
    a = ApiHarness(tmp_path, auth=AuthConfig.from_env(None, env=env))
    yield a
    a.close()


def code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


# -- bullet 3: browsers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "127.0.0.1.nip.io", "[::2]:80"])
def test_a_host_that_is_not_loopback_is_refused_dns_rebinding(api: Shared, host: str) -> None:
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/metrics")):
        r = api.client.request(method, path, headers={"host": host, **JSON}, content=json.dumps(SPEC))
        assert r.status_code == 403 and code(r) == "host_not_allowed", (method, path, r.text)
    assert api.sent_nothing()


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.0.0.2"])
def test_loopback_hosts_and_configured_names_are_served(tmp_path: Path, host: str) -> None:
    a = ApiHarness(tmp_path, guard=GuardConfig.from_env("127.0.0.1", env={"DAGFOLD_API_ALLOWED_HOSTS": "api.corp"}))
    try:
        assert a.client.get("/v1/jobs", headers={"host": host}).status_code == 200
        assert a.client.get("/v1/jobs", headers={"host": "api.corp:443"}).status_code == 200
        assert a.client.get("/v1/jobs", headers={"host": "evil.corp"}).status_code == 403
    finally:
        a.close()


@pytest.mark.parametrize("headers", [
    {"origin": "http://attacker.example"},
    {"origin": "null"},  # a sandboxed frame or a file:// page
    {"origin": "http://127.0.0.1:9999"},  # another local port is another origin
    {"sec-fetch-site": "cross-site"},
    {"sec-fetch-site": "same-site", "origin": "http://127.0.0.1"},
])
def test_cross_origin_writes_from_a_browser_are_refused(api: Shared, headers: dict[str, str]) -> None:
    for path in ("/v1/jobs", "/v1/gpu-jobs", "/v1/jobs/x/cancel", "/v1/jobs/x/redrive"):
        body = {"model": "m"} if "gpu" in path else SPEC
        r = api.client.post(path, content=json.dumps(body), headers={**JSON, **headers})
        assert r.status_code == 403 and code(r) == "cross_origin", (path, r.text)
    assert api.sent_nothing()
    # reads stay readable to the dashboard, and the browser's same-origin POST is served
    assert api.client.get("/v1/jobs", headers={"sec-fetch-site": "cross-site"}).status_code == 200
    same = {"origin": "http://127.0.0.1", "sec-fetch-site": "same-origin"}
    assert api.client.post("/v1/jobs", content=json.dumps(SPEC), headers={**JSON, **same}).status_code == 202


@pytest.mark.parametrize("ctype", [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/octet-stream"])
def test_job_specs_only_as_json_or_yaml(api: Shared, ctype: str | None) -> None:
    """What a page may send without a CORS preflight (and a body without a type) is never read as a spec."""
    headers = {"content-type": ctype} if ctype else {}
    r = api.client.post("/v1/jobs", content=b"tasks: [{id: a, handler: shell, args: {cmd: id}}]", headers=headers)
    assert r.status_code == 415 and code(r) == "unsupported_media_type", r.text
    r = api.client.post("/v1/gpu-jobs", content=b'{"model": "m"}', headers=headers)
    assert r.status_code == 415
    assert api.client.post("/v1/gpu-jobs", content=b'{"model": "m"}', headers=YAML).status_code == 415
    assert api.sent_nothing()
    for t in ("application/json", "application/yaml", "application/x-yaml", "text/yaml; charset=utf-8"):
        assert api.client.post("/v1/jobs", content=b'{"tasks": [{"id": "a"}]}', headers={"content-type": t}
                               ).status_code == 202, t


def test_local_token_guards_every_api_call_but_not_the_dashboard_page(tmp_path: Path) -> None:
    a = ApiHarness(tmp_path, guard=GuardConfig(token="tok-0123456789abcdef"))
    try:
        c = a.client
        for r in (c.get("/v1/jobs"), c.get("/metrics"), c.get("/v1/jobs", headers={"authorization": "Bearer nope"}),
                  c.post("/v1/jobs", content=json.dumps(SPEC), headers=JSON)):
            assert r.status_code == 401 and code(r) == "unauthorized"
        assert c.get("/v1/jobs", headers={"authorization": "Bearer tok-0123456789abcdef"}).status_code == 200
        assert c.get("/v1/jobs", headers={"x-api-key": "tok-0123456789abcdef"}).status_code == 200
        assert c.get("/healthz").status_code == 200 and c.get("/ui/").status_code == 200
    finally:
        a.close()


def test_the_cli_finds_the_local_token_without_a_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dagfold.localtoken import token_path, write_token

    monkeypatch.setenv("DAGFOLD_TOKEN_DIR", str(tmp_path / "tokens"))
    monkeypatch.delenv("DAGFOLD_API_TOKEN", raising=False)
    monkeypatch.delenv("DAGFOLD_API_KEY", raising=False)
    a = ApiHarness(tmp_path, guard=GuardConfig(token="tok-cli-0123456789"))
    try:
        with LiveServer(a.app) as srv:
            env = {"COLUMNS": "200", "DAGFOLD_API": srv.url}
            r = CliRunner().invoke(cli_app, ["jobs"], env=env)
            assert r.exit_code == 1 and "local token" in r.output
            path = write_token("127.0.0.1", srv.port, "tok-cli-0123456789")
            assert path == token_path("localhost", srv.port) and oct(path.stat().st_mode & 0o777) == "0o600"
            assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
            r = CliRunner().invoke(cli_app, ["jobs"], env=env)
            assert r.exit_code == 0, r.output
    finally:
        a.close()


# -- bullet 4: parsing cannot be amplified ------------------------------------------------------------------

def _peak_bytes(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_yaml_alias_bomb_is_refused_before_it_expands(api: Shared) -> None:
    body = ALIAS_BOMB.encode()
    assert len(body) <= 600
    answers: list[httpx.Response] = []
    peak = _peak_bytes(lambda: answers.append(api.client.post("/v1/jobs", content=body, headers=YAML)))
    [r] = answers
    assert r.status_code == 400 and code(r) == "yaml_alias" and "aliases" in r.json()["error"]["reason"]
    assert peak < 8 * 2**20, f"refusing 525 bytes allocated {peak / 2**20:.1f} MiB"
    assert api.sent_nothing()
    # an anchor alone, or a merge key, is refused the same way
    for doc in ("x: &x 1\ntasks: [{id: a}]\n", "base: &b {handler: noop}\ntasks: [{<<: *b, id: a}]\n"):
        assert code(api.client.post("/v1/jobs", content=doc.encode(), headers=YAML)) == "yaml_alias"


@pytest.mark.parametrize(("kind", "path"), [("json", "/v1/jobs"), ("yaml", "/v1/jobs"), ("json", "/v1/gpu-jobs")])
def test_a_10k_deep_document_is_a_400_naming_the_limit(api: Shared, kind: str, path: str) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    body = f'{{"tasks": [{{"id": "a", "args": {{"x": {deep}}}}}], "model": "m"}}'
    answers: list[httpx.Response] = []
    peak = _peak_bytes(lambda: answers.append(api.client.post(
        path, content=body.encode(), headers={"content-type": f"application/{kind}"})))
    [r] = answers
    assert r.status_code == 400 and code(r) == "too_deep", r.text
    assert str(MAX_DEPTH) in r.json()["error"]["reason"]
    assert peak < 8 * 2**20


def test_depth_64_is_accepted_and_65_refused(api: Shared) -> None:
    def doc(depth: int) -> bytes:  # spec { tasks [ task { args { x ... } } } ]: four levels before x
        inner = "[" * (depth - 4) + "]" * (depth - 4)
        return f'{{"tasks": [{{"id": "a", "args": {{"x": {inner}}}}}]}}'.encode()

    assert api.client.post("/v1/jobs", content=doc(MAX_DEPTH), headers=JSON).status_code == 202
    assert code(api.client.post("/v1/jobs", content=doc(MAX_DEPTH + 1), headers=JSON)) == "too_deep"
    assert code(api.client.post("/v1/jobs", content=doc(MAX_DEPTH + 1), headers=YAML)) == "too_deep"


def test_a_large_yaml_body_is_refused_on_its_raw_size(api: Shared) -> None:
    body = b"tasks: [{id: a}]\n#" + b"x" * (9 * 2**20)
    r = api.client.post("/v1/jobs", content=body, headers=YAML)
    assert r.status_code == 413 and "limit" in r.json()["error"]["reason"]


@pytest.mark.parametrize(("body", "ctype"), [
    ('{"tasks": [{"id": "a", "resources": {"gpus": 1, "max_runtime_s": Infinity}}]}', "json"),
    ('{"tasks": [{"id": "a", "timeouts": {"start_to_close_s": NaN}}]}', "json"),
    ("tasks: [{id: a, resources: {gpus: 1, max_runtime_s: .inf}}]", "yaml"),
    ("tasks: [{id: a, timeouts: {heartbeat_s: .nan}}]", "yaml"),
    ("tasks: [{id: a, args: {x: .nan}}]", "yaml"),
    ('{"tasks": [{"id": "a", "retry": {"max_attempts": true}}]}', "json"),
    ('{"tasks": [{"id": "a", "resources": {"gpus": true}}]}', "json"),
    ('{"tasks": [{"id": "a", "retry": {"max_attempts": 3.5}}]}', "json"),
    ('{"tasks": [{"id": "a", "retry": {"initial_interval_s": 1e308}}]}', "json"),
])
def test_numbers_are_finite_and_never_booleans(api: Shared, body: str, ctype: str) -> None:
    r = api.client.post("/v1/jobs", content=body.encode(), headers={"content-type": f"application/{ctype}"})
    assert r.status_code == 400, r.text
    assert api.sent_nothing()
    gpu = {"model": "m", "resources": {"gpus": 1, "max_runtime_s": float("inf")}}
    r = api.client.post("/v1/gpu-jobs", content=json.dumps(gpu).encode(), headers=JSON)
    assert r.status_code == 400 and "Infinity" in r.json()["error"]["reason"]


# -- bullet 6: job IDs per tenant ---------------------------------------------------------------------------

def test_another_tenants_job_id_answers_409_at_once(tenants: ApiHarness) -> None:
    c = tenants.client
    assert c.post("/v1/jobs", json={"id": "shared-id", **SPEC}, headers=H["acme"]).status_code == 202
    tenants.accept_submitted(ts=T0)
    r = c.post("/v1/jobs", json={"id": "shared-id", "tasks": [{"id": "other"}]}, headers=H["beta"])
    assert r.status_code == 409 and code(r) == "job_id_taken"
    assert [cmd["spec"]["tenant"] for cmd in tenants.commands()] == ["acme"]  # nothing reached the log
    # the owner still sees its job; the other tenant gets the same 404 as for a missing job
    assert c.get("/v1/jobs/shared-id", headers=H["acme"]).status_code == 200
    assert c.get("/v1/jobs/shared-id", headers=H["beta"]).json() == c.get("/v1/jobs/no-such", headers=H["beta"]
                                                                             ).json() | {
        "error": {"code": "not_found", "reason": "job 'shared-id' not found"}}


def test_a_racing_submission_of_another_tenant_never_enters_the_jobs_history(tenants: ApiHarness) -> None:
    """Both submissions reach the scheduler (as from two API processes, or an upstream producer): the second
    is rejected there, and its JobRejected stays out of the first tenant's job and history."""
    fold = FoldHarness()
    a = to_job_spec(load_spec_text("{id: race, tenant: acme, tasks: [{id: a}]}"))
    b = to_job_spec(load_spec_text("{id: race, tenant: beta, tasks: [{id: b}]}"))
    fold.submit(a)
    fold.submit(b)
    assert [e["type"].rsplit(".", 1)[1] for e in fold.events] == ["JobAccepted", "TaskDispatched", "JobRejected"]
    tenants.project(*[{**e, "ts_ms": e.get("ts_ms") or T0} for e in fold.events])
    hist = tenants.client.get("/v1/jobs/race/history", headers=H["acme"]).json()["events"]
    assert [e["type"] for e in hist] == ["JobAccepted", "TaskDispatched"]
    job = tenants.client.get("/v1/jobs/race", headers=H["acme"]).json()
    assert job["state"] == "running" and job["tenant"] == "acme" and job.get("code") is None


def test_the_loser_of_a_job_id_race_sees_its_own_submission_rejected(tenants: ApiHarness) -> None:
    """The scheduler decided a race for job ID 'g' (a GPU job): beta's GET of the job and of the GPU job shows
    its own submission rejected with job_id_taken (it was 404 forever), with nothing of acme's job."""
    fold = FoldHarness()
    gpu = {"handler": "gpu", "queue": "default", "resources": {"gpus": 1}}
    fold.submit(to_job_spec(load_spec_text(json.dumps({"id": "g", "tenant": "acme", "name": "acme's",
                                                       "tasks": [{"id": "train", **gpu}]}))))
    fold.submit(to_job_spec(load_spec_text(json.dumps({"id": "g", "tenant": "beta", "tasks": [{"id": "t", **gpu}]}))))
    rejected = fold.events[-1]
    assert (rejected["type"], rejected["code"], rejected["tenant"]) == ("dagfold.event.JobRejected", "job_id_taken",
                                                                        "beta")
    tenants.project(*[{**e, "ts_ms": e.get("ts_ms") or T0} for e in fold.events])
    c = tenants.client
    mine = c.get("/v1/jobs/g", headers=H["beta"]).json()
    assert (mine["state"], mine["code"], mine["tenant"], mine["name"]) == ("rejected", "job_id_taken", "beta", None)
    status = c.get("/v1/gpu-jobs/g", headers=H["beta"]).json()
    assert (status["state"], status["status"], status["code"], status["task"]) == (
        "rejected", "FAILED", "job_id_taken", None)
    assert c.get("/v1/gpu-jobs/g", headers=H["acme"]).json()["tenant"] == "acme"
    for route in ("/v1/jobs/g/events", "/v1/gpu-jobs/g/events"):  # its own stream: the rejection, then end
        frames = c.get(route, headers=H["beta"]).text
        assert '"code":"job_id_taken"' in frames and 'event: end\ndata: {"job_id":"g","state":"rejected"}' in frames
        assert "acme" not in frames and "TaskDispatched" not in frames, frames
    assert c.get("/v1/jobs/g/tasks", headers=H["beta"]).status_code == 404  # nothing more of acme's job
    assert c.get("/v1/jobs?tenant=beta", headers=H["beta"]).json()["jobs"] == []


def test_truly_concurrent_submissions_of_one_job_id_give_the_loser_a_clear_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tenants submit the same explicit job ID at the same instant to a running stack, so both pass the
    API's check before either job is projected: the loser gets 409 job_id_taken, or 202 and then its GET (and
    `dagfold watch`) shows its own submission rejected with job_id_taken, never the winner's job and never
    404 (it was 202 and 404 forever). The winner's job and history stay its own."""
    import threading

    from dagfold.config import Config
    from dagfold.services.stack import Stack, StackOptions

    auth = tmp_path / "auth.yaml"
    auth.write_text("keys: {" + ", ".join(f"{k}: {who}" for who, k in KEYS.items()) + "}\n")
    monkeypatch.setenv("DAGFOLD_AUTH_FILE", str(auth))
    cfg = Config(data_dir=tmp_path / "data", partitions=2, api_port=free_port())
    raced = 0
    with Stack(cfg, StackOptions(workers=0)) as stack, httpx.Client(base_url=f"http://127.0.0.1:{cfg.api_port}",
                                                                     timeout=30) as c:
        for n in range(12):  # until one round raced (under load the first often lands before the second)
            if raced:
                break
            job_id = f"race-{n}"
            gate = threading.Barrier(2)
            answers: dict[str, httpx.Response] = {}

            def submit(who: str, job_id: str = job_id, gate: threading.Barrier = gate,
                       answers: dict[str, httpx.Response] = answers) -> None:
                body = {"id": job_id, "name": f"{who}'s", "tasks": [{"id": f"{who}-task"}]}
                gate.wait()
                answers[who] = c.post("/v1/jobs", json=body, headers=H[who])

            threads = [threading.Thread(target=submit, args=(who,)) for who in ("acme", "beta")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            deadline = time.monotonic() + 20
            while (owner := stack.read_model.job_tenant(job_id)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert owner in ("acme", "beta"), answers
            loser = "beta" if owner == "acme" else "acme"
            assert answers[owner].status_code == 202, answers[owner].text
            if answers[loser].status_code == 409:
                assert code(answers[loser]) == "job_id_taken"
                continue
            assert answers[loser].status_code == 202, answers[loser].text
            raced += 1
            while True:  # its own view of its submission: rejected, job_id_taken
                mine = c.get(f"/v1/jobs/{job_id}", headers=H[loser])
                if mine.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert mine.status_code == 200, mine.text
            view = mine.json()
            assert (view["state"], view["code"], view["tenant"]) == ("rejected", "job_id_taken", loser), view
            assert view["name"] is None and view["total_tasks"] == 0  # nothing of the winner's job
            theirs = c.get(f"/v1/jobs/{job_id}", headers=H[owner]).json()
            assert (theirs["tenant"], theirs["name"], theirs["code"]) == (owner, f"{owner}'s", None)
            hist = c.get(f"/v1/jobs/{job_id}/history", headers=H[owner]).json()["events"]
            assert "JobRejected" not in [e["type"] for e in hist]
            assert c.get(f"/v1/jobs/{job_id}/history", headers=H[loser]).status_code == 404
            again = c.post("/v1/jobs", json={"id": job_id, **SPEC}, headers=H[loser])
            assert again.status_code == 409 and code(again) == "job_id_taken"
            w = CliRunner().invoke(cli_app, ["watch", job_id, "--api", str(c.base_url), "--api-key", KEYS[loser],
                                             "--timeout", "20"])
            assert w.exit_code == 2 and "rejected" in w.output and "already taken" in w.output, w.output
        assert not stack.failed, stack.errors
    assert raced >= 1, "no round raced: both submissions must pass the API's check before either is projected"


def test_the_tenant_is_checked_before_the_job_record_is_decoded(tenants: ApiHarness,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    big = accepted("big", [f"t{i}" for i in range(2)], tenant="acme")
    big["spec"]["labels"] = {f"k{i}": "v" * 256 for i in range(64)}
    tenants.project(big)
    decoded: list[str] = []
    real = tenants.rm.get_job
    monkeypatch.setattr(tenants.rm, "get_job", lambda j: decoded.append(j) or real(j))
    for path in ("/v1/jobs/big", "/v1/jobs/big/tasks", "/v1/jobs/big/history", "/v1/jobs/big/graph",
                 "/v1/gpu-jobs/big"):
        assert tenants.client.get(path, headers=H["beta"]).status_code == 404
    assert tenants.client.post("/v1/jobs/big/cancel", headers=H["beta"]).status_code == 404
    assert decoded == []  # never read for the other tenant
    assert tenants.client.get("/v1/jobs/big", headers=H["acme"]).status_code == 200 and decoded == ["big"]


# -- bullet 7: one table of identifier rules ----------------------------------------------------------------

BAD_FIELDS: list[tuple[str, Any]] = [
    ("id", "."), ("id", ".."), ("id", "a/b"), ("id", "a\x00b"), ("id", "x" * 300),
    ("tenant", "[/bold]"), ("tenant", "a/b"), ("tenant", "t\x1b[31m"), ("tenant", "x" * 1_000_000),
    ("tier", "gold\x00"), ("tier", ".."),
    ("idempotency_key", "k\x00"), ("idempotency_key", "k" * 1_000_000), ("idempotency_key", "\x1b]0;pwn\x07"),
    ("labels", {f"k{i}": "v" for i in range(65)}), ("labels", {"k": "v" * 1_000_000}), ("labels", {"k\x00": "v"}),
    ("name", "n\x1b[2J"),
    ("callback_url", "http://x/" + "a" * 5000),
]
BAD_TASK_FIELDS: list[tuple[str, Any]] = [
    ("id", "."), ("id", ".."), ("id", "a/b"), ("id", "a\x00"), ("id", "\x1b[31mred"), ("id", "x" * 300),
    ("handler", "sh\x00"), ("handler", "../x"), ("handler", "a/b"), ("handler", "x" * 1000),
    ("queue", ".."), ("queue", "q/1"), ("queue", "q\x00"),
    ("resources", {"gpus": 1, "gpu_type": "a/b"}), ("resources", {"gpus": 1, "gpu_type": ["x\x00"]}),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=lambda v: repr(v)[:30])
def test_bad_job_identifiers_are_refused_by_the_api(api: Shared, field: str, value: Any) -> None:
    r = api.client.post("/v1/jobs", content=json.dumps({field: value, **SPEC}), headers=JSON)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["reason"]
    assert api.sent_nothing()


@pytest.mark.parametrize(("field", "value"), BAD_TASK_FIELDS, ids=lambda v: repr(v)[:30])
def test_bad_task_identifiers_are_refused_by_the_api(api: Shared, field: str, value: Any) -> None:
    task = {"id": "a", field: value}
    r = api.client.post("/v1/jobs", content=json.dumps({"tasks": [task]}), headers=JSON)
    assert r.status_code == 400, r.text
    assert api.sent_nothing()


@pytest.mark.parametrize(("field", "value"), [("job_id", ".."), ("tenant", "[/bold]"), ("pool", "a/b"),
                                              ("idempotency_key", "\x00"), ("tenant", "x" * 1000)])
def test_bad_gpu_job_identifiers_are_refused(api: Shared, field: str, value: str) -> None:
    r = api.client.post("/v1/gpu-jobs", content=json.dumps({"model": "m", field: value}), headers=JSON)
    assert r.status_code == 422 and field in r.json()["error"]["reason"]
    assert api.sent_nothing()


def _upstream_spec(**changes: Any) -> dict[str, Any]:
    spec = to_job_spec(load_spec_text("{id: up, tasks: [{id: a}]}"))
    task_changes = changes.pop("task", {})
    spec.update(changes)
    spec["tasks"][0].update(task_changes)
    return spec


@pytest.mark.parametrize("changes", [
    {"job_id": ".."}, {"job_id": "."}, {"tenant": "[/bold]"}, {"tenant": "a\x00"}, {"tier": "x" * 100},
    {"idempotency_key": "k\x1b"}, {"labels": {f"k{i}": "v" for i in range(65)}}, {"labels": {"k": "v" * 300}},
    {"task": {"task_id": ".."}}, {"task": {"task_id": "a\x1b"}}, {"task": {"handler": "x/y"}},
    {"task": {"queue": "q\x00"}},
    {"task": {"resources": {"gpus": 1, "gpu_type": ["a/b"], "hosts": 1, "gpu_milli": 1000, "max_runtime_s": None,
                            "checkpoint": False}}},
    {"task": {"resources": {"gpus": 1, "gpu_type": [], "hosts": 1, "gpu_milli": 1000,
                            "max_runtime_s": float("inf"), "checkpoint": False}}},
], ids=lambda c: repr(c)[:40])
def test_the_scheduler_applies_the_same_rules_to_upstream_producers(changes: dict[str, Any]) -> None:
    """A SubmitJob written straight to the log (no API) is rejected by the fold with the same rule."""
    h = FoldHarness()
    spec = _upstream_spec(**changes)
    h.submit(spec)
    [ev_] = h.events
    assert ev_["type"] == "dagfold.event.JobRejected" and ev_["code"] == "invalid_field", ev_
    assert not h.dispatched


# -- 5xx on bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "param"), [("/v1/jobs", "created_after"), ("/v1/jobs", "created_before"),
                                              ("/v1/failures", "since")])
@pytest.mark.parametrize("value", ["²", "¹²", "-³", "١٢٣"])  # digits to str.isdigit, not to int()
def test_unicode_digits_in_query_params_are_a_400(api: Shared, path: str, param: str, value: str) -> None:
    r = api.client.get(path, params={param: value})
    assert r.status_code == 400 and param in r.json()["error"]["reason"], r.text


def test_a_job_record_of_the_log_that_was_never_validated_reads_back(api: Shared) -> None:
    """Old logs hold what earlier versions accepted: reads still answer (no 5xx) for those records."""
    api.project(accepted("old", ["a"], tenant="[/bold]"),
                ev("JobRejected", job_id="x\x1b", ts_ms=T0, tenant="t\x00", code="c", reason="[/red] r"))
    assert api.client.get("/v1/jobs/old").status_code == 200
    assert api.client.get("/v1/tenants").status_code == 200


# -- the CLI ------------------------------------------------------------------------------------------------

@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[ApiHarness, str]]:
    a = ApiHarness(tmp_path)
    a.project(
        accepted("JOB", ["a"], ts=T0),
        ev("TaskFailed", job_id="JOB", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 1, reason="boom",
           exit_code=1, final=True),
        ev("JobFailed", job_id="JOB", ts_ms=T0 + 2, reason="[/bold] a failed"),
        accepted("markup", ["[/bold]", "[red]x"], ts=T0 + 3, tenant="[/bold]"),  # from a log older than the rules
    )
    with LiveServer(a.app) as srv:
        yield a, srv.url
    a.close()


def _cli(url: str, *args: str) -> Any:
    return CliRunner().invoke(cli_app, list(args), env={"COLUMNS": "200", "DAGFOLD_API": url})


def test_cli_escapes_every_path_segment(live: tuple[ApiHarness, str]) -> None:
    api, url = live
    for args in (["cancel", "JOB/redrive#"], ["cancel", "JOB/redrive?x="], ["redrive", "../jobs/JOB/redrive#"],
                 ["cancel", ".."], ["attempts", "JOB", "a/../../redrive#"]):
        r = _cli(url, *args)
        assert r.exit_code != 0, (args, r.output)
    assert [c["type"] for c in api.commands()] == []  # no redrive, no cancel reached the log
    r = _cli(url, "redrive", "JOB")
    assert r.exit_code == 0 and [c["type"] for c in api.commands()] == ["dagfold.command.RedriveJob"]


def test_the_sdk_escapes_job_ids_in_paths(live: tuple[ApiHarness, str]) -> None:
    from dagfold.client.clients import ClientError, RestClient

    api, url = live
    with RestClient(url) as client:
        for ref in ("JOB/redrive#", "JOB/redrive?x=", ".."):
            with pytest.raises(ClientError):
                client.cancel(ref)
        assert client.status("JOB").state == "failed"
    assert api.commands() == []


def test_cli_never_reads_data_as_markup(live: tuple[ApiHarness, str]) -> None:
    _, url = live
    for args in (["jobs"], ["tenants"], ["tasks", "markup"], ["status", "JOB"], ["failures"], ["queues"]):
        r = _cli(url, *args)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.output)
        assert r.exit_code in (0, 1), (args, r.output)
    out = _cli(url, "tenants").output
    assert "[/bold]" in out
    assert "[/bold] a failed" in _cli(url, "status", "JOB").output


@pytest.mark.parametrize("api_url", ["http://127.0.0.1:1", "http://[::1", "htp://x"])
def test_cli_http_failures_are_one_line(api_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the console script's own entry (the app object), as `dagfold jobs --api URL` runs it."""
    with pytest.raises(SystemExit) as exit_:
        cli_app(["jobs", "--api", api_url], prog_name="dagfold")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err


# -- storage errors -----------------------------------------------------------------------------------------

FULL_DISK = r"""
set -e
d=$(mktemp -d)
mount -t tmpfs -o size=16m tmpfs "$d"
cd "$ROOT"
"$PY" - "$d" <<'EOF'
import json, subprocess, sys
from pathlib import Path
from tests.api_support import ApiHarness
d = Path(sys.argv[1])
api = ApiHarness(d / "api")
subprocess.run(["dd", "if=/dev/zero", f"of={d}/fill", "bs=64k"], capture_output=True)
spec = {"tasks": [{"id": f"t{i}", "args": {"pad": "x" * 2000}} for i in range(1000)]}
codes = [api.client.post("/v1/jobs", content=json.dumps(spec), headers={"content-type": "application/json"})
         for _ in range(3)]
print(json.dumps([[r.status_code, r.json()] for r in codes]))
EOF
rm -f "$d/fill"; mkdir -p "$d/up"
dd if=/dev/zero of="$d/fill" bs=64k 2>/dev/null || true
set +e
e=$(mktemp)  # outside the full disk
timeout 60 "$PY" -m dagfold up --data "$d/up/data" --port "$PORT" 2>"$e" >/dev/null
echo "rc=$?"
cat "$e"
rm -f "$e"
"""


def test_a_full_disk_is_a_503_and_one_line_at_start(tmp_path: Path) -> None:
    """ENOSPC on a small tmpfs of a private mount namespace (needs root or user namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1): cannot make a full disk here")
    cmd = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-rm"]
    probe = subprocess.run([*cmd, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    r = subprocess.run([*cmd, "bash", "-c", FULL_DISK], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "ROOT": str(ROOT), "PY": sys.executable, "PYTHONPATH": str(ROOT),
                            "PORT": str(free_port())})
    lines = r.stdout.splitlines()
    answers = json.loads(lines[0])
    assert any(status == 503 for status, _ in answers), answers
    assert all(status in (202, 503) for status, _ in answers), answers
    reasons = [body["error"]["reason"] for status, body in answers if status == 503]
    assert all("no space left on device" in reason for reason in reasons), reasons
    assert lines[1] != "rc=0" and lines[1].startswith("rc="), r.stdout
    err_lines = [ln for ln in lines[2:] if ln.strip()]
    assert len(err_lines) == 1 and "no space left on device" in err_lines[0], (r.stdout, r.stderr)
