"""Recovery benchmark (part of `make bench`): a scheduler partition with 1M events of history.

History: layered DAG jobs (10 x 10 noop tasks, full fan-in between layers), all
keyed to partition 0, folded command by command through the production fold
(``dagfold.services.scheduler.harness.FoldHarness``: start, one heartbeat, success per
task), so every event is one the appliers accept; the events are produced to
``events`` partition 0 in transactions of 2,000 (the runner's batch size), as
the live runner writes them. Then a ``tail`` of further events (a scheduler
that was down while another instance went on) is appended.

Measured, with the real runner (``SchedulerRunner``, in this process, on the log):

* restart with local state: the partition's RocksDB store is current up to the
  tail (it was caught up before the tail was written); time from constructing the
  runner to the first command folded and committed after restart (a probe
  SubmitJob on partition 0): group join, catch-up of the tail, fold, transaction;
* restart with empty local state (full rebuild): the same with no store at all;
  catch-up applies the whole history;
* catch-up throughput (events/s applied by ``processor.catch_up``) for both;
* replay throughput: ``dagfold.services.scheduler.replay.replay`` of the events topic
  into fresh stores (scheduler state only, and with the read model), events/s;
  the state rebuilt from the log equals the fold's own state (digest).

Results: ``bench/results/recovery.json`` and the recovery section of
docs/benchmarks.md (between ``<!-- recovery:start -->`` and ``<!-- recovery:end -->``).

    .venv/bin/python -m bench.recovery [--events 1000000] [--tail 10000] [--backend kafka|embedded|both]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.run import layered
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, EVENTS, Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.localkafka import LocalKafka, free_base_port
from dagfold.log import Log, TopicPartition, open_log, partition_for
from dagfold.processor import processor as processor_mod
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.scheduler.replay import replay
from dagfold.services.scheduler.runner import SchedulerRunner
from dagfold.state import PartitionStore
from dagfold.state.store import applied_events_offset, state_digest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 8
TXN_EVENTS = 2000


def job_ids(partition: int, prefix: str) -> Iterator[str]:
    i = 0
    while True:
        jid = f"{prefix}-{i:07d}"
        if partition_for(jid.encode(), PARTITIONS) == partition:
            yield jid
        i += 1


def fold_jobs(h: FoldHarness, ids: Iterator[str], n_events: int) -> Iterator[list[dict[str, Any]]]:
    """Fold jobs until ``n_events`` events were emitted; yields the events job by job."""
    made = 0
    while made < n_events:
        jid = next(ids)
        h.submit(layered(10, 10, jid))
        while h.dispatched:
            d = h.dispatched.popleft()
            h.report("Started", d)
            h.report("Heartbeat", d)
            h.report("Succeeded", d)
            h.now_ms += 1
        job = h.job(jid)
        assert job is not None and job["state"] == "succeeded"
        made += len(h.events)
        yield h.events
        h.events = []


def produce(log: Log, batches: Iterator[list[dict[str, Any]]], instance: str) -> tuple[int, float]:
    codec = default_codec()
    p = log.transactional_producer(f"bench-recovery-{instance}")
    n, pending = 0, 0
    t0 = time.perf_counter()
    p.begin()
    for events in batches:
        for e in events:
            p.send(EVENTS, e["job_id"].encode(), codec.encode(e), partition=0)
            n += 1
            pending += 1
            if pending >= TXN_EVENTS:
                p.commit({}, None)
                p.begin()
                pending = 0
    p.commit({}, None)
    p.close()
    return n, time.perf_counter() - t0


class _Timed:
    """Wraps processor.catch_up to time the catch-up of partition 0."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.events = 0
        self._orig = processor_mod.catch_up

    def __enter__(self) -> _Timed:
        def timed(log_: Log, store: PartitionStore, fold: Any, tp: TopicPartition, *args: Any) -> int:
            t = time.perf_counter()
            n = self._orig(log_, store, fold, tp, *args)
            if tp.partition == 0:
                self.seconds, self.events = time.perf_counter() - t, n
            return n

        processor_mod.catch_up = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        processor_mod.catch_up = self._orig  # type: ignore[assignment]


def restart(log: Log, data: Path, probe_id: str) -> dict[str, Any]:
    """Start a runner on ``data``; seconds until the probe command (partition 0) is folded and committed."""
    cfg = Config(log_url=log.url, data_dir=data, partitions=PARTITIONS)
    sender = log.producer("bench-probe")
    spec = to_job_spec(parse_spec({"id": probe_id, "tasks": [{"id": "a", "handler": "noop"}]}))
    assert partition_for(probe_id.encode(), PARTITIONS) == 0
    sender.send(COMMANDS, probe_id.encode(), default_codec().encode(submit_job(spec, source="bench")))
    sender.flush()
    sender.close()
    stop = threading.Event()
    with _Timed() as timed:
        t0 = time.perf_counter()
        r = SchedulerRunner(log, cfg, "bench")
        th = threading.Thread(target=r.run, args=(stop,), daemon=True)
        th.start()
        deadline = time.monotonic() + 1800
        while r.folded < 1 and th.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        dt = time.perf_counter() - t0
        stop.set()
        th.join(60)
    assert r.folded >= 1, "the probe was never processed"
    return {"seconds_to_first_command": round(dt, 2), "catch_up_events": timed.events,
            "catch_up_seconds": round(timed.seconds, 2),
            "catch_up_events_per_s": round(timed.events / timed.seconds) if timed.seconds else None}


def run(backend: str, n_events: int, tail: int, work: Path) -> dict[str, Any]:
    url, stop_broker = start_log(backend, work)
    try:
        log = open_log(url, work / "embedded")
        cfg = Config(log_url=url, data_dir=work, partitions=PARTITIONS)
        log.create_topics(cfg.core_topics())
        h = FoldHarness()
        ids = job_ids(0, "hist")
        t = time.perf_counter()
        n_main, produce_s = produce(log, fold_jobs(h, ids, n_events), "main")
        gen_s = time.perf_counter() - t
        print(f"history: {n_main} events folded and produced in {gen_s:.1f}s", flush=True)
        # A store that is current up to here: catch up once (what the instance had before it went down).
        local = work / "local"
        store = PartitionStore(local / "scheduler" / "p0000")
        t = time.perf_counter()
        built = processor_mod.catch_up(log, store, h.fold, TopicPartition(EVENTS, 0))
        build_s = time.perf_counter() - t
        # Correctness: the state rebuilt from the log alone equals the fold's own state.
        rebuilt_equals_fold = state_digest(store) == h.digest()
        store.close()
        n_tail, _ = produce(log, fold_jobs(h, ids, tail), "tail")
        total = n_main + n_tail
        print(f"tail: {n_tail} events; partition 0 holds {total}", flush=True)
        with_state = restart(log, local, next(job_ids(0, "probe-local")))
        empty = work / "empty"
        empty.mkdir()
        without_state = restart(log, empty, next(job_ids(0, "probe-empty")))
        # replay: scheduler state only, then with the read model
        t = time.perf_counter()
        res = replay(log, work / "replay", PARTITIONS, with_read_model=False)
        replay_s = time.perf_counter() - t
        rep = PartitionStore(work / "replay" / "scheduler" / "p0000", read_only=True)
        last_offset = applied_events_offset(rep)
        rep.close()
        t = time.perf_counter()
        res_rm = replay(log, work / "replay-rm", PARTITIONS, with_read_model=True)
        replay_rm_s = time.perf_counter() - t
        return {
            "backend": backend, "events_in_partition": total, "history_events": n_main, "tail_events": n_tail,
            "commands_folded": h.offset,
            "generate_and_produce_s": round(gen_s, 1), "produce_events_per_s": round(n_main / produce_s),
            "initial_catch_up": {"events": built, "seconds": round(build_s, 2),
                                 "events_per_s": round(built / build_s) if build_s else None},
            "restart_with_local_state": with_state, "restart_with_empty_state": without_state,
            "replay_scheduler_state": {"events": res.total, "seconds": round(replay_s, 2),
                                       "events_per_s": round(res.total / replay_s)},
            "replay_with_read_model": {"events": res_rm.total, "seconds": round(replay_rm_s, 2),
                                       "events_per_s": round(res_rm.total / replay_rm_s)},
            "rebuilt_state_equals_fold": rebuilt_equals_fold,
            "last_replayed_offset": last_offset,
        }
    finally:
        stop_broker()


def start_log(backend: str, work: Path) -> tuple[str, Any]:
    if backend == "embedded":
        return "embedded", lambda: None
    # apart from the test brokers (19092 + k*100) and the chaos clusters (30192 + k*100)
    port = int(os.environ.get("BENCH_KAFKA_PORT", "0")) or free_base_port(range(20150, 29150, 100))
    broker = LocalKafka(port, work / "kafka").start()
    return broker.url, broker.stop


def write_docs(results: dict[str, Any]) -> None:
    """Rewrite the recovery section of docs/benchmarks.md (between its markers; appended if absent)."""
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start, end = "<!-- recovery:start -->", "<!-- recovery:end -->"
    m = results["machine"]
    rows = [
        start,
        "## Recovery (`make bench` → `bench/recovery.py`)",
        "",
        f"One scheduler partition with {results['events']:,} events of history: layered DAG jobs (10 x 10 "
        "noop tasks) folded command by command through the production fold (start, one heartbeat and "
        "success per task), produced to `events` partition 0 in transactions of 2,000 as the runner "
        f"writes them, then a tail of {results['tail']:,} more events. Measured with the real runner "
        "(`SchedulerRunner` in the benchmark's process; a `dagfold scheduler` process adds its "
        "interpreter start, about half a second):",
        "",
        "* **restart, local state**: the partition's RocksDB store was current before the tail was "
        "written; time from constructing the runner to the first command after the restart folded and "
        "committed (a SubmitJob on partition 0): group join, catch-up of the tail, fold, transaction;",
        "* **restart, empty state**: the same without any store (full rebuild from the events topic);",
        "* **catch-up**: events/s applied by `processor.catch_up` during the full rebuild;",
        "* **replay**: `dagfold.services.scheduler.replay.replay` of the whole events topic into fresh stores, "
        "scheduler state alone and with the read model (what `dagfold replay` does), events/s.",
        "",
        f"Measured {results['when']} on {m['cpus']} CPUs (shared with other work), Python {m['python']}; "
        "Kafka 4.1.1, one broker on loopback. Reproduce: `.venv/bin/python -m bench.recovery "
        "[--events N] [--tail N] [--backend kafka|embedded|both]`; results in `bench/results/recovery.json`.",
        "",
        "| backend | events in partition | restart → first command, local state | "
        "restart → first command, empty state | catch-up events/s | replay events/s (state) | "
        "replay events/s (state + read model) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        w, e = r["restart_with_local_state"], r["restart_with_empty_state"]
        rows.append(
            f"| {r['backend']} | {r['events_in_partition']:,} | {w['seconds_to_first_command']} s "
            f"(tail of {w['catch_up_events']:,} events) | {e['seconds_to_first_command']} s "
            f"({e['catch_up_events']:,} events) | {e['catch_up_events_per_s']:,} | "
            f"{r['replay_scheduler_state']['events_per_s']:,} | {r['replay_with_read_model']['events_per_s']:,} |")
    rows += ["", "The state rebuilt from the log equals the fold's own state (SHA-256 digest of the partition "
             "store): " + ", ".join(f"{r['backend']} {'yes' if r['rebuilt_state_equals_fold'] else 'NO'}"
                                    for r in results["runs"]) + ".", end]
    block = "\n".join(rows)
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.recovery")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--tail", type=int, default=10_000)
    ap.add_argument("--backend", choices=["kafka", "embedded", "both"], default="both")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    a = ap.parse_args()
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "events": a.events, "tail": a.tail, "runs": []}
    for backend in (["kafka", "embedded"] if a.backend == "both" else [a.backend]):
        work = Path(tempfile.mkdtemp(prefix=f"dagfold-recovery-{backend}-"))
        try:
            r = run(backend, a.events, a.tail, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(r, indent=1), flush=True)
        results["runs"].append(r)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(results, indent=2) + "\n")
    if not a.no_docs:
        write_docs(results)


if __name__ == "__main__":
    main()
