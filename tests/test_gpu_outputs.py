"""GPU jobs as a product on the real stack (scheduler, allocator, simulated hosts running the demo job,
projector, notifier, API): the file a job writes comes back through its status, its callback and the
download route, on the local artifact folder and on a real S3-compatible server (S3Proxy on
loopback); only the owning tenant can read it; a preempted job's SSE stream shows the seed's states
in order; CPU tasks return their outputs too."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dagfold.artifacts import LocalArtifactStore, output_files, output_prefix, valid_name
from dagfold.config import Config
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.handlers import HandlerRegistry
from tests.api_support import free_port, wait_until
from tests.callback_support import Receiver, allow_loopback
from tests.gpu_support import gpu_stack
from tests.s3_support import S3Server

KEY_A, KEY_B = "key-studio-a-0001", "key-studio-b-0002"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}



@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGFOLD_API_KEYS", f"{KEY_A}:studio-a,{KEY_B}:studio-b")
    allow_loopback(monkeypatch)  # the callback receiver is on 127.0.0.1


def returns_its_file(tmp_path: Path, artifacts_url: str) -> None:
    with Receiver() as receiver, gpu_stack(tmp_path, artifacts_url) as stack:
        base = f"http://127.0.0.1:{stack.config.api_port}"
        body = {"job_id": "video-1", "model": "sora-mini", "prompt": "a red fox in snow", "pool": "gpu",
                "params": {"steps": 8, "step_s": 0.02}, "callback_url": receiver.url("/done"),
                "resources": {"gpus": 1, "checkpoint": True}}
        r = httpx.post(f"{base}/v1/gpu-jobs", json=body, headers=A, timeout=10)
        assert r.status_code == 202, r.text
        ended = stack.wait_job("video-1", timeout_s=90)
        assert ended is not None and ended["state"] == "succeeded", ended
        st = httpx.get(f"{base}/v1/gpu-jobs/video-1", headers=A, timeout=10).json()
        assert st["status"] == "COMPLETED" and st["task"]["progress"] == 1.0
        assert st["result"] == {"steps": 8, "resumed_from": 0}
        [out] = st["outputs"]
        assert (out["name"], out["content_type"]) == ("sample.json", "application/json")
        assert out["uri"].startswith("s3://" if artifacts_url else "file://")
        got = httpx.get(f"{base}{out['download']}", headers=A, timeout=10)
        assert got.status_code == 200 and got.headers["content-type"].startswith("application/json")
        assert hashlib.sha256(got.content).hexdigest() == out["sha256"] and len(got.content) == out["size"]
        assert json.loads(got.content)["prompt"] == "a red fox in snow"
        generic = httpx.get(f"{base}/v1/jobs/video-1/tasks/run/outputs/sample.json", headers=A, timeout=10)
        assert generic.content == got.content

        [req] = receiver.wait_for("video-1")
        [cb] = req.json["outputs"]
        assert (cb["sha256"], cb["size"], cb["uri"]) == (out["sha256"], out["size"], out["uri"])
        assert httpx.get(f"{base}{cb['download']}", headers=A, timeout=10).content == got.content

        # another tenant sees neither the job nor its file (the same 404 as a job that does not exist)
        for path in (out["download"], "/v1/jobs/video-1/tasks/run/outputs/sample.json", "/v1/gpu-jobs/video-1"):
            denied = httpx.get(f"{base}{path}", headers=B, timeout=10)
            assert denied.status_code == 404 and denied.json()["error"]["code"] == "not_found", path
        missing = httpx.get(f"{base}/v1/gpu-jobs/video-1/outputs/..%2F..%2Fetc%2Fpasswd", headers=A, timeout=10)
        assert missing.status_code == 404
        presigned = httpx.get(f"{base}{out['download']}", params={"presign": "true"}, headers=A, timeout=10)
        if artifacts_url:
            assert presigned.status_code == 200, presigned.text
            assert httpx.get(presigned.json()["url"], timeout=10).content == got.content  # no API key needed
        else:
            assert presigned.status_code == 409
        assert not stack.failed, stack.errors


def test_a_gpu_job_returns_its_file_on_the_local_artifact_folder(tmp_path: Path, keys: None) -> None:
    returns_its_file(tmp_path, "")


def test_a_gpu_job_returns_its_file_on_s3(tmp_path: Path, keys: None, s3: S3Server) -> None:
    returns_its_file(tmp_path, s3.url("artifacts", "dagfold"))


def test_the_s3_store_round_trips_outputs_and_checkpoints(tmp_path: Path, s3: S3Server) -> None:
    from dagfold.artifacts import open_store

    store = open_store(s3.url("unit"), tmp_path)
    (tmp_path / "out" / "frames").mkdir(parents=True)
    (tmp_path / "out" / "frames" / "0.png").write_bytes(b"\x89PNG" + bytes(range(256)) * 40_000)  # 10 MB
    [art] = store.upload_outputs(tmp_path / "out", "acme/job/run/1/outputs/")
    assert art.uri == "s3://unit/acme/job/run/1/outputs/frames/0.png" and art.content_type == "image/png"
    assert b"".join(store.iter_bytes(store.key_of(art.uri) or "")) == (tmp_path / "out/frames/0.png").read_bytes()
    ck = tmp_path / "ck"
    (ck / "step-5").mkdir(parents=True)
    (ck / "step-5" / "model.bin").write_bytes(b"weights")
    uri = store.upload_checkpoint(ck / "step-5", "acme/job/run/checkpoints/")
    back = store.fetch_checkpoint(uri, tmp_path / "resume")
    assert (back / "model.bin").read_bytes() == b"weights"
    assert store.delete_prefix("acme/job/run/checkpoints/") == 1 and not store.list("acme/job/run/checkpoints/")


def sse_states(base: str, job_id: str, timeout_s: float) -> Iterator[str]:
    """The job's seed states from its SSE stream's history frames, consecutive repeats dropped."""
    last = None
    with httpx.stream("GET", f"{base}/v1/gpu-jobs/{job_id}/events", params={"timeout_s": timeout_s},
                      headers=A, timeout=timeout_s + 10) as r:
        assert r.status_code == 200
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                frame, buf = buf.split("\n\n", 1)
                if "event: history" not in frame:
                    continue
                state = json.loads(frame.split("data: ", 1)[1]).get("gpu_state")
                if state and state != last:
                    last = state
                    yield state


def test_a_preempted_jobs_sse_stream_shows_the_seed_states_in_order(tmp_path: Path, keys: None) -> None:
    with gpu_stack(tmp_path, gpus=2) as stack:
        base = f"http://127.0.0.1:{stack.config.api_port}"
        low = {"job_id": "std", "model": "m", "pool": "gpu", "tier": "standard", "params": {"steps": 80,
               "step_s": 0.05}, "resources": {"gpus": 2, "checkpoint": True}}
        assert httpx.post(f"{base}/v1/gpu-jobs", json=low, headers=A, timeout=10).status_code == 202
        wait_until(lambda: httpx.get(f"{base}/v1/gpu-jobs/std", headers=A, timeout=10).json()["status"]
                   == "RUNNING", "the standard job runs", timeout_s=60)
        time.sleep(0.5)
        high = {**low, "job_id": "ent", "tier": "enterprise", "params": {"steps": 4, "step_s": 0.02}}
        assert httpx.post(f"{base}/v1/gpu-jobs", json=high, headers=A, timeout=10).status_code == 202
        states = list(sse_states(base, "std", timeout_s=90))
        assert states == ["QUEUED", "ASSIGNED", "RUNNING", "CHECKPOINTING", "QUEUED", "ASSIGNED", "RUNNING",
                          "COMPLETED"], states
        st = httpx.get(f"{base}/v1/gpu-jobs/std", headers=A, timeout=10).json()
        assert st["status"] == "COMPLETED" and st["task"]["progress"] == 1.0
        assert st["result"]["resumed_from"] > 0  # it went on from its checkpoint, read back from storage
        assert httpx.get(f"{base}/v1/gpu-jobs/ent", headers=A, timeout=10).json()["status"] == "COMPLETED"
        assert not stack.failed, stack.errors


def test_a_cpu_task_returns_what_it_wrote_to_its_output_dir(tmp_path: Path, keys: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    auth = tmp_path / "auth.yaml"  # shell is a capability: enabled on the stack, granted to studio-a
    auth.write_text("tenants:\n  studio-a: {handlers: [noop, sleep, shell]}\n")
    monkeypatch.setenv("DAGFOLD_AUTH_FILE", str(auth))
    cfg = Config(data_dir=tmp_path / "data", partitions=2, dispatch_partitions=2, api_port=free_port())
    with Stack(cfg, StackOptions(workers=1, registry=HandlerRegistry.with_builtins(shell=True))) as stack:
        base = f"http://127.0.0.1:{cfg.api_port}"
        spec = {"id": "cpu-1", "tasks": [{"id": "render", "handler": "shell", "args": {
            "cmd": 'mkdir -p "$DAGFOLD_OUTPUT_DIR/frames" && printf frame > "$DAGFOLD_OUTPUT_DIR/frames/0.txt" '
                   '&& ln -s /etc/hostname "$DAGFOLD_OUTPUT_DIR/leak"'}}]}
        assert httpx.post(f"{base}/v1/jobs", json=spec, headers=A, timeout=10).status_code == 202
        ended = stack.wait_job("cpu-1", timeout_s=60)
        assert ended is not None and ended["state"] == "succeeded", ended
        task = httpx.get(f"{base}/v1/jobs/cpu-1/tasks/render", headers=A, timeout=10).json()
        assert [o["name"] for o in task["outputs"]] == ["frames/0.txt"]  # the symlink is never uploaded
        got = httpx.get(f"{base}/v1/jobs/cpu-1/tasks/render/outputs/frames/0.txt", headers=A, timeout=10)
        assert got.status_code == 200 and got.content == b"frame"
        assert httpx.get(f"{base}/v1/jobs/cpu-1/tasks/render/outputs/frames/0.txt", headers=B,
                         timeout=10).status_code == 404
        assert not stack.failed, stack.errors


def test_output_names_and_keys_never_leave_their_folder(tmp_path: Path) -> None:
    for bad in ("", "/etc/passwd", "../x", "a/../../b", "a//b", "a\\b", "x\x00y", "./a"):
        assert not valid_name(bad), bad
    assert valid_name("frames/0001.png")
    assert output_prefix("t/../x", "job/1", "..", 2) == "t%2F..%2Fx/job%2F1/%2E%2E/2/outputs/"
    assert output_prefix("", ".", "t", 1) == "%/%2E/t/1/outputs/"
    store = LocalArtifactStore(tmp_path / "store")
    assert store.key_of((tmp_path / "elsewhere").as_uri()) is None
    assert store.key_of(store.uri("a/../../escape")) is None
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ok.bin").write_bytes(b"1")
    (tmp_path / "out" / "link").symlink_to(tmp_path / "out" / "ok.bin")
    assert [n for n, _ in output_files(tmp_path / "out")] == ["ok.bin"]


def test_a_success_report_of_the_previous_schema_still_decodes_without_outputs() -> None:
    import io

    import fastavro
    from fastavro.schema import load_schema

    from dagfold.codec import MAGIC, default_codec, schema_fingerprint

    old = load_schema(str(Path(__file__).parent.parent / "schemas/history/v1/dagfold.command.TaskSucceeded.avsc"))
    buf = io.BytesIO()
    buf.write(MAGIC + schema_fingerprint(old))
    fastavro.schemaless_writer(buf, old, {"job_id": "j", "task_id": "t", "attempt": 1, "worker_id": "w",
                                          "ts_ms": 1, "result_json": None, "stdout_tail": "", "stderr_tail": ""})
    rec = default_codec().decode(buf.getvalue())
    assert rec["outputs"] == [] and rec["type"] == "dagfold.command.TaskSucceeded"
