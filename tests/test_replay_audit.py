"""Audit replay and job timelines against a live stack's log (embedded; read-only next to the writer)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from dagfold.services.scheduler import keys
from dagfold.state import PartitionStore, PartitionTransaction
from tests.cli_support import ROOT, UpProcess, dagfold


def test_replay_verify_audit_and_tamper_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGFOLD_HANDLERS", "noop,sleep,shell")  # examples/failing.yaml runs shell tasks
    data = tmp_path / "data"
    up = UpProcess(data).start()
    try:
        jobs = [up.submit((ROOT / f"examples/{n}.yaml").read_text()) for n in ("failing", "diamond", "fanout-1000")]
        for j in jobs:
            up.wait(j)
        failing = jobs[0]

        # a full replay next to the running stack equals the live state
        r = dagfold("replay", "--data", str(data), "--out", str(tmp_path / "r1"), "--verify", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["differences"] == [] and report["applied"] > 2000

        # one job's replay, and its verification
        r = dagfold("replay", "--data", str(data), "--out", str(tmp_path / "r2"), "--job", failing, "--verify")
        assert r.returncode == 0 and "no difference" in r.stdout, r.stdout + r.stderr

        # the timeline has every command and event, with coordinates and causes
        a = dagfold("audit", failing, "--data", str(data))
        assert a.returncode == 0, a.stderr
        rows = json.loads(a.stdout)
        types = [x["type"] for x in rows]
        assert types[0] == "dagfold.command.SubmitJob" and "dagfold.event.JobFailed" in types
        failed = next(x for x in rows if x["type"] == "dagfold.event.TaskFailed")
        assert failed["task_id"] == "bad" and failed["reason"] == "exit code 3" and failed["attempt"] == 1
        cause = next(x for x in rows if x["topic"] == "commands" and x["offset"] == failed["cause_offset"])
        assert cause["type"] == "dagfold.command.TaskFailed" and cause["worker_id"]
        c = dagfold("audit", failing, "--data", str(data), "--format", "csv")
        header = next(csv.reader(io.StringIO(c.stdout)))
        assert header[:4] == ["topic", "partition", "offset", "timestamp_ms"]
        assert dagfold("audit", "no-such-job", "--data", str(data)).returncode == 1
        assert dagfold("replay", "--data", str(data), "--out", str(tmp_path / "r1")).returncode == 2  # not empty
    finally:
        up.stop()

    # tamper with the live state: verify must name the job
    from dagfold.log import partition_for

    p = partition_for(failing.encode(), 8)
    store = PartitionStore(data / "scheduler" / f"p{p:04d}")
    txn = PartitionTransaction(store)
    job = dict(txn.get(keys.job(failing)))
    job["state"] = "succeeded"
    txn.put(keys.job(failing), job)
    txn.commit()
    store.close()
    r = dagfold("replay", "--data", str(data), "--out", str(tmp_path / "r3"), "--verify")
    assert r.returncode == 1
    assert f"partition {p} job {failing}: job state differs" in r.stdout
