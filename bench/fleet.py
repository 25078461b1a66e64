"""Fleet benchmark: the deployed GPU path at 10,000 GPUs (1,250 hosts of 8) on Kafka.

The real scheduler (``SchedulerRunner``) and the real allocator runtime (the allocator's
``ProcessorSpec`` on ``PartitionProcessor``, its fold timed per command) run as threads of this
process on a local KRaft broker; an **agent-fleet simulator** runs in a child process and does
what 1,250 node agents do over Kafka, at their real rates: RegisterNode per host, a NodeHeartbeat
per host every ``--hb-s`` (with its running allocations and eight GpuStatus entries), the
scheduler reports of each gang's first host (TaskStarted, TaskHeartbeat every lease/4,
TaskSucceeded), ReleaseAllocation when a job ends or is told to stop (StopAllocation: a
checkpointed stop releases as ``preempted``). Job processes are not started: a granted job
"runs" for its duration. Jobs arrive at ``--rate`` per second (shapes 1, 2, 4, 8 GPUs and 2x8
gangs; tiers enterprise/standard/free; durations 30-180 s).

Measured (``bench/results/gpu-fleet.json``, docs/gpu-scheduling.md §7.5):

* heartbeat processing: allocator commands (heartbeats most of them) folded and committed per
  second over the measurement window, beside those appended to ``allocator.commands`` and the
  heartbeats the fleet sent; NodeHeartbeatRecorded events per second (a heartbeat with nothing
  new is recorded only when the lease needs renewing, so these are fewer);
* allocator lag: records between the allocator's committed offset and the end of its
  ``allocator.commands`` partition, sampled every second (p50, p99, max);
* decision latency: fold time of each command that produced a decision (grant, preemption,
  rejection), p50/p99 (the runner's own metric observes the same time);
* grant latency: the RequestAllocation's broker append time to the allocator's clock when it
  folded the grant, for requests granted without a queue wait (``waited_ms`` 0);
* lost host: one host with running jobs stops heartbeating; time from its last heartbeat to the
  allocator's NodeDrained(lost), and until every job it ran was granted again elsewhere.

    .venv/bin/python -m bench.fleet [--hosts 1250] [--seconds 120] [--rate 20] [--lease-s 30]
    make bench-gpu-fleet [FLEET_HOSTS=1250 FLEET_SECONDS=120]   # the same under `timeout`
    .venv/bin/python -m bench.fleet --drain 10 [--hosts 1250]   # heartbeat capacity from a backlog
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POOL = "fleet"
A = "dagfold.allocator."


# -- the fleet (child process) ---------------------------------------------------------------
def fleet_main(url: str, hosts: int, gpus: int, hb_s: float, out_path: str) -> None:
    """Run ``hosts`` simulated agents until stdin closes; ``kill N`` on stdin silences host N."""
    from dagfold.codec import default_codec, make
    from dagfold.config import ALLOCATOR_COMMANDS, COMMANDS, CONTROL
    from dagfold.log import TopicPartition, open_log
    from dagfold.services.allocator import commands as cmds

    lg = open_log(url, Path(tempfile.mkdtemp()))
    codec = default_codec()
    prod = lg.producer("fleet")
    cons = lg.consumer(None, client_id="fleet-control")
    tps = [TopicPartition(CONTROL, p) for p in range(lg.partitions(CONTROL))]
    cons.assign(lg.end_offsets(tps))
    nodes = [f"h{i:04d}" for i in range(hosts)]
    inc = int(time.time() * 1000)
    running: dict[str, dict[str, Any]] = {}  # alloc_id@node -> job
    silenced: set[str] = set()
    last_hb: dict[str, float] = {}
    sent = {"heartbeats": 0, "started": 0, "succeeded": 0, "released": 0}

    def alloc_cmd(rec: dict[str, Any]) -> None:
        prod.send(ALLOCATOR_COMMANDS, POOL.encode(), codec.encode(rec))

    def sched(kind: str, j: dict[str, Any], **kw: Any) -> None:
        rec = make(f"dagfold.command.Task{kind}", job_id=j["job_id"], task_id=j["task_id"], attempt=j["attempt"],
                   worker_id=j["alloc_id"], ts_ms=int(time.time() * 1000), **kw)
        prod.send(COMMANDS, j["job_id"].encode(), codec.encode(rec))

    for n in nodes:
        alloc_cmd(cmds.register_node(POOL, n, "H100", gpus, incarnation=inc, ts_ms=inc))
    prod.flush()
    stdin_lines: list[str] = []
    eof = threading.Event()

    def read_stdin() -> None:
        for x in sys.stdin:
            stdin_lines.append(x.strip())
        eof.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    start = time.monotonic()
    next_hb = {n: start + hb_s * i / hosts for i, n in enumerate(nodes)}  # staggered, as real hosts are
    next_flush = start
    while True:
        while stdin_lines:
            cmd = stdin_lines.pop(0).split()
            if cmd and cmd[0] == "kill":
                silenced.add(cmd[1])
                for k in [k for k, j in running.items() if j["node"] == cmd[1]]:
                    del running[k]
        if eof.is_set() and not stdin_lines:
            break
        for r in cons.poll(2000, 0.0):
            c = codec.decode(r.value)
            node = c.get("node_id")
            if node not in next_hb or node in silenced:
                continue
            key = f"{c['alloc_id']}@{node}"
            if c["type"] == "dagfold.control.GpuTaskDispatch" and key not in running:
                args = json.loads(c["args_json"] or "{}")
                j = {"job_id": c["job_id"], "task_id": c["task_id"], "attempt": c["attempt"], "node": node,
                     "alloc_id": c["alloc_id"], "epoch": c["epoch"], "leader": c["leader"],
                     "ends": time.monotonic() + float(args.get("duration_s", 60)), "stop_at": None,
                     "report_every": max(hb_s, c["lease_timeout_s"] / 4), "next_report": 0.0,
                     "started": time.monotonic()}
                running[key] = j
                if j["leader"]:
                    sched("Started", j)
                    sent["started"] += 1
            elif c["type"] == A + "StopAllocation" and c["alloc_id"] and key in running:
                j = running[key]
                j["stop_at"] = time.monotonic() + (1.0 if c["checkpoint"] else 0.0)  # checkpoint, then exit
                j["stop_checkpoint"] = c["checkpoint"]
        now = time.monotonic()
        for key, j in list(running.items()):
            if j["stop_at"] is not None and now >= j["stop_at"]:
                del running[key]
                uri = f"s3://ckpt/{j['job_id']}" if j.get("stop_checkpoint") else None
                alloc_cmd(cmds.release_allocation(POOL, j["alloc_id"], j["epoch"], j["node"],
                                                  "preempted" if uri else "fenced", checkpoint_uri=uri,
                                                  ts_ms=int(time.time() * 1000)))
                sent["released"] += 1
            elif j["stop_at"] is None and now >= j["ends"]:
                del running[key]
                alloc_cmd(cmds.release_allocation(POOL, j["alloc_id"], j["epoch"], j["node"], "completed",
                                                  exit_code=0, ts_ms=int(time.time() * 1000)))
                sent["released"] += 1
                if j["leader"]:
                    sched("Succeeded", j)
                    sent["succeeded"] += 1
            elif j["leader"] and j["stop_at"] is None and now >= j["next_report"]:
                j["next_report"] = now + j["report_every"]
                sched("Heartbeat", j, progress=min(1.0, (now - j["started"]) / max(j["ends"] - j["started"], 1e-3)))
        by_node: dict[str, list[dict[str, Any]]] = {}
        for j in running.values():
            by_node.setdefault(j["node"], []).append(j)
        for n in nodes:
            if n in silenced or now < next_hb[n]:
                continue
            next_hb[n] += hb_s
            mine = by_node.get(n, [])
            statuses = [cmds.alloc_status(j["alloc_id"], j["epoch"]) for j in mine]
            busy = len(mine)
            gpu_recs = [cmds.gpu_status(i, utilization=0.9 if i < busy else 0.0, memory_total_mib=81_559,
                                        temperature_c=50.0) for i in range(gpus)]
            alloc_cmd(cmds.node_heartbeat(POOL, n, incarnation=inc, ts_ms=int(time.time() * 1000), perf=1.0,
                                          allocations=statuses, gpus=gpu_recs))
            last_hb[n] = time.time()
            sent["heartbeats"] += 1
        if time.monotonic() >= next_flush:
            next_flush = time.monotonic() + 0.2
            prod.flush(30.0)
        tmp = Path(out_path + ".tmp")  # replaced whole: the parent never reads half a file
        tmp.write_text(json.dumps({"sent": sent, "last_hb": {n: last_hb.get(n) for n in silenced},
                                   "running": len(running), "by_node": {n: len(v) for n, v in by_node.items()}}))
        os.replace(tmp, out_path)
        time.sleep(0.01)


def _start_broker(broker: Any) -> Any:
    """Start the local broker, waiting up to KAFKA_START_TIMEOUT seconds (a loaded machine takes minutes)."""
    broker.data.mkdir(parents=True, exist_ok=True)
    try:
        broker.sh("start", timeout=float(os.environ.get("KAFKA_START_TIMEOUT", "90")) + 60)
    except BaseException:
        broker.stop()  # a broker that started after the wait is not left running
        raise
    return broker


# -- the benchmark (parent) ------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(hosts: int, seconds: float, rate: float, hb_s: float, lease_s: float, seed: int) -> dict[str, Any]:
    from dagfold.codec import default_codec
    from dagfold.commands import CommandSender, submit_job
    from dagfold.config import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS, Config
    from dagfold.exceptions import LogError
    from dagfold.jobspec import parse_spec, to_job_spec
    from dagfold.localkafka import LocalKafka, free_base_port
    from dagfold.log import TopicPartition, open_log
    from dagfold.log.reader import read_to_end
    from dagfold.processor import PartitionProcessor
    from dagfold.services.allocator.fold import AllocatorFold
    from dagfold.services.allocator.options import AllocatorOptions
    from dagfold.services.allocator.runner import allocator_spec
    from dagfold.services.scheduler.runner import SchedulerRunner

    load_before = [round(x, 1) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="fleet-"))
    port = int(os.environ.get("BENCH_KAFKA_PORT", "0")) or free_base_port(range(20150, 29150, 100))
    broker = _start_broker(LocalKafka(port, work / "kafka"))
    try:
        url = broker.url
        cfg = Config(log_url=url, data_dir=work / "data")
        lg = open_log(url, cfg.data_dir)
        lg.create_topics(cfg.core_topics())
        stop = threading.Event()
        sched = SchedulerRunner(lg, cfg)
        threading.Thread(target=sched.run, args=(stop,), daemon=True).start()
        opts = AllocatorOptions(pool=POOL, lease_s=lease_s)
        decisions: list[tuple[float, int]] = []  # (fold seconds of the command, decisions in it)

        class TimedFold(AllocatorFold):
            def process(self, txn: Any, command: Any, now_ms: int, offset: int) -> Any:
                t0 = time.perf_counter()
                out = super().process(txn, command, now_ms, offset)
                n = sum(o.record.get("type") in (A + "AllocationGranted", A + "PreemptionRequested",
                                                 A + "RequestRejected") for o in out)
                if n:
                    decisions.append((time.perf_counter() - t0, n))
                return out

        spec = replace(allocator_spec(lg, opts, cfg.data_dir), fold_for=lambda p, s: TimedFold(s, opts))
        cmd_tp = TopicPartition(ALLOCATOR_COMMANDS, lg.partition_for(POOL.encode(), lg.partitions(ALLOCATOR_COMMANDS)))
        probe = lg.consumer(spec.group, client_id="fleet-lag")
        for attempt in range(120):  # a fresh broker answers NOT_COORDINATOR until its offsets topic is up
            try:
                probe.committed([cmd_tp])
                break
            except LogError:
                if attempt == 119:
                    raise
                time.sleep(1.0)
        alloc = PartitionProcessor(lg, spec, f"allocator-{POOL}")
        alloc.start()
        threading.Thread(target=alloc.run, args=(stop,), daemon=True).start()
        state_file = work / "fleet.json"
        child = subprocess.Popen([sys.executable, "-m", "bench.fleet", "--child", url, str(hosts), "8", str(hb_s),
                                  str(state_file)], cwd=ROOT, stdin=subprocess.PIPE, text=True)
        sender = CommandSender(lg, "fleet-bench")
        rng = random.Random(seed)
        shapes = [(1, 1, 0.3), (2, 1, 0.25), (4, 1, 0.2), (8, 1, 0.15), (8, 2, 0.1)]
        tiers = [("enterprise", 0.2), ("standard", 0.5), ("free", 0.3)]
        lags: list[int] = []
        folded: list[tuple[float, int, int]] = []  # (monotonic s, commands the allocator folded, log end)
        consumer = probe
        t0 = time.monotonic()
        n_jobs = 0
        killed: str | None = None
        kill_at: float | None = None
        next_sample = t0
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            due = int((now - t0) * rate)
            while n_jobs < due:
                g, h = rng.choices([(s[0], s[1]) for s in shapes], [s[2] for s in shapes])[0]
                tier = rng.choices([t[0] for t in tiers], [t[1] for t in tiers])[0]
                doc = {"id": f"job-{n_jobs:06d}", "tenant": f"t{rng.randrange(20)}", "tier": tier,
                       "tasks": [{"id": "run", "handler": "gpu", "queue": POOL,
                                  "args": {"duration_s": rng.uniform(30, 180)},
                                  "resources": {"gpus": g, "hosts": h, "checkpoint": True}}]}
                sender.send(submit_job(to_job_spec(parse_spec(doc)), "fleet-bench"))
                n_jobs += 1
            if now >= next_sample:
                next_sample += 1.0
                end = lg.end_offsets([cmd_tp])[cmd_tp]
                committed = consumer.committed([cmd_tp]).get(cmd_tp, 0)
                lags.append(max(end - committed, 0))
                folded.append((now, alloc.folded, end))
            if killed is None and now - t0 >= seconds * 0.6 and state_file.exists():
                by_node = json.loads(state_file.read_text())["by_node"]
                if by_node:
                    killed = max(by_node, key=lambda n: by_node[n])
                    kill_at = time.time()
                    assert child.stdin is not None
                    child.stdin.write(f"kill {killed}\n")
                    child.stdin.flush()
            time.sleep(0.02)
        measured_s = time.monotonic() - t0
        # what the fleet had sent when the window closed (it goes on heartbeating while the lost host's lease
        # runs out below, so its final counts cover more than the window)
        sent_in_window = json.loads(state_file.read_text())["sent"] if state_file.exists() else {"heartbeats": 0}
        time.sleep(lease_s + 5)  # let the lost host's lease run out and its jobs move
        fleet = json.loads(state_file.read_text())
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        stop.set()
        time.sleep(1)
        codec = default_codec()
        ev_tp = TopicPartition(ALLOCATOR_EVENTS, lg.partition_for(POOL.encode(), lg.partitions(ALLOCATOR_EVENTS)))
        events = [codec.decode(r.value) for recs in read_to_end(lg, ev_tp) for r in recs]
        commands = {r.offset: r.timestamp_ms for recs in read_to_end(lg, cmd_tp) for r in recs}
        hb = [e for e in events if e["type"] == A + "NodeHeartbeatRecorded"]
        span = (hb[-1]["ts_ms"] - hb[0]["ts_ms"]) / 1000 if len(hb) > 1 else 0.0
        grants = [e for e in events if e["type"] == A + "AllocationGranted"]
        at_once = [(e["ts_ms"] - commands[e["cause_offset"]]) / 1000 for e in grants
                   if e["waited_ms"] == 0 and e["cause_offset"] in commands]
        lost = [e for e in events if e["type"] == A + "NodeDrained" and e["node_id"] == killed and e["lost"]]
        last_hb = (fleet.get("last_hb") or {}).get(killed or "")
        moved = [e for e in events if e["type"] == A + "AllocationExpired"  # by the lost host's lease, not an
                 and e.get("reason") == f"node {killed} lease expired"]  # orphan expiry naming the host
        regrant = []
        for m in moved:
            later = [g for g in grants if g["job_id"] == m["job_id"] and g["ts_ms"] >= m["ts_ms"]]
            if later:
                regrant.append(later[0]["ts_ms"] / 1000)
        lat = [s for s, n in decisions for _ in range(n)]
        return {
            "hosts": hosts, "gpus": hosts * 8, "heartbeat_s": hb_s, "lease_s": lease_s, "seconds": round(measured_s, 1),
            "jobs_submitted": n_jobs, "fleet_sent": fleet["sent"],
            "heartbeats_recorded": len(hb), "heartbeats_recorded_per_s": round(len(hb) / span, 1) if span else None,
            "heartbeats_offered_per_s": round(hosts / hb_s, 1),
            "heartbeats_sent_per_s": round(sent_in_window["heartbeats"] / measured_s, 1),
            # every allocator command (heartbeats most of them) folded and committed, and appended, per second
            "commands_folded_per_s": round((folded[-1][1] - folded[0][1]) / (folded[-1][0] - folded[0][0]), 1)
            if len(folded) > 1 else None,
            "commands_appended_per_s": round((folded[-1][2] - folded[0][2]) / (folded[-1][0] - folded[0][0]), 1)
            if len(folded) > 1 else None,
            "allocator_lag_records": {"p50": pct([float(x) for x in lags], 0.5),
                                      "p99": pct([float(x) for x in lags], 0.99), "max": max(lags, default=0)},
            "decisions": len(lat), "grants": len(grants),
            "decision_ms": {"p50": round(1000 * (pct(lat, 0.5) or 0), 3),
                            "p99": round(1000 * (pct(lat, 0.99) or 0), 3)},
            "grant_at_once_log_to_log_ms": {"n": len(at_once), "p50": round(1000 * (pct(at_once, 0.5) or 0), 1),
                                            "p99": round(1000 * (pct(at_once, 0.99) or 0), 1)},
            "lost_host": {"node": killed, "jobs": len(moved),
                          "last_heartbeat_to_drained_s": round(lost[0]["ts_ms"] / 1000 - last_hb, 2)
                          if lost and last_hb else None,
                          "kill_to_all_regranted_s": round(max(regrant) - kill_at, 2)
                          if regrant and kill_at and len(regrant) == len(moved) else None},
            "jobs_per_s": rate,
            "load_average_before": load_before,
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    finally:
        broker.stop()


def drain(hosts: int, rounds: int, lease_s: float, renew: list[float | None]) -> dict[str, Any]:
    """Heartbeat processing capacity of the allocator runtime on Kafka, apart from the fleet's own CPU.

    ``rounds`` heartbeats of each of ``hosts`` 8-GPU hosts (3 of 8 GPUs busy, as the fleet sends them)
    are appended to ``allocator.commands`` first; then the allocator runtime (the real spec on
    ``PartitionProcessor``, stepped in this thread) folds the backlog, its clock advancing one second
    per ``hosts`` heartbeats as if they arrived at 1 per host per second. Measured: wall and this
    thread's CPU time (``thread_time``: the fold, the codec, the runtime; not the broker) per
    heartbeat, once per ``lease_renew_s`` setting in ``renew`` (0: every heartbeat recorded, the
    behaviour before heartbeats with nothing new went unrecorded), each on a fresh topic namespace.
    """
    from dagfold.codec import default_codec
    from dagfold.config import ALLOCATOR_COMMANDS, Config
    from dagfold.exceptions import LogError
    from dagfold.localkafka import LocalKafka, free_base_port
    from dagfold.log import open_log
    from dagfold.processor import PartitionProcessor
    from dagfold.services.allocator import commands as cmds
    from dagfold.services.allocator.options import AllocatorOptions
    from dagfold.services.allocator.runner import allocator_spec

    work = Path(tempfile.mkdtemp(prefix="fleet-drain-"))
    port = int(os.environ.get("BENCH_KAFKA_PORT", "0")) or free_base_port(range(20150, 29150, 100))
    broker = _start_broker(LocalKafka(port, work / "kafka"))
    codec = default_codec()
    out: dict[str, Any] = {"hosts": hosts, "heartbeats": hosts * rounds, "lease_s": lease_s, "runs": []}
    try:
        for k, r in enumerate(renew):
            url = f"{broker.url}?prefix=drain{k}"
            cfg = Config(log_url=url, data_dir=work / f"data{k}")
            lg = open_log(url, cfg.data_dir)
            lg.create_topics(cfg.core_topics())
            prod = lg.producer("fleet-drain")
            t0 = 1_800_000_000_000
            for i in range(hosts):
                prod.send(ALLOCATOR_COMMANDS, POOL.encode(), codec.encode(
                    cmds.register_node(POOL, f"h{i:04d}", "H100", 8, incarnation=7, ts_ms=t0)))
            prod.flush(120.0)
            clock = [t0 / 1000]
            opts = AllocatorOptions(pool=POOL, lease_s=lease_s, lease_renew_s=r, notify_scheduler=False)
            spec = allocator_spec(lg, opts, cfg.data_dir, clock=lambda c=clock: c[0])
            alloc = PartitionProcessor(lg, spec, f"allocator-{POOL}")
            for attempt in range(120):  # a fresh broker answers NOT_COORDINATOR until its offsets topic is up
                try:
                    alloc.start()
                    break
                except LogError:
                    if attempt == 119:
                        raise
                    alloc._started = False
                    time.sleep(1.0)
            total = hosts * (rounds + 1)
            while alloc.folded < hosts:  # the registrations first, then the backlog of heartbeats
                alloc.step(1.0)
            for n in range(rounds):
                for i in range(hosts):
                    gpus = [cmds.gpu_status(g, utilization=0.9 if g < 3 else 0.0, memory_total_mib=81_559,
                                            temperature_c=50.0) for g in range(8)]
                    prod.send(ALLOCATOR_COMMANDS, POOL.encode(), codec.encode(cmds.node_heartbeat(
                        POOL, f"h{i:04d}", incarnation=7, ts_ms=t0 + 1000 * n, perf=1.0, gpus=gpus)))
            prod.flush(120.0)
            prod.close()
            wall0, cpu0, done0 = time.perf_counter(), time.thread_time(), alloc.folded
            while alloc.folded < total:
                clock[0] = t0 / 1000 + (alloc.folded - hosts) / hosts  # one second per round of heartbeats
                alloc.step(1.0)
            wall, cpu, n = time.perf_counter() - wall0, time.thread_time() - cpu0, alloc.folded - done0
            alloc.close()
            lg.close()
            out["runs"].append({"lease_renew_s": r, "heartbeats_folded": n, "wall_s": round(wall, 2),
                                "cpu_s": round(cpu, 2), "heartbeats_per_s_wall": round(n / wall, 1),
                                "cpu_us_per_heartbeat": round(cpu / n * 1e6, 1),
                                "heartbeats_per_cpu_s": round(n / cpu, 1),
                                "load_average": [round(x, 1) for x in os.getloadavg()]})
            print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        broker.stop()
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    out["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, url, hosts, gpus, hb_s, out = sys.argv
        fleet_main(url, int(hosts), int(gpus), float(hb_s), out)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=1250)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=None,
                    help="jobs submitted per second (default 20 per 1,250 hosts: the same offered load at any size)")
    ap.add_argument("--hb-s", type=float, default=1.0)
    ap.add_argument("--lease-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--drain", type=int, default=0, metavar="ROUNDS",
                    help="instead: time the allocator folding ROUNDS heartbeats per host from a backlog, with "
                         "every heartbeat recorded (lease_renew_s 0) and with the default (see drain())")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.drain:
        res = drain(a.hosts, a.drain, a.lease_s, [0.0, None, 0.0, None])
        a.out = a.out or str(ROOT / "bench" / "results" / "gpu-fleet-drain.json")
    else:
        rate = a.rate if a.rate is not None else max(1.0, round(20.0 * a.hosts / 1250, 2))
        res = run(a.hosts, a.seconds, rate, a.hb_s, a.lease_s, a.seed)
        a.out = a.out or str(ROOT / "bench" / "results" / "gpu-fleet.json")
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
