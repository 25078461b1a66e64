"""RocksDB key layout of the scheduler's partition state (its 'tables').

Separator 0x1F (unit separator) cannot appear in job or task IDs (validation
forbids control characters), so keys never collide.

| table      | key                              | value                                   |
|------------|----------------------------------|-----------------------------------------|
| jobs       | ``j|job``                        | job record (state, policy, counters)    |
| task list  | ``l|job``                        | all task IDs, written once at accept    |
| tasks      | ``t|job|task``                   | task record (state, attempt, counts)    |
| dependents | ``d|job|task``                   | IDs of downstream tasks                 |
| idempotency| ``i|tenant|key``                 | {job_id, hash} of the first submission  |
| timers     | ``T|due(16 digits)|job|task|kind`` | attempt; ordered by due time          |
| tenants    | ``E|tenant``                     | {ent: Entitlements, file: auth file digest} |
| queue progress | ``Q|queue|tenant``           | [latest dispatch time leased, when]     |

A finished job's retention timer is a job's timer: task ``""``, kind ``expire`` (``EXPIRE_TIMER``).
Leases live in the task record (worker, lease deadline) and in the timers table.
"""

from __future__ import annotations

from functools import lru_cache

S = "\x1f"


@lru_cache(maxsize=1 << 12)
def job(job_id: str) -> bytes:
    """Cached: a command reads its job several times (and each lease once more for queue progress)."""
    return f"j{S}{job_id}".encode()


def task_list(job_id: str) -> bytes:
    return f"l{S}{job_id}".encode()


@lru_cache(maxsize=1 << 14)
def task(job_id: str, task_id: str) -> bytes:
    """Cached: a command reads and writes its task and the task's dependents about 15 times. The hot keys
    are those of the commands in flight: 16k of them; at 64k the cache (about 180 B a key) kept growing for
    the first 13,000 small jobs of a process (tests/test_soak.py)."""
    return f"t{S}{job_id}{S}{task_id}".encode()


@lru_cache(maxsize=1 << 14)
def dependents(job_id: str, task_id: str) -> bytes:
    return f"d{S}{job_id}{S}{task_id}".encode()


def idempotency(tenant: str, key: str) -> bytes:
    return f"i{S}{tenant}{S}{key}".encode()


def tenant(name: str) -> bytes:
    return f"E{S}{name}".encode()


@lru_cache(maxsize=1 << 10)
def queue_progress(queue: str, tenant: str) -> bytes:
    """How far this partition's records of ``tenant`` on ``queue`` have been taken by workers: re-dispatch
    tells a lost record from one still queued behind a backlog by it (``runnable.make_runnable``)."""
    return f"Q{S}{queue}{S}{tenant}".encode()


TIMER_PREFIX = f"T{S}".encode()
EXPIRE_TIMER = "expire"  # a finished job's retention (task ID "": a job's timer)


def timer(due_ms: int, job_id: str, task_id: str, kind: str) -> bytes:
    return f"T{S}{due_ms:016d}{S}{job_id}{S}{task_id}{S}{kind}".encode()


def timers_due_until(now_ms: int, since_ms: int = 0) -> tuple[bytes, bytes]:
    """Key range of timers due at or before ``now_ms`` (and not before ``since_ms``)."""
    start = TIMER_PREFIX if since_ms <= 0 else f"T{S}{since_ms:016d}".encode()
    return start, f"T{S}{now_ms + 1:016d}".encode()


def parse_timer(key: bytes) -> tuple[int, str, str, str]:
    _, due, job_id, task_id, kind = key.decode().split(S)
    return int(due), job_id, task_id, kind
