"""Where a dagfold run's CPU goes: per process (measured) and per component (py-spy samples).

    python -m bench.peers.run_dagfold ... --pyspy-all DIR --out run.json
    python -m bench.peers.cpu_split DIR run.json

Each process's CPU time (``cpu_by_process_s``, from /proc) is split over components in
proportion to py-spy's samples of that process that are not idle; a sample belongs to the
first component found from its innermost frame outwards (so fastavro called by the fold
counts as the codec, a dict lookup in the fold as the fold). Prints µs per task.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# (substring of a frame's file, component), tried from the innermost frame outwards
RULES: list[tuple[str, str]] = [
    ("probe.py", "bench meter (reads /proc; not the system's)"),
    ("fastavro", "codec (Avro)"), ("dagfold/codec.py", "codec (Avro)"),
    ("msgspec", "state store"), ("rocksdict", "state store"), ("dagfold/state/", "state store"),
    ("confluent_kafka", "Kafka client"), ("dagfold/log/kafka.py", "Kafka client"),
    ("dagfold/log/embedded.py", "embedded log"), ("dagfold/log/", "log plumbing"),
    ("logging/", "logging"), ("dagfold/logs.py", "logging"),
    ("prometheus_client", "metrics"), ("dagfold/metrics.py", "metrics"),
    ("services/scheduler/", "scheduler fold"),
    ("dagfold/processor/", "runtime (poll, transaction, commit)"),
    ("projections/", "projector"),
    ("services/worker/", "worker"),
    ("services/stack.py", "bench client (submit, wait)"), ("bench/", "bench client (submit, wait)"),
    ("dagfold/commands.py", "bench client (submit, wait)"),
    ("dagfold/cli/", "CLI main thread (waits for its worker threads)"),
]


def component(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for needle, name in RULES:
            if needle in frame:
                return name
    return "other (interpreter, threads)"


def samples(path: Path) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[component(stack)] += int(n)
    return out


def split(folder: Path, result: dict) -> dict[str, dict[str, float]]:
    """{process label: {component: µs per task}} (processes without samples: one 'all' entry)."""
    tasks = result["done"] or result["tasks"]
    by_label: dict[str, Counter[str]] = {}
    for f in sorted(folder.glob("*.txt")):
        label = f.stem.rsplit("-", 1)[0].replace("-", " ")
        by_label.setdefault(label, Counter()).update(samples(f))
    out: dict[str, dict[str, float]] = {}
    for label, cpu_s in result["cpu_by_process_s"].items():
        if label == "py-spy":
            continue
        us = cpu_s / tasks * 1e6
        counts = by_label.get(label)
        if not counts:
            out[label] = {"all": round(us, 1)}
            continue
        total = sum(counts.values())
        out[label] = {c: round(us * n / total, 1) for c, n in counts.most_common()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("result", type=Path, help="the run's JSON line (run_dagfold --out)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lines = [ln for ln in args.result.read_text().splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1])
    table = split(args.folder, result)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    total = sum(sum(v.values()) for v in table.values())
    print(f"{result['system']} {result['workload']}: {result['tasks_per_s']} tasks/s, "
          f"{total:.0f} µs CPU per task (py-spy's own CPU excluded)")
    for label, comps in sorted(table.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {label}: {sum(comps.values()):.0f} µs")
        for c, us in comps.items():
            print(f"      {c:40s} {us:8.1f}")


if __name__ == "__main__":
    main()
