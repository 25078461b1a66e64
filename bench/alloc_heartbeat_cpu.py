"""CPU per recorded node heartbeat in the allocator fold (docs/benchmarks.md, the heartbeat levers of issue 14 part 6).

A pool of 1,250 8-GPU hosts with 1,250 4-GPU jobs on them (virtual-time harness, MemoryStore, batches
of 2,048 commands as the simulator commits them); then rounds of one heartbeat per host, 240 ms of
virtual time apart (so each one renews the lease and is recorded), every other round with a new
checkpoint per allocation. Prints the thread CPU per heartbeat (fold plus building the command), the
best of ``--repeat`` measurements of ``--rounds`` rounds, and the load average. Compare two trees by
running it alternately with each on ``PYTHONPATH``.

    .venv/bin/python -m bench.alloc_heartbeat_cpu [--rounds 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dagfold.services.allocator import commands as cmds
from dagfold.services.allocator.harness import SimAllocator
from dagfold.services.allocator.options import AllocatorOptions


def pool(hosts: int = 1250) -> SimAllocator:
    h = SimAllocator(opts=AllocatorOptions(lease_s=900), keep_events=False, commit_every=2048)
    for i in range(hosts):
        h.register(f"n{i:04d}")
    for j in range(hosts):
        h.request(f"j{j}", gpus=4, checkpoint=True, max_runtime_s=3600)
    h.commit()
    return h


def heartbeats(h: SimAllocator, rounds: int) -> float:
    """CPU µs per heartbeat over ``rounds`` heartbeats of every host."""
    st = h.fold.state
    on = {nid: [(a, st.allocs[a].epoch) for a in n.allocs] for nid, n in st.nodes.items()}
    t0 = time.thread_time()
    n = 0
    for r in range(rounds):
        for nid in sorted(on):
            h.now_ms += 240
            allocs = [cmds.alloc_status(a, e, progress=0.5, last_checkpoint_ms=h.now_ms - 1000 if r % 2 else None,
                                        checkpoint_uri=f"ckpt://{a}/{r}" if r % 2 else None) for a, e in on[nid]]
            h.process(cmds.node_heartbeat(h.pool, nid, ts_ms=h.now_ms, perf=1.0, allocations=allocs))
            n += 1
    h.commit()
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    h = pool()
    heartbeats(h, 2)  # warm up: every lease timer and checkpoint key exists
    best = min(heartbeats(h, a.rounds) for _ in range(a.repeat))
    print(json.dumps({"cpu_us_per_heartbeat": round(best, 2), "load_average": [round(x, 1) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
