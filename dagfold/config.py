"""Settings shared by every dagfold process.

Frozen dataclasses: a process builds its config once (from CLI flags,
``DAGFOLD_*`` environment variables and the settings file, resolved by
``dagfold.settings``) and passes it down; nothing reads the environment later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from dagfold.log.base import MAX_RECORD_BYTES, TopicSpec
from dagfold.log.factory import url_prefix
from dagfold.log.namespace import Namespace

# Logical topic names: what dagfold's code, folds, replay digests and dead letters say. The names on
# the cluster come from ``Config.topics`` (one deployment's prefix applied to these, at the log
# boundary: dagfold.log.namespace), so a deployment with DAGFOLD_TOPIC_PREFIX=prod.dagfold reads and
# writes ``prod.dagfold.commands`` while this code keeps saying COMMANDS.
COMMANDS = "commands"
# What only dagfold's own services tell the scheduler (the allocators' TaskAllocation grants): keyed by
# job ID and partitioned as ``commands`` (the scheduler reads partition p of both into partition p's
# fold), but writable by the allocator principal alone (docs/security.md, Boundaries inside a deployment).
SCHEDULER_INTERNAL = "scheduler.internal"
EVENTS = "events"
CONTROL = "control"
DEADLETTER = "deadletter"
DISPATCH_PREFIX = "dispatch."
ALLOCATOR_COMMANDS = "allocator.commands"  # keyed by GPU pool: one partition, one allocator per pool
ALLOCATOR_EVENTS = "allocator.events"

SCHEDULER_GROUP = "dagfold-scheduler"
PROJECTOR_GROUP = "dagfold-projector"
# Where every pool's allocator committed its offsets before each pool had a group of its own
# (allocator_group): pools hashed onto one partition overwrote each other's position there.
SHARED_ALLOCATOR_GROUP = "dagfold-allocator"


def allocator_group(pool: str) -> str:
    """The consumer group whose committed offset is one pool allocator's position in its partition
    of ``allocator.commands``. One per pool: every pool on a partition reads all of it (skipping the
    others' commands), each at its own pace, so a shared group's offset was whichever pool committed
    last, and an allocator restarted there skipped or re-read its own pool's commands."""
    return f"dagfold-allocator.{pool}"


def dispatch_topic(queue: str) -> str:
    """Topic that carries runnable task references of one queue."""
    return DISPATCH_PREFIX + queue


def worker_group(queue: str) -> str:
    """The workers' queue group (a Kafka share group) of one queue.

    Not ``dagfold-workers.<queue>``, the consumer group workers used before dispatch topics were
    queues: Kafka keeps one group type per group ID, so a share consumer could not join a group
    that an older deployment left behind as a consumer group (and an older worker could not join
    this one)."""
    return f"dagfold-queue.{queue}"


@dataclass(frozen=True)
class Topics:
    """One deployment's topic, group and transactional-id names on the cluster.

    The one place names get their prefix (``Namespace``); ``Config.topics`` builds it from
    ``?prefix=`` in the log URL or ``DAGFOLD_TOPIC_PREFIX``. For operators' tools, upstream
    producers and docs: dagfold's own code uses the logical names and an ``open_log(...,
    prefix=...)`` that maps them.
    """

    namespace: Namespace = field(default_factory=Namespace)

    @property
    def prefix(self) -> str:
        return self.namespace.prefix

    @property
    def commands(self) -> str:
        return self.namespace.topic(COMMANDS)

    @property
    def events(self) -> str:
        return self.namespace.topic(EVENTS)

    @property
    def control(self) -> str:
        return self.namespace.topic(CONTROL)

    @property
    def deadletter(self) -> str:
        return self.namespace.topic(DEADLETTER)

    @property
    def allocator_commands(self) -> str:
        return self.namespace.topic(ALLOCATOR_COMMANDS)

    @property
    def allocator_events(self) -> str:
        return self.namespace.topic(ALLOCATOR_EVENTS)

    def dispatch(self, queue: str) -> str:
        return self.namespace.topic(dispatch_topic(queue))

    def group(self, group_id: str) -> str:
        """A consumer group's name on the cluster (SCHEDULER_GROUP, worker_group(q), ...)."""
        return self.namespace.group(group_id)


@dataclass(frozen=True)
class Limits:
    """Validation limits applied at submission (JobRejected beyond them)."""

    max_tasks_per_job: int = 1_000_000
    max_task_id_len: int = 256
    max_args_bytes: int = 64 * 1024
    max_spec_bytes: int = 64 * 1024 * 1024  # below MAX_RECORD_BYTES, the largest record a topic takes
    max_queue_name_len: int = 200


@dataclass(frozen=True)
class SchedulerOptions:
    """Knobs of the scheduler fold and its loop."""

    lease_timeout_s: float = 30.0  # heartbeat at least this often (default heartbeat_s)
    # A task whose worker is lost (LeaseReclaimed) runs again without spending its retry budget, up
    # to this many losses per run; then it fails with worker_lost (a poison task that kills workers).
    max_worker_losses: int = 3
    batch_max_records: int = 2000
    poll_timeout_s: float = 0.05
    # How long the scheduler's log transaction stays open across polls (Kafka Streams' EOS
    # commit.interval.ms is 100 ms): dispatches leave right after each fold, events within this
    # (docs/semantics.md, Dispatch; docs/benchmarks.md, issue 27). 0: one transaction per poll.
    commit_interval_s: float = 0.1
    limits: Limits = field(default_factory=Limits)
    # A runnable attempt no worker has leased this long after its dispatch is dispatched again (its
    # dispatch record may have been lost between the log and a worker: TaskRedispatched), then after
    # twice as long, up to REDISPATCH_MAX_FACTOR times this; 0 turns it off. Keep it well above the
    # queue's normal wait: a duplicate record is harmless (one lease per attempt) but not free. 300 s, not
    # the 60 s of before: under load a queue's normal wait passed a minute (the long chaos run), and the
    # losses left after the worker's re-append of last deliveries are rare (docs/semantics.md, Dispatch).
    redispatch_after_s: float = 300.0
    # per queue, replacing redispatch_after_s for that queue's tasks (e.g. a queue with a deep backlog)
    redispatch_after_s_by_queue: Mapping[str, float] = field(default_factory=dict)
    # How long a finished job's records stay in the scheduler's state and the read models after its end
    # (JobExpired then drops them; its events stay in the log as long as the log keeps them); -1 keeps them.
    finished_job_retention_ms: int = -1

    def redispatch_after_ms(self, queue: str) -> int:
        """The queue's re-dispatch interval in ms; 0 when re-dispatch is off for it."""
        s = self.redispatch_after_s_by_queue.get(queue, self.redispatch_after_s)
        return max(int(s * 1000), 0)


# A re-dispatched attempt's next re-dispatch waits twice as long as the last, up to this many intervals.
REDISPATCH_MAX_FACTOR = 8


def parse_queue_seconds(text: str) -> dict[str, float]:
    """``queue=seconds,queue=seconds`` (the setting ``redispatch_after_s_by_queue``) as a dict."""
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        queue, _, seconds = item.partition("=")
        out[queue.strip()] = float(seconds)
    return out


# Config fields set from dagfold.settings (the table of every setting), by setting name
_SETTING_OF = {"log_url": "log", "topic_prefix": "topic_prefix", "data_dir": "data", "partitions": "partitions",
               "dispatch_partitions": "dispatch_partitions", "allocator_partitions": "allocator_partitions",
               "replication": "replication", "events_retention_ms": "events_retention_ms",
               "commands_retention_ms": "commands_retention_ms", "api_host": "api_host", "api_port": "port",
               "artifacts_url": "artifacts"}


@dataclass(frozen=True)
class Config:
    log_url: str = "embedded"
    topic_prefix: str = ""  # DAGFOLD_TOPIC_PREFIX; or ?prefix= in log_url (see Topics)
    data_dir: Path = Path(".dagfold")
    partitions: int = 8  # commands and events (same count: partition p of both belong together)
    # None: 8 on the embedded log, 1 on Kafka (see dispatch_partition_count)
    dispatch_partitions: int | None = None
    allocator_partitions: int = 4  # GPU pools hash onto these; one allocator writes each pool
    replication: int = 1
    events_retention_ms: int = -1  # the events topic is the audit log: keep everything
    commands_retention_ms: int = 7 * 24 * 3600 * 1000
    api_host: str = "127.0.0.1"
    api_port: int = 8080
    # artifact storage of task outputs and GPU checkpoints: "" = <data_dir>/artifacts, file:PATH, or
    # s3://bucket/prefix?endpoint=http://host:port&region=r (credentials: boto3's usual sources)
    artifacts_url: str = ""
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)

    @classmethod
    def from_env(cls, **overrides: object) -> Config:
        """Defaults < settings file < ``DAGFOLD_*`` variables < explicit overrides (CLI flags): resolved and
        checked by ``dagfold.settings`` (a bad value raises SettingsError naming the setting)."""
        from dagfold.settings import load_settings

        flags = {_SETTING_OF.get(k, k): v for k, v in overrides.items() if v is not None and k in _SETTING_OF}
        s = load_settings(flags)
        cfg = cls(log_url=s.log, topic_prefix=s.topic_prefix, data_dir=Path(s.data), partitions=s.partitions,
                  dispatch_partitions=s.dispatch_partitions, allocator_partitions=s.allocator_partitions,
                  replication=s.replication, events_retention_ms=s.events_retention_ms,
                  commands_retention_ms=s.commands_retention_ms, api_host=s.api_host, api_port=s.port,
                  artifacts_url=s.artifacts,
                  scheduler=SchedulerOptions(redispatch_after_s=s.redispatch_after_s,
                                             finished_job_retention_ms=s.finished_job_retention_ms,
                                             commit_interval_s=s.commit_interval_s,
                                             redispatch_after_s_by_queue=parse_queue_seconds(
                                                 s.redispatch_after_s_by_queue)))
        clean = {k: v for k, v in overrides.items() if v is not None and k not in _SETTING_OF}
        return replace(cfg, **clean)  # type: ignore[arg-type]

    @property
    def topics(self) -> Topics:
        """This deployment's names on the cluster (the URL's ``?prefix=`` wins over DAGFOLD_TOPIC_PREFIX;
        ``open_log`` refuses the two when they differ)."""
        return Topics(Namespace(url_prefix(self.log_url) or self.topic_prefix))

    def core_topics(self) -> list[TopicSpec]:
        """Topics every deployment has; dispatch topics are created per queue on demand."""
        r = self.replication
        isr = 2 if r >= 3 else None
        return [
            # job specs travel in SubmitJob (commands), JobAccepted (events) and dead letters
            TopicSpec(COMMANDS, self.partitions, self.commands_retention_ms, r, isr, MAX_RECORD_BYTES),
            TopicSpec(SCHEDULER_INTERNAL, self.partitions, self.commands_retention_ms, r, isr),
            TopicSpec(EVENTS, self.partitions, self.events_retention_ms, r, isr, MAX_RECORD_BYTES),
            TopicSpec(CONTROL, self.partitions, self.commands_retention_ms, r, isr),
            TopicSpec(DEADLETTER, 1, self.events_retention_ms, r, isr, MAX_RECORD_BYTES),
            TopicSpec(ALLOCATOR_COMMANDS, self.allocator_partitions, self.commands_retention_ms, r, isr),
            TopicSpec(ALLOCATOR_EVENTS, self.allocator_partitions, self.events_retention_ms, r, isr),
        ]

    def dispatch_partition_count(self) -> int:
        """Partitions of a dispatch topic (a queue; dispatch records are keyed by tenant).

        The embedded queue lets every worker take records of every partition, round-robin across
        partitions: 8 give tenants lanes of their own. Kafka's share groups (KIP-932) share a
        partition among all members only when the topic has one partition; with P partitions each
        is served by about workers/P of them (a partition per worker when there are fewer
        workers), so one long task can again hold up the records of its worker's partitions.
        Hence 1 on Kafka: every worker takes any record, at the price of one FIFO for all tenants.
        Set DAGFOLD_DISPATCH_PARTITIONS=P (with at least 2P workers) for tenant lanes on Kafka.
        """
        if self.dispatch_partitions is not None:
            return self.dispatch_partitions
        return 1 if self.log_url.startswith("kafka://") else 8

    def dispatch_spec(self, queue: str) -> TopicSpec:
        r = self.replication
        return TopicSpec(dispatch_topic(queue), self.dispatch_partition_count(), self.commands_retention_ms, r,
                         2 if r >= 3 else None)
