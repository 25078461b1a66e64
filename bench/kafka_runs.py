"""One-shot runs on Kafka in a row (`make bench-kafka-runs`): time and memory per run must stay flat.

Runs ``dagfold run --log kafka://BOOTSTRAP examples/diamond.yaml --json`` N times, one after the
other, each a fresh process, on one broker (``--bootstrap``, or a broker started here with
deploy/kafka/kafka.sh). Per run: wall time, the child's CPU time and peak RSS (``os.wait4``; CPU
time is the figure that does not move with the machine's load), exit code, and
the number of topics on the broker afterwards (each run deletes its namespace, so it stays flat).

Results: ``bench/results/kafka-runs.json`` and a line in docs/benchmarks.md.

    .venv/bin/python -m bench.kafka_runs [--runs 50] [--bootstrap 127.0.0.1:9092]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dagfold.log.kafka import KafkaLog

ROOT = Path(__file__).resolve().parents[1]


def _topics(bootstrap: str) -> int:
    lg = KafkaLog(bootstrap)
    try:
        return len([t for t in lg._metadata().topics if not t.startswith("__")])
    finally:
        lg.close()


def one_run(bootstrap: str, timeout_s: float = 300.0) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen([sys.executable, "-m", "dagfold", "run", "--log", f"kafka://{bootstrap}",
                                 "examples/diamond.yaml", "--json"], cwd=ROOT, stdout=out, stderr=errf)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        tasks = -1
        with contextlib.suppress(ValueError, KeyError):
            tasks = len(json.loads(out.read())["tasks"])
    return {"seconds": round(time.perf_counter() - t0, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "rss_mb": round(usage.ru_maxrss / 1024, 1), "rc": proc.returncode, "tasks": tasks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--bootstrap", default=None, help="an existing broker (else one is started on port 29492)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kafka-runs.json")
    a = ap.parse_args()
    env = {**os.environ, "KAFKA_PORT": "29492", "KAFKA_DATA": str(ROOT / ".cache" / "kafka" / "bench-runs")}
    started = a.bootstrap is None
    bootstrap = a.bootstrap or "127.0.0.1:29492"
    if started:
        subprocess.run([str(ROOT / "deploy/kafka/kafka.sh"), "start"], env=env, check=True)
    try:
        topics_before = _topics(bootstrap)
        runs = []
        for i in range(a.runs):
            r = one_run(bootstrap)
            r["topics_after"] = _topics(bootstrap)
            runs.append(r)
            print(f"run {i + 1}/{a.runs}: {r}", flush=True)
    finally:
        if started:
            subprocess.run([str(ROOT / "deploy/kafka/kafka.sh"), "stop"], env=env, check=False)
    secs = [r["seconds"] for r in runs]
    rss = [r["rss_mb"] for r in runs]
    cpu = [r["cpu_s"] for r in runs]
    q = max(len(runs) // 5, 1)
    summary = {
        "runs": len(runs), "failed": sum(r["rc"] != 0 or r["tasks"] != 4 for r in runs),
        "hung": sum(r["rc"] in (-9, 137) for r in runs),
        "seconds": {"first": secs[0], "last": secs[-1], "median": statistics.median(secs), "max": max(secs),
                    "median_first_fifth": statistics.median(secs[:q]),
                    "median_last_fifth": statistics.median(secs[-q:])},
        "cpu_s": {"first": cpu[0], "last": cpu[-1], "median": statistics.median(cpu), "max": max(cpu),
                  "median_first_fifth": statistics.median(cpu[:q]), "median_last_fifth": statistics.median(cpu[-q:])},
        "rss_mb": {"first": rss[0], "last": rss[-1], "median": statistics.median(rss), "max": max(rss)},
        "topics_before": topics_before, "topics_after_last": runs[-1]["topics_after"],
        "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
    }
    a.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
