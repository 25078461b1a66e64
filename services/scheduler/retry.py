"""Retry decisions and deterministic backoff.

Jitter comes from a hash of (job, task, attempt), never from a random source,
so a replayed or re-processed failure schedules the retry at the same time.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

NO_RETRY: dict[str, Any] = {
    "max_attempts": 1,
    "initial_interval_s": 1.0,
    "backoff_coefficient": 2.0,
    "max_interval_s": 60.0,
    "jitter": True,
    "non_retryable_exit_codes": [],
    "non_retryable_errors": [],
}


def jitter_fraction(job_id: str, task_id: str, attempt: int) -> float:
    """A number in [0, 1) fixed by (job, task, attempt)."""
    h = hashlib.blake2b(f"{job_id}\x00{task_id}\x00{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def backoff_ms(policy: dict[str, Any], job_id: str, task_id: str, attempt: int) -> int:
    """Delay before the attempt after ``attempt``: exponential, capped, jittered by +/-20%."""
    initial = policy["initial_interval_s"]
    try:
        base = initial * policy["backoff_coefficient"] ** (attempt - 1)
    except OverflowError:  # e.g. coefficient 10 at attempt 310: past any cap
        base = math.inf if initial > 0 else 0.0
    base = min(base, policy["max_interval_s"])
    if policy["jitter"]:
        base *= 0.8 + 0.4 * jitter_fraction(job_id, task_id, attempt)
    return int(base * 1000)


def should_retry(
    policy: dict[str, Any], attempt: int, exit_code: int | None, error_type: str | None, retryable: bool
) -> bool:
    if not retryable or attempt >= policy["max_attempts"]:
        return False
    if exit_code is not None and exit_code in policy["non_retryable_exit_codes"]:
        return False
    return not (error_type is not None and error_type in policy["non_retryable_errors"])
