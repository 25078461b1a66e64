"""Measuring helpers shared by every system's runner (stdlib only, Linux /proc).

* ``task_probe``: peers' noop tasks call it; it appends ``task_id start end`` (wall
  clock, seconds) to a per-process file under ``$BENCH_PROBE_DIR``. Latency from
  an upstream's success to a downstream's start is computed from these files
  (dagfold's is computed the same way from the worker reports on its log).
* ``Meter``: CPU of a process tree (plus infrastructure processes such as the
  Kafka broker or redis-server) between ``start`` and ``stop``, and the peak of
  the tree's summed RSS, sampled every 50 ms (cheap: the bench shares the GIL with dagfold).
* ``thread_cpu_s`` / ``proc_cpu_s``: CPU time of one thread or one process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

# -- task timing ----------------------------------------------------------------
_probe_fh: Any = None
_probe_pid = -1


def task_probe(task_id: str, start: float) -> None:
    """Record that ``task_id`` ran from ``start`` to now (called at the end of a noop task)."""
    global _probe_fh, _probe_pid
    end = time.time()
    pid = os.getpid()
    if _probe_fh is None or _probe_pid != pid:  # forked pool children open their own file
        d = os.environ.get("BENCH_PROBE_DIR")
        if not d:
            return
        _probe_fh = open(Path(d) / f"{pid}-{threading.get_native_id()}.tsv", "a", buffering=1)  # noqa: SIM115
        _probe_pid = pid
    _probe_fh.write(f"{task_id}\t{start:.6f}\t{end:.6f}\n")


def read_probes(d: Path) -> dict[str, tuple[float, float]]:
    """task -> (start, end) in seconds; the first run of a task wins (a redelivery is ignored)."""
    out: dict[str, tuple[float, float]] = {}
    for f in sorted(d.glob("*.tsv")):
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0] not in out:
                out[parts[0]] = (float(parts[1]), float(parts[2]))
    return out


def dependency_latencies_ms(dag: Sequence[tuple[str, list[str]]], start: dict[str, float],
                            end: dict[str, float]) -> list[float]:
    """ms from the last upstream's success (end) to the downstream's start, per task with upstreams."""
    out = []
    for t, ps in dag:
        if ps and t in start and all(p in end for p in ps):
            out.append((start[t] - max(end[p] for p in ps)) * 1000.0)
    return out


def percentile(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


# -- /proc -----------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def proc_cpu_s(pid: int) -> float:
    """user+system CPU seconds of a process (all its threads, living and ended); 0 if gone."""
    f = _stat_fields(pid)
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / _TICK


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds of one thread (schedstat: nanoseconds on a CPU)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except OSError:
        return 0.0


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's living threads by thread name (librdkafka's ``rdk:broker1`` and
    ``rdk:broker2`` add up as ``rdk:broker``; Python's threads are named after the program)."""
    out: dict[str, float] = {}
    try:
        tids = [d.name for d in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return out
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")].rstrip("0123456789-")
        f = raw[raw.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / _TICK
    return out


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except OSError:
        return 0


def hwm_bytes(pid: int) -> int:
    """Peak RSS of a process (VmHWM)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_label(pid: int, root: int) -> str:
    """What a measured process is: the bench process itself (client, projector, in-process parts), a
    ``dagfold <service>`` process, the Kafka broker (a JVM), or its program name."""
    if pid == root:
        return "bench process"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [a.decode(errors="replace") for a in argv if a]
    if "dagfold" in words and words.index("dagfold") + 1 < len(words):
        return "dagfold " + words[words.index("dagfold") + 1]
    if any("kafka" in w for w in words) and any(w.endswith("java") for w in words[:1]):
        return "kafka broker"
    return Path(words[0]).name if words else "?"


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        f = _stat_fields(int(p.name))
        if f is not None:
            children.setdefault(int(f[1]), []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class Meter:
    """CPU and peak RSS of this process's tree (``own``) and of ``infra`` processes, start→stop."""

    def __init__(self, infra: Iterable[int] = (), interval_s: float = 0.05, tree_every: int = 10) -> None:
        self.root = os.getpid()
        self.infra = [p for p in infra if p]
        self.interval_s = interval_s
        self.tree_every = tree_every  # rescan /proc for new processes every this many samples (it is slow)
        self._stop = threading.Event()
        self.peak_own = 0
        self.peak_infra = 0
        self._cpu0: dict[int, float] = {}
        self._tree: set[int] = set()
        self._n = 0
        self.own_cpu_s = 0.0

    def _sample(self) -> None:
        if self._n % self.tree_every == 0:
            self._tree.update(descendants(self.root))
        self._n += 1
        self.peak_own = max(self.peak_own, sum(rss_bytes(p) for p in self._tree))
        self.peak_infra = max(self.peak_infra, sum(rss_bytes(p) for p in self.infra))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()
        self.own_cpu_s = time.thread_time()  # this thread's CPU, all of it spent sampling

    def start(self) -> Meter:
        self._tree = set(descendants(self.root))
        self._cpu0 = {p: proc_cpu_s(p) for p in self._tree | set(self.infra)}
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="bench-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self._sample()
        # The meter's own sampling (reading /proc every 50 ms) is not the measured system's work: its
        # thread's CPU is taken out of this process's figure (it was 10-20% of a noop Montage run's).
        meter_s = self.own_cpu_s
        own = sum(proc_cpu_s(p) - self._cpu0.get(p, 0.0) for p in self._tree) - meter_s
        infra = sum(proc_cpu_s(p) - self._cpu0.get(p, 0.0) for p in self.infra)
        by_process: dict[str, float] = {}
        for p in sorted(self._tree | set(self.infra)):
            label = process_label(p, self.root)
            by_process[label] = round(by_process.get(label, 0.0) + proc_cpu_s(p) - self._cpu0.get(p, 0.0)
                                      - (meter_s if p == self.root else 0.0), 3)
        return {"own_cpu_s": round(own, 3), "infra_cpu_s": round(infra, 3), "cpu_by_process_s": by_process,
                "meter_cpu_s": round(meter_s, 3),
                "peak_rss_mib": round(self.peak_own / 2**20, 1), "infra_rss_mib": round(self.peak_infra / 2**20, 1),
                "processes": len(self._tree)}


# -- results -----------------------------------------------------------------------
def result(system: str, workload: str, dag: Sequence[tuple[str, list[str]]], *, status: str, seconds: float,
           done: int, meter: dict[str, Any], sched_cpu_s: float | None, lat_ms: Sequence[float],
           limit_s: float, workers: int, notes: str = "", **extra: Any) -> dict[str, Any]:
    n = len(dag)
    total_cpu = meter["own_cpu_s"] + meter["infra_cpu_s"]
    per = done if done > 0 else float("nan")  # per-task figures of a run that did nothing are undefined
    return {
        "system": system, "workload": workload, "tasks": n, "edges": sum(len(p) for _, p in dag),
        "workers": workers, "status": status, "limit_s": limit_s, "done": done,
        "seconds": round(seconds, 3), "tasks_per_s": round(done / seconds, 1) if seconds > 0 and done else None,
        "sched_cpu_s": None if sched_cpu_s is None else round(sched_cpu_s, 3),
        "sched_cpu_us_per_task": None if sched_cpu_s is None or not done else round(sched_cpu_s / per * 1e6, 1),
        "total_cpu_s": round(total_cpu, 3), "total_cpu_us_per_task": round(total_cpu / per * 1e6, 1) if done else None,
        "lat_p50_ms": _r(percentile(lat_ms, 50)), "lat_p99_ms": _r(percentile(lat_ms, 99)),
        "lat_samples": len(lat_ms), **meter, "notes": notes, **extra,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def emit(res: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(res)
    if out is not None:
        out.write_text(text + "\n")
    print(text)
    sys.stdout.flush()
