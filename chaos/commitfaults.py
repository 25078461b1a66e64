"""Commit faults inside a real scheduler or allocator process: ``python -m chaos.commitfaults ARGS``
runs ``python -m dagfold ARGS`` with ``KafkaTransactionalProducer.commit`` wrapped.

The harness arms one fault at a time by writing its kind into ``$DAGFOLD_CHAOS_COMMIT_FAULTS/next``
(one folder for every scheduler); the next commit with records, of whichever process, takes it
(renaming the file, so exactly one commit does) and:

* ``committed-error``: commits, then raises ``CommitUnknownError(committed=True)`` (Kafka's
  "transaction committed but N delivery report(s) missing");
* ``unknown-committed``: commits, then raises ``CommitUnknownError`` (a commit that timed out
  after the coordinator wrote it);
* ``unknown-aborted``: never calls ``commit_transaction`` and raises ``CommitUnknownError``
  (a commit that timed out before reaching the coordinator: the transaction stays open until
  the runtime's new producer aborts it);
* ``broker-restart``: writes ``committing``, waits (up to 20 s) for the harness to kill a broker
  and write ``go`` (``killed`` in it when it did), then commits for real, through the failover.

Each fault taken is appended to ``applied.jsonl`` (kind, time, what the real commit did), which
is what the harness counts. What follows is the runtime's business: the run's checks and
``dagfold replay --verify`` tell whether it lost or doubled anything.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagfold.exceptions import CommitUnknownError
from dagfold.log.base import Consumer, TopicPartition
from dagfold.log.kafka import KafkaTransactionalProducer

ENV = "DAGFOLD_CHAOS_COMMIT_FAULTS"
KINDS = ("committed-error", "unknown-committed", "unknown-aborted", "broker-restart")


def arm(folder: Path, kind: str) -> None:
    """Arm ``kind`` for the next commit of the process that watches ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "next.tmp"
    tmp.write_text(kind)
    tmp.replace(folder / "next")


def applied(folder: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (folder / "applied.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []


def install(folder: Path) -> None:
    real = KafkaTransactionalProducer.commit

    def take() -> str | None:
        claimed = folder / f"taken.{os.getpid()}"
        try:
            (folder / "next").replace(claimed)
        except OSError:
            return None
        kind = claimed.read_text().strip()
        claimed.unlink()
        return kind

    def note(kind: str, outcome: str) -> None:
        with (folder / "applied.jsonl").open("a") as f:
            f.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), "outcome": outcome}) + "\n")

    def commit(self: KafkaTransactionalProducer, offsets: Mapping[TopicPartition, int],
               consumer: Consumer | None = None) -> dict[TopicPartition, int]:
        if not self._sent or not os.path.exists(folder / "next"):
            return real(self, offsets, consumer)
        kind = take()
        if kind is None:
            return real(self, offsets, consumer)
        if kind == "unknown-aborted":
            self._open = False  # left open in librdkafka: the runtime's next producer aborts it
            note(kind, "not committed")
            raise CommitUnknownError("injected: commit timed out before the coordinator wrote it")
        if kind == "broker-restart":
            (folder / "committing").write_text(str(os.getpid()))
            deadline = time.monotonic() + 20
            while not (folder / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            go = folder / "go"
            killed = go.exists() and go.read_text() == "killed"
            for f in ("go", "committing"):
                (folder / f).unlink(missing_ok=True)
            if killed:
                # Noted before the commit goes on: with a broker down it can take long, and the
                # harness may kill -9 this very scheduler meanwhile; the fault happened either way.
                note(kind, "broker killed inside the commit")
            return real(self, offsets, consumer)
        real(self, offsets, consumer)
        note(kind, "committed")
        if kind == "committed-error":
            raise CommitUnknownError("injected: transaction committed but delivery report(s) missing",
                                     committed=True)
        raise CommitUnknownError("injected: commit timed out after the coordinator wrote it")

    KafkaTransactionalProducer.commit = commit  # type: ignore[method-assign]


def main() -> None:
    folder = os.environ.get(ENV)
    if folder:
        install(Path(folder))
    sys.argv = ["dagfold", *sys.argv[1:]]
    runpy.run_module("dagfold", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
