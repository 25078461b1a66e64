"""The soak's handler, and tracemalloc snapshots on demand, inside `dagfold up --handler-module bench.soak_handlers`.

``soak_flaky`` fails its first attempt and succeeds at its second (a retried task). With PYTHONTRACEMALLOC
set and DAGFOLD_SOAK_SNAPSHOTS naming a folder, SIGUSR2 writes a tracemalloc snapshot there (bench/soak.py
--tracemalloc sends it).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from dagfold.services.worker.handlers import TaskContext, register_handler


def flaky(ctx: TaskContext) -> None:
    """Fails attempts below ``args.succeed_at`` (default 2), then succeeds."""
    if ctx.attempt < int(ctx.args.get("succeed_at", 2)):
        raise RuntimeError(f"soak: attempt {ctx.attempt} fails on purpose")


def _snapshot_on_signal() -> None:
    import tracemalloc

    folder = os.environ.get("DAGFOLD_SOAK_SNAPSHOTS")
    if not folder or not tracemalloc.is_tracing() or threading.current_thread() is not threading.main_thread():
        return
    count = iter(range(1_000_000))

    def dump(*_: Any) -> None:
        import gc

        gc.collect()
        tracemalloc.take_snapshot().dump(os.path.join(folder, f"{next(count):03d}.snap"))

    signal.signal(signal.SIGUSR2, dump)


register_handler("soak_flaky", flaky, replace=True)
_snapshot_on_signal()
