"""The wall clock, in one place: every service that stamps a record or drives a fold asks here.

Folds never call it: their time is an argument (``now_ms``), which is what makes replay
equal live. Runtimes, senders and the API pass it in.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the epoch (wall clock)."""
    return int(time.time() * 1000)
