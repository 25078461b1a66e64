"""Audit replay by time: --from/--to/--job and their combinations, audit --since/--until, and a
replayed folder served read-only (`dagfold serve`).

Three jobs run one after the other on an embedded-log stack, with a time mark between them:
A before T1, B in [T1, T2], C after T2.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from dagfold.services.scheduler.replay import job_ids
from dagfold.state import PartitionStore
from tests.cli_support import DAGFOLD, ROOT, UpProcess, dagfold, free_port


def _mark() -> int:
    time.sleep(0.05)
    t = int(time.time() * 1000)
    time.sleep(0.05)
    return t


def _state_jobs(out: Path) -> set[str]:
    found: set[str] = set()
    for p in sorted((out / "scheduler").iterdir()):
        store = PartitionStore(p, read_only=True)
        try:
            found |= job_ids(store)
        finally:
            store.close()
    return found


def _replay(data: Path, out: Path, *args: str) -> dict:  # type: ignore[type-arg]
    r = dagfold("replay", "--data", str(data), "--out", str(out), "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


def test_replay_windows_audit_range_and_read_only_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGFOLD_HANDLERS", "noop,sleep,shell")  # examples/failing.yaml runs shell tasks
    data = tmp_path / "data"
    diamond = (ROOT / "examples/diamond.yaml").read_text()
    up = UpProcess(data).start()
    try:
        a = up.submit(diamond)
        up.wait(a)
        t1 = _mark()
        b = up.submit((ROOT / "examples/failing.yaml").read_text())
        up.wait(b)
        t2 = _mark()
        c = up.submit('{"tasks": [{"id": "x", "handler": "noop"}]}', "application/json")
        up.wait(c)
    finally:
        up.stop()
    assert len({a, b, c}) == 3

    # --from T1: state rebuilt from the start (A kept: the old replay dropped it), window = B and C
    r = _replay(data, tmp_path / "from", "--from", str(t1), "--events", str(tmp_path / "from.jsonl"))
    assert _state_jobs(tmp_path / "from") == {a, b, c}
    assert r["window"]["jobs"] == 2 and r["applied"] > r["window"]["events"] > 0
    assert r["window"]["by_type"]["JobFailed"] == 1 and r["window"]["by_type"]["JobAccepted"] == 2
    lines = [json.loads(x) for x in (tmp_path / "from.jsonl").read_text().splitlines()]
    assert len(lines) == r["window"]["events"] and {x["job_id"] for x in lines} == {b, c}
    assert all(x["timestamp_ms"] >= t1 for x in lines)

    # --to T1: the state as of T1 (only A), and every applied event is in the window
    r = _replay(data, tmp_path / "to", "--to", str(t1))
    assert _state_jobs(tmp_path / "to") == {a}
    assert r["window"]["events"] == r["applied"] and r["window"]["jobs"] == 1

    # --from T1 --to T2: B's events reported, state has A and B, not C
    r = _replay(data, tmp_path / "ft", "--from", str(t1), "--to", str(t2))
    assert _state_jobs(tmp_path / "ft") == {a, b}
    assert r["window"]["jobs"] == 1 and r["window"]["by_type"]["JobAccepted"] == 1

    # --job A --from T1: A is rebuilt whole, nothing of it is in the window
    r = _replay(data, tmp_path / "ja", "--job", a, "--from", str(t1))
    assert _state_jobs(tmp_path / "ja") == {a} and r["applied"] > 0 and r["window"]["events"] == 0

    # --job B --from T1 --to T2: all of B, all in the window
    r = _replay(data, tmp_path / "jb", "--job", b, "--from", str(t1), "--to", str(t2))
    assert _state_jobs(tmp_path / "jb") == {b} and r["window"]["events"] == r["applied"] > 0

    # --job C --to T2: C had not started by then
    r = _replay(data, tmp_path / "jc", "--job", c, "--to", str(t2))
    assert r["applied"] == 0 and not _state_jobs(tmp_path / "jc")

    # refusals: an empty window, --verify with --to
    r1 = dagfold("replay", "--data", str(data), "--out", str(tmp_path / "bad"), "--from", str(t2), "--to", str(t1))
    assert r1.returncode == 2 and "after --to" in r1.stderr
    r1 = dagfold("replay", "--data", str(data), "--out", str(tmp_path / "bad"), "--to", str(t1), "--verify")
    assert r1.returncode == 2 and "drop --to" in r1.stderr
    # --verify with --from: the state is a full replay, equal to live
    r = _replay(data, tmp_path / "fv", "--from", str(t1), "--verify")
    assert r["differences"] == []

    # audit --since/--until
    rows = json.loads(dagfold("audit", a, "--data", str(data), "--until", str(t1)).stdout)
    assert rows and all(x["timestamp_ms"] <= t1 for x in rows)
    assert json.loads(dagfold("audit", a, "--data", str(data), "--since", str(t1)).stdout) == []
    full = json.loads(dagfold("audit", b, "--data", str(data)).stdout)
    assert json.loads(dagfold("audit", b, "--data", str(data), "--since", str(t1), "--until", str(t2)).stdout) == full
    r1 = dagfold("audit", b, "--data", str(data), "--since", str(t2), "--until", str(t1))
    assert r1.returncode == 2 and "after --until" in r1.stderr

    # the --from replay served read-only: A (accepted before T1) is there; writes are refused
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([*DAGFOLD, "serve", str(tmp_path / "from"), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "dagfold serve did not start"
            try:
                health = httpx.get(api + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert health.json() == {"status": "ok", "read_only": True}
        assert httpx.get(f"{api}/v1/jobs/{a}").json()["state"] == "succeeded"
        assert httpx.get(f"{api}/v1/jobs/{b}").json()["state"] == "failed"
        assert httpx.get(f"{api}/ui/").status_code == 200
        r2 = httpx.post(f"{api}/v1/jobs", content=diamond, headers={"content-type": "application/yaml"})
        assert r2.status_code == 405 and r2.json()["error"]["code"] == "read_only"
        assert httpx.post(f"{api}/v1/jobs/{a}/cancel").status_code == 405
    finally:
        proc.terminate()
        proc.wait(10)
    r1 = dagfold("serve", str(tmp_path / "nothing"))
    assert r1.returncode == 2 and "no read model" in r1.stderr
