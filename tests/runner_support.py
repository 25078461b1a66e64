"""A scheduler running in a thread of the test, and a wait for a condition: for the runtime's tests."""

from __future__ import annotations

import threading
import time
from typing import Any

from dagfold.config import Config
from dagfold.log import Log
from dagfold.services.scheduler.runner import SchedulerRunner


class Running:
    """``SchedulerRunner(log, cfg, "t")`` in a daemon thread; ``error`` holds what stopped it."""

    def __init__(self, log: Log, cfg: Config) -> None:
        self.runner = SchedulerRunner(log, cfg, "t")
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.runner.run(self.stop)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def wait_for(pred: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")
