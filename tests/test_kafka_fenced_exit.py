"""A writer process fenced by a newer instance of itself exits with status 75, not as a crash.

`dagfold scheduler` (and `dagfold allocator`, the same CLI path) stops when a newer instance took its
transactional ID: that is fencing working, and a supervisor that restarts every failure would restart it
into fencing the holder. Before, the process ended like any error (status 1, "error: FencedError: ...");
now it ends with EXIT_FENCED (75, sysexits' EX_TEMPFAIL) and one line saying it stands down, so that an
operator can tell the two apart (systemd: RestartPreventExitStatus=75) and the chaos harness does not
count it as a crash.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest

from dagfold.cli.ux import EXIT_FENCED
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, EVENTS, Config
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import Log, TopicPartition, open_log
from dagfold.log.reader import read_to_end
from tests.cli_support import DAGFOLD, ROOT, kafka_url

pytestmark = pytest.mark.kafka


def accepted(lg: Log) -> list[str]:
    """The job IDs of the JobAccepted events so far (committed records only)."""
    events = [default_codec().decode(r.value) for batch in read_to_end(lg, TopicPartition(EVENTS, 0))
              for r in batch]
    return [e["job_id"] for e in events if e["type"] == "dagfold.event.JobAccepted"]


def test_a_fenced_scheduler_process_exits_75(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = kafka_url(kafka_bootstrap) + f"&prefix=fenced-{uuid.uuid4().hex[:8]}"
    lg = open_log(url, tmp_path / "test")
    lg.create_topics(Config(log_url=url, partitions=1).core_topics())
    producer = lg.producer("test")

    def submit(job_id: str) -> None:
        spec = to_job_spec(load_spec_text(f"id: {job_id}\ntasks: [{{id: a}}]"))
        producer.send(COMMANDS, job_id.encode(), default_codec().encode(submit_job(spec)))
        producer.flush()

    out = (tmp_path / "scheduler.log").open("w+")
    proc = subprocess.Popen([*DAGFOLD, "scheduler", "--log", url, "--data", str(tmp_path / "data"),
                             "--instance", "fz"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        submit("before")  # the scheduler is up once it accepted a job
        deadline = time.monotonic() + 90
        while not accepted(lg):
            assert proc.poll() is None and time.monotonic() < deadline, out.name
            time.sleep(0.5)
        newer = lg.transactional_producer("dagfold-scheduler-fz")  # a newer instance takes the ID
        submit("after")  # the fenced instance's next transaction is refused
        code = proc.wait(timeout=90)
        newer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        lg.close()
    text = Path(out.name).read_text()
    assert code == EXIT_FENCED, text
    assert "fenced: a newer instance of this writer took over" in text, text
    assert "Traceback" not in text, text
    check = open_log(url, tmp_path / "check")
    try:
        assert accepted(check) == ["before"]  # the fenced instance wrote nothing more
    finally:
        check.close()
