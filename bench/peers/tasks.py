"""The noop task body every peer runs (stdlib only; imported by Dask, Celery and Prefect workers)."""

from __future__ import annotations

import time
from typing import Any

from bench.peers.probe import task_probe


def noop(task_id: str, *upstream: Any) -> None:
    task_probe(task_id, time.time())
