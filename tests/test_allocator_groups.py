"""Each GPU pool's allocator keeps its position in ``allocator.commands`` in a consumer group of its
own (``dagfold-allocator.<pool>``), on the embedded log.

Pools hashed onto one partition each read all of it (skipping the other pools' commands), each at
its own pace. With one group for every pool, the group's offset was whichever pool committed last:
a pool's allocator restarted behind another pool's position skipped its own commands.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from dagfold.codec import default_codec
from dagfold.config import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS, SHARED_ALLOCATOR_GROUP, Config, allocator_group
from dagfold.log import TopicPartition
from dagfold.log.embedded import EmbeddedLog
from dagfold.processor import PartitionProcessor
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.runner import AllocatorRunner, allocator_spec

codec = default_codec()
TP = TopicPartition(ALLOCATOR_COMMANDS, 0)


def open_log(tmp_path: Path) -> EmbeddedLog:
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(Config(data_dir=tmp_path / "data", allocator_partitions=1).core_topics())
    return log


def send(log: EmbeddedLog, cmd: dict[str, Any]) -> None:
    p = log.producer("test")
    p.send(ALLOCATOR_COMMANDS, cmd["pool"].encode(), codec.encode(cmd))
    p.flush()


def has(log: EmbeddedLog, pool: str, kind: str) -> bool:
    return any(e.get("pool") == pool and e["type"].endswith(kind)
               for e in (codec.decode(r.value) for r in log.read(TopicPartition(ALLOCATOR_EVENTS, 0), 0, 1_000_000)))


def step_until(runner: PartitionProcessor, pred: Any, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runner.step(0.02)
        if pred():
            return True
    return False


def test_two_pools_on_one_partition_keep_their_own_positions(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    data = tmp_path / "data"
    a = AllocatorRunner(log, AllocatorOptions(pool="a"), data)
    b = AllocatorRunner(log, AllocatorOptions(pool="b"), data)
    assert a.spec.commands == b.spec.commands and a.spec.partitions == b.spec.partitions == [0]
    assert (a.spec.group, b.spec.group) == (allocator_group("a"), allocator_group("b"))
    try:
        send(log, alloc_cmds.register_node("a", "na", "H100", 8))
        send(log, alloc_cmds.register_node("b", "nb", "H100", 8))
        assert step_until(a, lambda: has(log, "a", "NodeRegistered"))
        assert step_until(b, lambda: has(log, "b", "NodeRegistered"))
        a.close()  # pool a's allocator is down (a restart, an upgrade) ...
        send(log, alloc_cmds.request_allocation("a", "job1", gpus=2))
        end = log.end_offsets([TP])[TP]
        assert step_until(b, lambda: b.consumer.committed([TP])[TP] == end)  # ... pool b reads on past it
    finally:
        b.close()
    a = AllocatorRunner(log, AllocatorOptions(pool="a"), data)
    try:
        assert step_until(a, lambda: has(log, "a", "AllocationGranted")), "pool a skipped its own request"
    finally:
        a.close()
        log.close()


def test_a_pool_upgraded_from_the_shared_group_starts_where_that_group_stood(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    data = tmp_path / "data"
    opts = AllocatorOptions(pool="a")
    # the version before: every pool's position in the one shared group
    old = PartitionProcessor(log, dataclasses.replace(allocator_spec(log, opts, data), group=SHARED_ALLOCATOR_GROUP,
                                                      former_group=None), "allocator-a")
    old.start()
    try:
        send(log, alloc_cmds.register_node("a", "na", "H100", 8))
        send(log, alloc_cmds.request_allocation("a", "job1", gpus=2))
        assert step_until(old, lambda: has(log, "a", "AllocationGranted"))
        shared = old.consumer.committed([TP])[TP]
        assert shared == log.end_offsets([TP])[TP]
    finally:
        old.close()
    new = AllocatorRunner(log, opts, data)
    try:
        assert new.consumer.position(TP) == shared  # not 0: the pool's commands are not folded again
        send(log, alloc_cmds.request_allocation("a", "job2", gpus=2))
        assert step_until(new, lambda: new.consumer.committed([TP])[TP] == log.end_offsets([TP])[TP])
        assert new.folded == 1
    finally:
        new.close()
        log.close()
