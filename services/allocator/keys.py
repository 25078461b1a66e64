"""RocksDB key layout of one pool's allocator state (its 'tables').

Separator 0x1F cannot appear in IDs (the scheduler's validation forbids control characters).

| table        | key                                 | value                                        |
|--------------|-------------------------------------|----------------------------------------------|
| meta         | ``m``                               | epoch and sequence counters, reservations, perf averages |
| profile      | ``p``                               | requests seen and the active class weights   |
| shapes       | ``s|shape``                         | requests seen of one shape (learned profile) |
| nodes        | ``n|node``                          | inventory, free GPU milli per GPU, lease, health, allocations |
| allocations  | ``a|alloc``                         | the grant: request, hosts and GPU indices, epoch, checkpoint |
| requests     | ``r|job|task|attempt``              | a queued request (tier, tenant, shape, sequence) |
| usage        | ``u|tier|tenant``                   | GPU milli in use by the tenant in the tier   |
| timers       | ``T|due(16)|kind|id``               | due-time index: node lease, grace, runtime, pass |
| checkpoints  | ``c|alloc``                         | [time, URI] of an allocation's last checkpoint |
| perf         | ``f|gpu type``                      | fleet average relative throughput (slow-node detection) |
| tenants      | ``e|tenant``                        | entitlements set through the log ({ent, file}): weight, quotas |

Queues, the capacity index and the tier/host maps are not stored: they are
rebuilt from these records when a store is opened (see ``state``).
"""

from __future__ import annotations

S = "\x1f"

META = b"m"
PROFILE = b"p"
NODE_PREFIX = f"n{S}".encode()
ALLOC_PREFIX = f"a{S}".encode()
REQ_PREFIX = f"r{S}".encode()
USAGE_PREFIX = f"u{S}".encode()
TIMER_PREFIX = f"T{S}".encode()
SHAPE_PREFIX = f"s{S}".encode()
CKPT_PREFIX = f"c{S}".encode()
PERF_PREFIX = f"f{S}".encode()
TENANT_PREFIX = f"e{S}".encode()


def tenant(name: str) -> bytes:
    return TENANT_PREFIX + name.encode()


def ckpt(alloc_id: str) -> bytes:
    return CKPT_PREFIX + alloc_id.encode()


def perf(gpu_type: str) -> bytes:
    return PERF_PREFIX + gpu_type.encode()


def shape(key: str) -> bytes:
    return SHAPE_PREFIX + key.encode()


def node(node_id: str) -> bytes:
    return NODE_PREFIX + node_id.encode()


def alloc(alloc_id: str) -> bytes:
    return ALLOC_PREFIX + alloc_id.encode()


def request_key(job_id: str, task_id: str, attempt: int) -> str:
    """The identity of a request inside the pool (job, task, attempt)."""
    return f"{job_id}{S}{task_id}{S}{attempt}"


def request(req_key: str) -> bytes:
    return REQ_PREFIX + req_key.encode()


def usage(tier: str, tenant: str) -> bytes:
    return f"u{S}{tier}{S}{tenant}".encode()


def timer(due_ms: int, kind: str, target: str) -> bytes:
    return f"T{S}{due_ms:016d}{S}{kind}{S}{target}".encode()


def timers_due_until(now_ms: int, since_ms: int = 0) -> tuple[bytes, bytes]:
    """Key range of the timers due in [since_ms, now_ms] (``since_ms`` 0: from the index's start)."""
    start = TIMER_PREFIX if since_ms <= 0 else f"T{S}{since_ms:016d}".encode()
    return start, f"T{S}{now_ms + 1:016d}".encode()


def parse_timer(key: bytes) -> tuple[int, str, str]:
    _, due, kind, target = key.decode().split(S, 3)
    return int(due), kind, target


def prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])
