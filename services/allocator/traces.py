"""Loading the Alibaba openb GPU traces (cluster-trace-gpu-v2023) for the simulator.

Nodes: ``sn,cpu_milli,memory_mib,gpu,model``; pods: ``name,cpu_milli,memory_mib,
num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,creation_time,deletion_time,
scheduled_time]`` (times in seconds). ``gpu_spec`` like ``V100M16|V100M32``
restricts GPU types.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from dagfold.services.allocator.exceptions import TraceError

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TRACES = ("default", "multigpu50", "gpuspec33")


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    qos: str
    creation_s: int | None
    deletion_s: int | None

    @property
    def gpu_request_milli(self) -> int:
        """GPU milli this pod asks for in total (the FGD protocol's arrival measure)."""
        return self.num_gpu * self.gpu_milli if self.num_gpu else 0


def data_dir(explicit: Path | None = None) -> Path:
    d = explicit or DEFAULT_DATA
    if not (d / "openb").is_dir():
        raise TraceError(f"no openb trace folder under {d} (expected {d / 'openb'})")
    return d


def load_nodes(data: Path) -> list[TraceNode]:
    path = data / "openb" / "openb_node_list_gpu_node.csv"
    try:
        with path.open() as f:
            return [TraceNode(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"])
                    for r in csv.DictReader(f) if int(r["gpu"]) > 0]
    except (OSError, KeyError, ValueError) as exc:
        raise TraceError(f"cannot read {path}: {exc}") from exc


def _opt_int(v: str | None) -> int | None:
    return int(v) if v not in (None, "") else None


def load_pods(data: Path, trace: str) -> list[TracePod]:
    path = data / "openb" / f"openb_pod_list_{trace}.csv"
    try:
        with path.open() as f:
            out = []
            for r in csv.DictReader(f):
                spec = r.get("gpu_spec") or ""
                g = int(r["num_gpu"])
                out.append(TracePod(r["name"], int(r["cpu_milli"]), int(r["memory_mib"]), g,
                                    int(r["gpu_milli"]) if g else 0,
                                    tuple(sorted(s for s in spec.split("|") if s)), r.get("qos") or "",
                                    _opt_int(r.get("creation_time")), _opt_int(r.get("deletion_time"))))
            return out
    except (OSError, KeyError, ValueError) as exc:
        raise TraceError(f"cannot read {path}: {exc}") from exc


def resample(pods: list[TracePod], capacity_milli: int, ratio: float, seed: int) -> list[TracePod]:
    """The FGD protocol's workload: the trace's pods plus pods drawn (with replacement) from it until
    their GPU request would pass ``ratio`` x capacity, then shuffled; all with ``seed``."""
    rng = random.Random(seed)
    total = sum(p.gpu_request_milli for p in pods)
    out = list(pods)
    target = ratio * capacity_milli
    while True:
        p = rng.choice(pods)
        if total + p.gpu_request_milli > target:
            break
        total += p.gpu_request_milli
        out.append(p)
    rng.shuffle(out)
    return out
