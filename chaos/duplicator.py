"""The report duplicator: re-produces worker reports later, as a flaky network would.

A process of its own, outside the product (no test hooks in dagfold): it reads
the commands topic from its end and, with probability ``--rate``, copies a
worker report (TaskStarted, TaskHeartbeat, TaskSucceeded, TaskFailed) back to
the same partition, byte for byte, either soon (``duplicated``: 20-500 ms
later) or late (``delayed``: 2-20 s later, after the scheduler has usually
moved on: another attempt, a terminal task). At most ``--max-per-s`` copies a
second. Counts go to ``--stats`` (JSON, rewritten every second) and a line
per copy to ``--journal``. SIGTERM sends what is still pending, then exits.

    python -m chaos.duplicator --log kafka://... --seed 7 --stats dup.json --journal dup.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from dagfold.codec import default_codec
from dagfold.config import COMMANDS
from dagfold.exceptions import CodecError, LogError
from dagfold.log import TopicPartition, open_log

REPORTS = {
    "dagfold.command.TaskStarted": "started",
    "dagfold.command.TaskHeartbeat": "heartbeat",
    "dagfold.command.TaskSucceeded": "succeeded",
    "dagfold.command.TaskFailed": "failed",
}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chaos.duplicator")
    ap.add_argument("--log", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.05, help="share of reports copied")
    ap.add_argument("--max-per-s", type=float, default=2.0)
    ap.add_argument("--stats", type=Path, required=True)
    ap.add_argument("--journal", type=Path, required=True)
    a = ap.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rng = random.Random(a.seed)
    codec = default_codec()
    lg = open_log(a.log, Path("."))
    n = lg.partitions(COMMANDS)
    tps = [TopicPartition(COMMANDS, p) for p in range(n)]
    consumer = lg.consumer(None, client_id="chaos-duplicator")
    consumer.assign(lg.end_offsets(tps))
    producer = lg.producer("chaos-duplicator")
    pending: list[tuple[float, int, int, bytes, bytes, str, str]] = []
    counts: dict[str, int] = {}
    seq = 0
    tokens = a.max_per_s
    last_refill = time.monotonic()
    last_stats = 0.0
    journal = a.journal.open("a")

    def write_stats() -> None:
        tmp = a.stats.with_suffix(".tmp")
        tmp.write_text(json.dumps({"counts": counts, "pending": len(pending), "pid": os.getpid()}))
        tmp.replace(a.stats)

    def send_due(now: float, everything: bool = False) -> None:
        """Send every copy that is due, with one flush (a copy whose flush failed goes again)."""
        due = []
        while pending and (everything or pending[0][0] <= now):
            due.append(heapq.heappop(pending))
        if not due:
            return
        try:
            for _, _, part, key, value, _, _ in due:
                producer.send(COMMANDS, key, value, partition=part)
            producer.flush(10)
        except LogError:
            for item in due:
                heapq.heappush(pending, item)
            if everything:
                raise
            return  # a broker is down: try again on the next round
        for _, _, part, key, _, kind, what in due:
            counts[f"report {kind}"] = counts.get(f"report {kind}", 0) + 1
            journal.write(json.dumps({"t": time.time(), "kind": kind, "report": what,
                                      "key": key.decode(), "partition": part}) + "\n")
        journal.flush()

    try:
        while not stop.is_set():
            try:
                recs = consumer.poll(500, 0.1)
            except LogError:
                recs = []
            now = time.monotonic()
            tokens = min(max(1.0, 5 * a.max_per_s), tokens + (now - last_refill) * a.max_per_s)
            last_refill = now
            for r in recs:
                if r.value is None or r.key is None or rng.random() >= a.rate or tokens < 1:
                    continue
                try:
                    rec = codec.decode(r.value)
                except CodecError:
                    continue
                what = REPORTS.get(rec["type"])
                if what is None:
                    continue
                tokens -= 1
                kind = "duplicated" if rng.random() < 0.5 else "delayed"
                delay = rng.uniform(0.02, 0.5) if kind == "duplicated" else rng.uniform(2.0, 20.0)
                seq += 1
                heapq.heappush(pending, (now + delay, seq, r.partition, r.key, r.value, kind, what))
            send_due(now)
            if now - last_stats >= 1.0:
                write_stats()
                last_stats = now
        for _ in range(30):
            try:
                send_due(time.monotonic(), everything=True)
                break
            except LogError:
                time.sleep(1.0)
    finally:
        write_stats()
        journal.close()
        consumer.close()
        with contextlib.suppress(LogError):
            producer.close()
        lg.close()


if __name__ == "__main__":
    main()
