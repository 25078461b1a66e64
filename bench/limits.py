"""Physical limits of dagfold's building blocks, and dagfold's rates as a fraction of them (issue 7).

    python -m bench.limits --bootstrap 127.0.0.1:9092 [--peers bench/results/peers.json] [--smoke]

`python -m bench.peers` runs this at its end against the same broker. Each figure
is the best of three rounds, on one core (one Python thread):

* fastavro: schemaless encode / decode of a typical event (TaskSucceeded, as the
  scheduler emits it), raw and through dagfold's codec (single-object framing);
* msgspec msgpack encode / decode of a task state record (the scheduler's state values);
* rocksdict: puts in write batches of 1,000 (200-byte values), point reads of present keys;
* confluent-kafka: produce (idempotent, acks=all, linger.ms=5: dagfold's producer
  settings) and consume (read_committed) of 100-byte records against the broker,
  and transactional produce in transactions of 2,000 records (the scheduler's shape);
* dagfold's fold: the scheduler fold alone in memory, one command per transaction
  (the virtual-time harness, as `make bench` measures it) and in batches of up to
  2,000 commands per transaction (as the runner folds a poll).

The ceiling of dagfold's end-to-end rate is what one core could do if a noop task
cost nothing but its records: per task 2 commands (TaskStarted, TaskSucceeded),
3 events (TaskDispatched, LeaseGranted, TaskSucceeded) and 1 dispatch record, so
6 Avro encodes, 6 decodes, 6 produces, 6 consumes and 3 state writes.
Results: bench/results/limits.json (limits-smoke.json with --smoke) and the
limits section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import shutil
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastavro
import msgspec

from bench.peers import report
from bench.peers.workloads import layered_sparse, load
from dagfold.codec import default_codec
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import MemoryStore, PartitionTransaction

ROUNDS = 3


def best_rate(fn: Callable[[], int]) -> float:
    """ops/s of the best of ROUNDS rounds; ``fn`` runs one round and returns its op count."""
    best = 0.0
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        best = max(best, n / dt)
    return best


def typical_event() -> dict[str, Any]:
    return {"type": "dagfold.event.TaskSucceeded", "job_id": str(uuid.UUID(int=7)), "ts_ms": 1_765_000_000_000,
            "cause_offset": 123_456, "task_id": "mDiffFit_ID0000123", "attempt": 1, "worker_id": "host-default-0",
            "result_json": None, "stdout_tail": "", "stderr_tail": ""}


def typical_state() -> dict[str, Any]:
    return {"state": "running", "attempt": 1, "n_up": 2, "rem": 0, "ok": 2, "bad": 0, "skip": 0, "queue": "default",
            "handler": "noop", "args": "{}", "rule": "all_success",
            "retry": {"max_attempts": 1, "initial_interval_s": 1.0, "backoff_coefficient": 2.0,
                      "max_interval_s": 60.0, "jitter": True, "non_retryable_exit_codes": [],
                      "non_retryable_errors": []},
            "timeouts": None, "resources": None, "leaf": False, "worker": "host-default-0",
            "lease_ms": 1_765_000_030_000, "timers": {"lease": 1_765_000_030_000}, "ended_ms": None}


def codec_limits(n: int) -> dict[str, float]:
    codec = default_codec()
    ev = typical_event()
    rs = codec.schema(ev["type"])
    body = dict(ev)
    raw = io.BytesIO()
    fastavro.schemaless_writer(raw, rs.parsed, body)
    raw_bytes = raw.getvalue()
    framed = codec.encode(ev)

    def enc_raw() -> int:
        for _ in range(n):
            b = io.BytesIO()
            fastavro.schemaless_writer(b, rs.parsed, body)
        return n

    def dec_raw() -> int:
        for _ in range(n):
            fastavro.schemaless_reader(io.BytesIO(raw_bytes), rs.parsed, None)
        return n

    def enc() -> int:
        for _ in range(n):
            codec.encode(ev)
        return n

    def dec() -> int:
        for _ in range(n):
            codec.decode(framed)
        return n

    st = typical_state()
    enc_mp, dec_mp = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    packed = enc_mp.encode(st)

    def mp_enc() -> int:
        for _ in range(n):
            enc_mp.encode(st)
        return n

    def mp_dec() -> int:
        for _ in range(n):
            dec_mp.decode(packed)
        return n

    return {"event_bytes": len(framed), "state_bytes": len(packed),
            "fastavro_encode_per_s": best_rate(enc_raw), "fastavro_decode_per_s": best_rate(dec_raw),
            "codec_encode_per_s": best_rate(enc), "codec_decode_per_s": best_rate(dec),
            "msgpack_encode_per_s": best_rate(mp_enc), "msgpack_decode_per_s": best_rate(mp_dec)}


def rocks_limits(n: int) -> dict[str, float]:
    from rocksdict import Options, Rdict, WriteBatch

    d = Path(tempfile.mkdtemp(prefix="bench-limits-rocks-"))
    try:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        db = Rdict(str(d / "db"), options=opts)
        value = bytes(200)
        keys = [b"t\x1fjob-0001\x1ftask-%08d" % i for i in range(n)]
        rnd = 0

        def write() -> int:
            nonlocal rnd
            rnd += 1
            for i in range(0, n, 1000):
                wb = WriteBatch(raw_mode=True)
                for k in keys[i:i + 1000]:
                    wb.put(k, value)
                db.write(wb)
            return n

        def read() -> int:
            step = 7919  # a stride that visits every key once, out of order
            for i in range(n):
                db.get(keys[(i * step) % n])
            return n

        w = best_rate(write)
        r = best_rate(read)
        db.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"rocksdb_batched_put_per_s": w, "rocksdb_point_get_per_s": r, "rocksdb_value_bytes": 200,
            "rocksdb_batch": 1000}


def kafka_limits(bootstrap: str, n: int) -> dict[str, float]:
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"bench-limits-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 8, 1)])[topic].result(30)
    time.sleep(1.0)
    value = bytes(100)
    keys = [b"job-%04d" % (i % 64) for i in range(n)]
    prod_conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
    out: dict[str, float] = {"kafka_record_bytes": 100}

    def produce() -> int:
        p = Producer(prod_conf)
        for k in keys:
            while True:
                try:
                    p.produce(topic, value, k)
                    break
                except BufferError:
                    p.poll(0.01)
        p.flush(60)
        return n

    out["kafka_produce_per_s"] = best_rate(produce)

    tp = Producer({**prod_conf, "transactional.id": f"bench-limits-{uuid.uuid4().hex[:8]}"})
    tp.init_transactions(60)

    def produce_txn() -> int:
        for i in range(0, n, 2000):
            tp.begin_transaction()
            for k in keys[i:i + 2000]:
                tp.produce(tp_topic, value, k)
            tp.commit_transaction(30)
        return n

    tp_topic = topic
    out["kafka_txn_produce_per_s"] = best_rate(produce_txn)
    # the floor of one scheduler hop on Kafka: a transaction of one record, begin to committed
    lat = []
    for i in range(100):
        t0 = time.perf_counter()
        tp.begin_transaction()
        tp.produce(topic, value, keys[i])
        tp.commit_transaction(30)
        lat.append((time.perf_counter() - t0) * 1000)
    lat.sort()
    out["kafka_txn_commit_p50_ms"] = lat[50]
    out["kafka_txn_commit_p99_ms"] = lat[98]
    tp.flush(10)
    total = n * 2 * ROUNDS + 100  # what the rounds above wrote

    def consume() -> int:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                      "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                      "enable.auto.commit": False})
        c.subscribe([topic])
        got = 0
        first = None
        while got < total:
            msgs = c.consume(10_000, 1.0)
            if msgs and first is None:
                first = time.perf_counter()
            got += sum(1 for m in msgs if m.error() is None)
        dt = time.perf_counter() - (first or time.perf_counter())
        c.close()
        nonlocal_rate.append(got / dt if dt > 0 else 0.0)
        return got

    nonlocal_rate: list[float] = []
    for _ in range(ROUNDS):
        consume()
    out["kafka_consume_per_s"] = max(nonlocal_rate)  # from the first record (group join excluded)
    admin.delete_topics([topic])
    return out


def fold_per_command(spec: dict[str, Any]) -> dict[str, float]:
    h = FoldHarness()
    t0 = time.perf_counter()
    h.submit(spec)
    h.run_all()
    dt = time.perf_counter() - t0
    return {"events_per_s": len(h.events) / dt, "commands_per_s": h.offset / dt, "tasks_per_s": len(spec["tasks"]) / dt}


def fold_batched(spec: dict[str, Any], batch: int = 2000, started: bool = True,
                 cache_values: int = SchedulerFold.CACHE_VALUES) -> dict[str, float]:
    """The fold as the runner drives it: every command of a poll in one transaction. ``started``:
    each task reports TaskStarted, then TaskSucceeded (a slow handler); without, only its outcome
    (what a worker sends for an instant handler such as noop). ``cache_values``: decoded values the
    store keeps between transactions, as the runner configures it (0: none)."""
    fold = SchedulerFold()
    store = MemoryStore(cache_values)
    now = 1_000_000
    offset = 0
    events = 0
    ready: deque[dict[str, Any]] = deque()

    def run(cmds: list[dict[str, Any]]) -> None:
        nonlocal offset, events
        txn = PartitionTransaction(store)
        for c in cmds:
            for o in fold.process(txn, c, now, offset):
                if o.record["type"] == "dagfold.dispatch.TaskDispatch":
                    ready.append(o.record)
                elif o.topic == "events":
                    events += 1
            offset += 1
        txn.commit(applied_events=offset)

    t0 = time.perf_counter()
    run([{"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": now, "source": "bench"}])
    while ready:
        cmds: list[dict[str, Any]] = []
        while ready and len(cmds) < batch:
            d = ready.popleft()
            base = {"job_id": d["job_id"], "task_id": d["task_id"], "attempt": d["attempt"], "worker_id": "w1",
                    "ts_ms": now}
            if started:
                cmds.append({"type": "dagfold.command.TaskStarted", **base})
            cmds.append({"type": "dagfold.command.TaskSucceeded", **base, "result_json": None, "stdout_tail": "",
                         "stderr_tail": ""})
        run(cmds)
    dt = time.perf_counter() - t0
    return {"events_per_s": events / dt, "commands_per_s": offset / dt, "tasks_per_s": len(spec["tasks"]) / dt}


def spec_of(dag: list[tuple[str, list[str]]], job_id: str) -> dict[str, Any]:
    return to_job_spec(parse_spec({"id": job_id, "tasks": [
        {"id": t, "handler": "noop", "depends_on": ps} for t, ps in dag]}))


def fold_limits(smoke: bool) -> dict[str, dict[str, float]]:
    # Each spec is built when its turn comes and dropped after: the dense 100x100 spec alone is a
    # million edge strings, and kept alive it made every garbage collection during the Montage fold
    # walk it too (Montage read 61k events/s here and 77k in a process of its own).
    work: dict[str, Callable[[], dict[str, Any]]] = {
        "montage": lambda: spec_of(load("montage", smoke), "montage"),
        "layered 100x100": lambda: spec_of(load("layered-100x100", smoke), "layered"),
        "sparse layered 100x100 (fan-in 2)": lambda: spec_of(layered_sparse(100, 10 if smoke else 100), "sparse")}
    out: dict[str, dict[str, float]] = {}
    for name, build in work.items():
        spec = build()
        out[f"{name}, 1 command/txn"] = max((fold_per_command(spec) for _ in range(2)),
                                            key=lambda r: r["events_per_s"])
        out[f"{name}, ≤2,000 commands/txn"] = max((fold_batched(spec) for _ in range(2)),
                                                  key=lambda r: r["events_per_s"])
        if name == "montage":  # what noop workers send: one report per task
            out[f"{name}, ≤2,000 commands/txn, outcome only"] = max(
                (fold_batched(spec, started=False) for _ in range(2)), key=lambda r: r["events_per_s"])
        del spec
        gc.collect()
    return out


def ceiling(lim: dict[str, float], backend: str = "kafka") -> dict[str, float]:
    """µs per noop task if it cost nothing but its records, on one core.

    Kafka: each record produced once and consumed once. Embedded: each record is one
    RocksDB put in a batch and read back (a point get, an upper bound for an iterator step).
    """
    us = {"6 Avro encodes": 6e6 / lim["codec_encode_per_s"], "6 Avro decodes": 6e6 / lim["codec_decode_per_s"]}
    if backend == "kafka":
        us["6 Kafka produces"] = 6e6 / lim["kafka_produce_per_s"]
        us["6 Kafka consumes"] = 6e6 / lim["kafka_consume_per_s"]
    else:
        us["6 log appends (RocksDB batched puts)"] = 6e6 / lim["rocksdb_batched_put_per_s"]
        us["6 log reads (RocksDB gets)"] = 6e6 / lim["rocksdb_point_get_per_s"]
    us["3 RocksDB batched puts"] = 3e6 / lim["rocksdb_batched_put_per_s"]
    us["3 msgpack encodes"] = 3e6 / lim["msgpack_encode_per_s"]
    us["total"] = sum(us.values())
    return us


def derive(doc: dict[str, Any], e2e: dict[str, dict[str, Any]]) -> None:
    """Ceilings and fractions from the measured limits (also used by --rerender)."""
    lim, fold = doc["limits"], doc["fold"]
    ceil = {b: ceiling(lim, b) for b in ("kafka", "embedded")}
    fractions: dict[str, float] = {}
    for name, f in fold.items():
        fractions[f"fold {name}: events/s ÷ Avro decodes/s"] = f["events_per_s"] / lim["codec_decode_per_s"]
        fractions[f"fold {name}: events/s ÷ 100,000 (target)"] = f["events_per_s"] / 100_000
    for name, r in e2e.items():
        b = "kafka" if "kafka" in name else "embedded"
        fractions[f"{name}: tasks/s ÷ {b} ceiling"] = r["tasks_per_s"] / (1e6 / ceil[b]["total"])
    doc["ceiling_us_per_task"] = {b: {k: round(v, 2) for k, v in c.items()} for b, c in ceil.items()}
    doc["ceiling_tasks_per_s"] = {b: round(1e6 / c["total"]) for b, c in ceil.items()}
    doc["end_to_end"] = {k: {"tasks_per_s": v["tasks_per_s"], "total_cpu_us_per_task": v.get("total_cpu_us_per_task")}
                         for k, v in e2e.items()}
    doc["fractions"] = {k: round(v, 4) for k, v in fractions.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", help="Kafka HOST:PORT")
    ap.add_argument("--rerender", action="store_true",
                    help="recompute ceilings, fractions and the docs section from the results file; measure nothing")
    ap.add_argument("--peers", type=Path, help="peers results (end-to-end rates to compare)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or report.RESULTS / ("limits-smoke.json" if args.smoke else "limits.json")
    if args.rerender:
        doc = json.loads(out.read_text())
        derive(doc, {k: v for k, v in doc["end_to_end"].items()})
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(text(doc))
        if not args.no_docs:
            report.replace_section("limits", markdown(doc))
        return
    if not args.bootstrap:
        ap.error("--bootstrap is required")
    n = 20_000 if args.smoke else 200_000
    load_before = report.loadavg()
    lim: dict[str, float] = {}
    lim.update(codec_limits(n // 4))
    lim.update(rocks_limits(n))
    lim.update(kafka_limits(args.bootstrap, n))
    fold = fold_limits(args.smoke)
    e2e: dict[str, dict[str, Any]] = {}
    if args.peers and args.peers.exists():
        for r in json.loads(args.peers.read_text())["results"]:
            if r["system"].startswith("dagfold") and r.get("status") == "ok":
                e2e[f"{r['system']} {r['workload']}"] = r
    doc = {"when": report.when(), "smoke": args.smoke, "load_before": load_before, "load_after": report.loadavg(),
           "machine": report.machine(), "limits": {k: round(v, 3) for k, v in lim.items()},
           "fold": {k: {kk: round(vv) for kk, vv in v.items()} for k, v in fold.items()}}
    derive(doc, e2e)
    report.RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(text(doc))
    if not args.no_docs and not args.smoke:
        report.replace_section("limits", markdown(doc))


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    L = doc["limits"]
    def row(name: str, key: str, what: str) -> list[str]:
        return [name, report.fmt(L[key]), report.fmt(1e6 / L[key], 2), what]

    return [
        row("fastavro encode (schemaless)", "fastavro_encode_per_s", f"TaskSucceeded event, {L['event_bytes']:.0f} B"),
        row("fastavro decode (schemaless)", "fastavro_decode_per_s", "same"),
        row("dagfold codec encode", "codec_encode_per_s", "same, with single-object framing"),
        row("dagfold codec decode", "codec_decode_per_s", "same"),
        row("msgpack encode (msgspec)", "msgpack_encode_per_s", f"task state record, {L['state_bytes']:.0f} B"),
        row("msgpack decode (msgspec)", "msgpack_decode_per_s", "same"),
        row("rocksdict batched put", "rocksdb_batched_put_per_s", "1,000 puts per WriteBatch, 200 B values"),
        row("rocksdict point get", "rocksdb_point_get_per_s", "present keys, out of order"),
        row("confluent-kafka produce", "kafka_produce_per_s", "100 B, idempotent, acks=all, linger.ms=5, 8 partitions"),
        row("confluent-kafka transactional produce", "kafka_txn_produce_per_s", "100 B, 2,000 records per transaction"),
        row("confluent-kafka consume", "kafka_consume_per_s", "100 B, read_committed"),
        ["Kafka transaction of 1 record, begin→committed", "", f"{L['kafka_txn_commit_p50_ms'] * 1000:,.0f}",
         f"p50 {L['kafka_txn_commit_p50_ms']:.1f} ms, p99 {L['kafka_txn_commit_p99_ms']:.1f} ms: "
         "the floor of one scheduler hop on Kafka"],
    ]


def text(doc: dict[str, Any]) -> str:
    lines = [report.text_table(["limit", "ops/s", "µs/op", "what"], _rows(doc)), ""]
    lines.append(report.text_table(["fold (in memory)", "events/s", "commands/s", "tasks/s"], [
        [k, report.fmt(v["events_per_s"]), report.fmt(v["commands_per_s"]), report.fmt(v["tasks_per_s"])]
        for k, v in doc["fold"].items()]))
    lines.append("")
    for b, c in doc["ceiling_tasks_per_s"].items():
        lines.append(f"ceiling of a noop task on one core, {b}: {c:,} tasks/s "
                     + json.dumps(doc["ceiling_us_per_task"][b]))
    lines.append(report.text_table(["fraction", "value"], [[k, f"{v:.1%}"] for k, v in doc["fractions"].items()]))
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    c = doc["ceiling_us_per_task"]["kafka"]
    e = doc["ceiling_us_per_task"]["embedded"]
    ct = doc["ceiling_tasks_per_s"]
    L = doc["limits"]
    return f"""## Physical limits (issue 7)

Measured {doc['when']} by `make bench-peers` (`python -m bench.limits`), same machine and broker as the
peers table; one Python thread, best of three rounds. Load average when it began:
{'/'.join(str(x) for x in doc['load_before'])} (other work was running: treat single figures as ±30 %).

{report.md_table(["building block", "ops/s", "µs/op", "what"], _rows(doc), "lrrl")}

The scheduler fold alone (in memory, no codec, no log), one command per transaction as the
virtual-time harness drives it, and up to 2,000 commands per transaction as the runner folds a poll:

{report.md_table(["fold", "events/s", "commands/s", "tasks/s"], [
        [k, report.fmt(v["events_per_s"]), report.fmt(v["commands_per_s"]), report.fmt(v["tasks_per_s"])]
        for k, v in doc["fold"].items()])}

**Ceilings.** A noop task costs dagfold at least its records: 2 commands, 3 events and 1 dispatch
record. On Kafka that is 6 Avro encodes ({c['6 Avro encodes']:.1f} µs), 6 decodes ({c['6 Avro decodes']:.1f} µs),
6 produces ({c['6 Kafka produces']:.1f} µs), 6 consumes ({c['6 Kafka consumes']:.1f} µs) and 3 state writes
({c['3 RocksDB batched puts'] + c['3 msgpack encodes']:.1f} µs with their msgpack): {c['total']:.1f} µs, i.e.
**{ct['kafka']:,} tasks/s on one core**. On the embedded log the produces and consumes become RocksDB puts
and reads ({e['total']:.1f} µs in all): **{ct['embedded']:,} tasks/s**. A transaction (the scheduler's
unit of output on Kafka) takes {L['kafka_txn_commit_p50_ms']:.1f} ms at p50 and {L['kafka_txn_commit_p99_ms']:.1f} ms
at p99 from begin to committed, which bounds a dependency hop from below. dagfold's rates as fractions:

{report.md_table(["dagfold rate", "fraction"], [[k, f"{v:.1%}"] for k, v in doc["fractions"].items()], "lr")}

Raw figures: `bench/results/limits.json`.
"""


if __name__ == "__main__":
    main()
