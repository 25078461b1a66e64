"""Several scheduler processes share the partitions on Kafka; killing one loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli_support import DAGFOLD, ROOT, UpProcess, kafka_url

pytestmark = pytest.mark.kafka


def start_scheduler(url: str, data: Path, instance: str) -> subprocess.Popen[bytes]:
    logf = open(data.parent / f"sched-{instance}.log", "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen([*DAGFOLD, "scheduler", "--log", url, "--data", str(data), "--instance", instance],
                            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)


def test_three_scheduler_instances_share_partitions_and_survive_a_kill(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = kafka_url(kafka_bootstrap)  # the killed instance leaves the group after 6 s, not 45 s
    up = UpProcess(tmp_path / "up", log=url, workers=3).start()
    extra = [start_scheduler(url, tmp_path / f"s{i}", f"scale-{i}") for i in (1, 2)]
    try:
        # wait until the group has settled on three members: both extra instances own partitions
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                list((tmp_path / f"s{i}" / "scheduler").glob("p*")) for i in (1, 2)):
            time.sleep(0.2)
        chain = "tasks:\n" + "".join(
            f"  - {{id: t{i}, handler: sleep, args: {{seconds: 0.2}}"
            f"{', depends_on: [t' + str(i - 1) + ']' if i else ''}}}\n" for i in range(8))
        jobs = [up.submit(chain) for _ in range(12)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = sum((up.job(j) or {}).get("counts", {}).get("succeeded", 0) for j in jobs)
            if done >= 20:
                break
            time.sleep(0.1)
        owned = sorted((tmp_path / "s1" / "scheduler").glob("p*"))
        assert owned, "instance scale-1 never owned a partition"
        os.killpg(extra[0].pid, signal.SIGKILL)  # an instance dies mid-run; its partitions move
        extra[0].wait(10)
        for j in jobs:
            job = up.wait(j, timeout=240)
            assert job["state"] == "succeeded", job
            assert job["counts"]["succeeded"] == 8
    finally:
        for p in extra:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
        up.stop()
