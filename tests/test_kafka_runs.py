"""One-shot runs on Kafka: `dagfold run --log kafka://...` several times in a row on one broker.

Each run lives in its own topic namespace (`dagfold-run-<id>`), reads only its own records and
deletes its topics and groups at the end; a kept run's read model and scheduler state hold its
job alone (before, a run restored and projected every earlier run's events). `--json` lists every
task. Closing is bounded: a part whose close hangs is left behind after the timeout.
(Timing and memory over 50 runs: `make bench-kafka-runs`, figures in docs/benchmarks.md.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from dagfold.config import Config
from dagfold.log.kafka import KafkaLog
from dagfold.projections.jobs import ReadModel
from dagfold.projections.store import ReadModelStore
from dagfold.services.scheduler.replay import job_ids
from dagfold.services.stack import Stack, StackOptions
from dagfold.state import PartitionStore
from tests.cli_support import dagfold

pytestmark = pytest.mark.kafka


def _run_topics(bootstrap: str) -> set[str]:
    lg = KafkaLog(bootstrap)
    try:
        return {t for t in lg._metadata().topics if "dagfold-run-" in t}
    finally:
        lg.close()


def test_runs_in_a_row_read_only_their_own_job_and_clean_up(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = f"kafka://{kafka_bootstrap}"
    before = _run_topics(kafka_bootstrap)
    for _ in range(2):  # the second run would see the first's job if namespaces leaked (a third adds nothing)
        r = dagfold("run", "--log", url, "examples/diamond.yaml", "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["job"]["state"] == "succeeded" and len(res["tasks"]) == 4
    assert _run_topics(kafka_bootstrap) == before  # each run deleted its namespace

    # a kept run, after the two: its read model and scheduler state hold its own job only
    data = tmp_path / "kept"
    r = dagfold("run", "--log", url, "--data", str(data), "--keep", "examples/failing.yaml", "--json", timeout=120)
    assert r.returncode == 1, r.stderr  # the job fails (by design of the example)
    assert "topics kept under the prefix dagfold-run-" in r.stderr
    job_id = json.loads(r.stdout)["job"]["job_id"]
    store = ReadModelStore(data / "projections")
    try:
        jobs = ReadModel(store).list_jobs(limit=100).items
        assert [j["job_id"] for j in jobs] == [job_id]
    finally:
        store.close()
    found: set[str] = set()
    for p in sorted((data / "scheduler").iterdir()):
        ps = PartitionStore(p, read_only=True)
        found |= job_ids(ps)
        ps.close()
    assert found == {job_id}
    kept = _run_topics(kafka_bootstrap) - before
    assert kept and len({t.split(".")[0] for t in kept}) == 1
    lg = KafkaLog(kafka_bootstrap)
    try:
        assert lg.delete_prefixed(next(iter(kept)).split(".")[0] + ".")[0] == len(kept)
    finally:
        lg.close()


def test_stop_is_bounded_when_a_close_hangs(tmp_path: Path) -> None:
    stack = Stack(Config.from_env(log_url="embedded", data_dir=tmp_path), StackOptions(api=False))
    stack.close_timeout_s = 0.5
    hang = threading.Event()
    closed: list[str] = []
    t0 = time.monotonic()
    stack._close_all([("stuck consumer", hang.wait), ("fine", lambda: closed.append("fine"))])
    assert time.monotonic() - t0 < 2.0
    assert stack.close_timeouts == ["stuck consumer"] and closed == ["fine"]
    hang.set()
