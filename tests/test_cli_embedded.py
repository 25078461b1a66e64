"""Black-box: the `dagfold` command on the embedded log, as a user runs it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.cli_support import ROOT, UpProcess, dagfold

WF = ROOT.parent / "shared" / "data" / "wfcommons"


def test_run_diamond_succeeds() -> None:
    r = dagfold("run", "examples/diamond.yaml")
    assert r.returncode == 0, r.stderr
    assert "succeeded" in r.stdout and "load" in r.stdout


def test_output_lines_are_not_broken_at_a_narrow_terminal_width() -> None:
    """Scripts read job IDs from the output: a line must not be split at the console width
    (rich assumed 80 columns when piped and broke long "submitted <file>: <id>" lines)."""
    r = dagfold("run", "examples/diamond.yaml", env={"COLUMNS": "30"})
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[0]
    assert line.startswith("job ") and line.endswith(": succeeded") and len(line) > 30, r.stdout


def test_run_cycle_is_rejected_naming_the_cycle() -> None:
    r = dagfold("run", "examples/cycle.yaml")
    assert r.returncode == 2
    assert "dependency cycle: b -> c -> a -> b" in r.stderr


def test_run_failing_exits_1_with_reason_and_skips() -> None:
    r = dagfold("run", "examples/failing.yaml")
    assert r.returncode == 1, r.stderr
    assert "exit code 3" in r.stdout and "skipped" in r.stdout


def test_run_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    r = dagfold("run", "does-not-exist.yaml")
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = dagfold("run", "pyproject.toml")
    assert r.returncode == 2 and "not valid YAML/JSON" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: [{id: a, handlr: noop}]")
    r = dagfold("run", str(bad))
    assert r.returncode == 2 and "invalid job spec: tasks.0.handlr" in r.stderr


def test_run_montage_workflow() -> None:
    r = dagfold("run", "--wfcommons", str(WF / "montage-chameleon-2mass-05d-001.json.gz"), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["job"]["state"] == "succeeded" and res["job"]["total_tasks"] == 1738
    assert len(res["tasks"]) == 1738  # every task, not the first page of 1,000


def test_up_submit_wait_history_and_client_commands(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "data", args=("--handlers", "noop,sleep,shell")).start()
    try:
        r = dagfold("submit", "examples/failing.yaml", "--wait", "--api", up.api)
        assert r.returncode == 1, r.stdout + r.stderr
        job_id = up.submit((ROOT / "examples/failing.yaml").read_text())
        up.wait(job_id)
        h = dagfold("history", job_id, "--api", up.api)
        assert h.returncode == 0
        assert "exit code 3" in h.stdout and "TaskSkipped" in h.stdout
        s = dagfold("status", job_id, "--api", up.api, "--json")
        assert s.returncode == 0 and '"failed"' in s.stdout
        t = dagfold("tasks", job_id, "--api", up.api)
        assert t.returncode == 0 and "after_bad" in t.stdout
        r = dagfold("submit", "examples/cycle.yaml", "--api", up.api)
        assert r.returncode == 2 and "cycle" in r.stderr
        r = dagfold("status", "no-such-job", "--api", up.api)
        assert r.returncode != 0 and "no job 'no-such-job'" in r.stderr
    finally:
        up.stop()


def test_kill9_mid_job_and_restart_finishes_the_job(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # a crash reclaims running attempts by lease expiry, and the retry policy decides what follows
    spec = "retry: {max_attempts: 3, initial_interval_s: 0.2}\ntimeouts: {heartbeat_s: 3}\ntasks:\n" + "".join(
        f"  - {{id: t{i}, handler: sleep, args: {{seconds: 0.3}}"
        f"{', depends_on: [t' + str(i - 1) + ']' if i else ''}}}\n" for i in range(12))
    up = UpProcess(data).start()
    try:
        job_id = up.submit(spec)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job = up.job(job_id)
            if job and job["counts"]["succeeded"] >= 3:
                break
            time.sleep(0.05)
        assert job and job["state"] == "running", job
        up.kill9()
    finally:
        up.stop()
    up2 = UpProcess(data, port=up.port).start()
    try:
        job = up2.wait(job_id, timeout=120)
        assert job["state"] == "succeeded", job
        assert job["counts"]["succeeded"] == 12
        tasks = httpx.get(f"{up2.api}/v1/jobs/{job_id}/tasks", params={"limit": 100}).json()["tasks"]
        assert {t["state"] for t in tasks} == {"succeeded"}
    finally:
        up2.stop()
