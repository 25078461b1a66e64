"""Issue 24, recipe 3: a GPU grant is checked where it is used.

Before: any writer of ``commands`` could write a ``TaskAllocation{status: granted}`` keyed by its own
queued job. The scheduler took it (a grant it never asked for), dispatched the job to the hosts and
GPUs it named, resuming from the ``checkpoint_uri`` it carried (another tenant's checkpoint), and
the node agent launched whatever it was dispatched. Now:

* grants travel on ``scheduler.internal`` (only allocators may write it on a SASL broker:
  tests/test_kafka_security.py); a TaskAllocation on ``commands`` is dead-lettered with the reason;
* the scheduler accepts a grant only for the request it made (current attempt, its pool, its shape)
  and resumes the job from the checkpoint it knows for that job, never from the grant's URI;
* an agent launches only what the allocator's own AllocationGranted grants to its host.
"""

from __future__ import annotations

from pathlib import Path

from dagfold.codec import Record, default_codec
from dagfold.commands import submit_job
from dagfold.config import ALLOCATOR_EVENTS, COMMANDS, CONTROL, DEADLETTER, EVENTS, SCHEDULER_INTERNAL, Config
from dagfold.log import TopicPartition
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.agent.agent import GRANT_WAIT_S, simulated
from dagfold.services.scheduler.harness import FoldHarness
from tests.gpu_support import POOL, gpu_job
from tests.runner_support import Running, wait_for

codec = default_codec()
VICTIM_CKPT = "file:///var/dagfold/artifacts/acme/victim/train/checkpoints/step-900.pt"


def grant(job_id: str, *, attempt: int = 1, alloc_id: str = "a-1", epoch: int = 1, pool: str = POOL,
          hosts: list[tuple[str, list[int]]] | None = None, checkpoint_uri: str | None = None,
          status: str = "granted") -> Record:
    """A TaskAllocation as the allocator writes it (ctx.notify); the pool numbers its grants by ``epoch``."""
    return {"type": "dagfold.command.TaskAllocation", "job_id": job_id, "task_id": "train", "attempt": attempt,
            "pool": pool, "ts_ms": 0, "status": status, "alloc_id": alloc_id, "epoch": epoch,
            "hosts": [{"node_id": n, "gpu_indices": g, "gpu_milli": 1000} for n, g in (hosts or [("n0", [0, 1])])],
            "reason": "", "checkpoint_uri": checkpoint_uri, "cause_offset": 0}


def gpu_dispatches(h: FoldHarness) -> list[Record]:
    return [c for c in h.controls if c["type"] == "dagfold.control.GpuTaskDispatch"]


def ignored(h: FoldHarness) -> list[str]:
    return [e["reason"] for e in h.events if e["type"].endswith("ReportIgnored")]


# -- the scheduler fold -------------------------------------------------------------------------

def test_a_grant_cannot_make_a_job_resume_from_another_jobs_checkpoint() -> None:
    h = FoldHarness()
    h.submit(gpu_job("evil", tenant="mallory", gpus=2))
    h.process(grant("evil", checkpoint_uri=VICTIM_CKPT))
    [d] = gpu_dispatches(h)
    assert d["resume_checkpoint"] is None  # the scheduler knows no checkpoint of this job: a fresh start
    [allocated] = [e for e in h.events if e["type"].endswith("TaskAllocated")]
    assert allocated["resume_checkpoint"] is None
    assert VICTIM_CKPT not in str(h.controls) and VICTIM_CKPT not in str(h.events)


def test_a_resumed_job_reads_the_checkpoint_the_scheduler_knows_for_it() -> None:
    own = "file:///var/dagfold/artifacts/acme/j/train/checkpoints/step-10.pt"
    h = FoldHarness()
    h.submit(gpu_job("j", gpus=2))
    h.process(grant("j", alloc_id="a-1"))
    h.process(grant("j", alloc_id="a-1", status="requeued", checkpoint_uri=own))  # preempted after a checkpoint
    h.process(grant("j", alloc_id="a-2", epoch=2, hosts=[("n1", [4, 5])], checkpoint_uri=VICTIM_CKPT))
    assert [d["resume_checkpoint"] for d in gpu_dispatches(h)] == [None, own]


def test_the_scheduler_takes_only_a_grant_that_answers_its_request() -> None:
    h = FoldHarness()
    h.submit(gpu_job("g", gpus=2, hosts=1))
    for bad in (grant("g", pool="other-pool"),                          # not the pool it asked
                grant("g", hosts=[("n0", [0, 1, 2, 3, 4, 5, 6, 7])]),   # more GPUs than asked: another's
                grant("g", hosts=[("n0", [0, 1]), ("n1", [0, 1])]),     # more hosts than asked
                grant("g", hosts=[("n0", [1, 1])]),                     # one GPU twice
                grant("g", attempt=2)):                                 # an attempt it never made
        h.process(bad)
    assert not gpu_dispatches(h)
    reasons = ignored(h)
    assert len(reasons) == 5, reasons
    assert "other-pool" in reasons[0] and "per host" in reasons[1] and "2 host(s)" in reasons[2]
    assert "stale attempt" in reasons[4]
    assert h.task("g", "train")["state"] == "runnable"  # type: ignore[index]
    h.process(grant("g"))  # the allocator's own grant still gets through
    assert [d["gpu_indices"] for d in gpu_dispatches(h)] == [[0, 1]]
    assert h.digest() == h.replayed_digest()


def test_a_redelivered_grant_of_a_requeued_gang_is_stale_and_the_next_grant_runs_the_job() -> None:
    """tests/test_gpu_props.py found it (nodes [2, 4, 4], seed 1186): a gang over 2 hosts was granted
    (a-7), preempted at once (requeued), then the grant was delivered again. The scheduler took it
    as a new grant and waited for a start from a-7, which the pool had freed; it then turned away
    every later grant (a-9, ...) while the pool granted, expired and granted again: a job that
    never ends."""
    hosts = [("n1", [0, 1, 2, 3]), ("n2", [0, 1, 2, 3])]
    h = FoldHarness()
    h.submit(gpu_job("g", gpus=4, hosts=2))
    h.process(grant("g", alloc_id="a-7", epoch=7, hosts=hosts))
    h.process(grant("g", alloc_id="a-7", epoch=7, status="requeued", hosts=[]))  # preempted
    h.process(grant("g", alloc_id="a-7", epoch=7, hosts=hosts))  # the grant again (at-least-once)
    assert [d["alloc_id"] for d in gpu_dispatches(h)] == ["a-7", "a-7"]  # once per host, none again
    assert "grant epoch 7 is not newer" in ignored(h)[-1]
    h.process(grant("g", alloc_id="a-9", epoch=9, hosts=hosts))
    assert [d["alloc_id"] for d in gpu_dispatches(h)[2:]] == ["a-9", "a-9"]
    d = {"job_id": "g", "task_id": "train", "attempt": 1}
    h.report("Started", d, worker="a-9")
    h.report("Succeeded", d, worker="a-9")
    assert h.job("g")["state"] == "succeeded"  # type: ignore[index]
    assert h.digest() == h.replayed_digest()


# -- the runtime on the embedded log: where a grant may come from ---------------------------------------------------

def _read(log: EmbeddedLog, topic: str) -> list[Record]:
    return [codec.decode(r.value) for p in range(log.partitions(topic))
            for r in log.read(TopicPartition(topic, p), 0, 100_000)]


def test_a_grant_on_commands_is_dead_lettered_and_one_on_scheduler_internal_is_taken(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data", partitions=2)
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    s = Running(log, cfg)
    try:
        prod = log.producer("upstream")
        prod.send(COMMANDS, b"evil", codec.encode(submit_job(gpu_job("evil", tenant="mallory"), source="upstream")))
        prod.flush()

        def types() -> list[str]:
            return [e["type"].rsplit(".", 1)[-1] for e in _read(log, EVENTS) if e["job_id"] == "evil"]

        wait_for(lambda: "TaskDispatched" in types())
        prod.send(COMMANDS, b"evil", codec.encode(grant("evil", checkpoint_uri=VICTIM_CKPT)))
        prod.flush()
        wait_for(lambda: _read(log, DEADLETTER))
        [dead] = _read(log, DEADLETTER)
        assert dead["source_topic"] == COMMANDS and dead["service"] == "scheduler"
        assert "TaskAllocation is taken only from scheduler.internal" in dead["reason"], dead["reason"]
        assert "TaskAllocated" not in types() and not _read(log, CONTROL)

        # the allocator's grant, on the topic only allocators write, is taken (same partitioning as commands)
        prod.send(SCHEDULER_INTERNAL, b"evil", codec.encode(grant("evil")))
        prod.flush()
        wait_for(lambda: "TaskAllocated" in types())
        [d] = [c for c in _read(log, CONTROL) if c["type"].endswith("GpuTaskDispatch")]
        assert d["resume_checkpoint"] is None and d["gpu_indices"] == [0, 1]
        # and a report does not travel there
        prod.send(SCHEDULER_INTERNAL, b"evil", codec.encode({
            "type": "dagfold.command.TaskStarted", "job_id": "evil", "task_id": "train", "attempt": 1,
            "worker_id": "a-1", "ts_ms": 0}))
        prod.flush()
        wait_for(lambda: len(_read(log, DEADLETTER)) == 2)
        assert "does not travel on scheduler.internal" in _read(log, DEADLETTER)[1]["reason"]
        assert "LeaseGranted" not in types()
        assert s.error is None
    finally:
        s.close()
        log.close()


# -- the node agent ---------------------------------------------------------------------------------

def test_an_agent_launches_only_what_the_allocator_granted_to_its_host(tmp_path: Path) -> None:
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(Config(partitions=2, allocator_partitions=1).core_topics())
    now = [1000.0]
    agent, _ = simulated(log, POOL, "n0", ["sleep", "30"], tmp_path / "artifacts", gpus=8, clock=lambda: now[0])
    try:
        prod = log.producer("test")
        # the allocator granted GPUs 0-1 of n0 to acme's job
        prod.send(ALLOCATOR_EVENTS, POOL.encode(), codec.encode({
            "type": "dagfold.allocator.AllocationGranted", "pool": POOL, "ts_ms": 0, "cause_offset": 0,
            "alloc_id": "a-victim", "epoch": 3, "job_id": "victim", "task_id": "train", "attempt": 1,
            "tenant": "acme", "tier": "standard",
            "hosts": [{"node_id": "n0", "gpu_indices": [0, 1], "gpu_milli": 1000}],
            "gpus": 2, "gpu_milli": 1000, "cpu_milli": 0, "memory_mib": 0, "lease_deadline_ms": 0,
            "max_runtime_s": None, "checkpoint": True, "resume_checkpoint": None, "waited_ms": 0, "grants": 1}))

        def dispatch(alloc_id: str, job_id: str, tenant: str, gpus: list[int], epoch: int = 3) -> None:
            prod.send(CONTROL, b"n0", codec.encode({
                "type": "dagfold.control.GpuTaskDispatch", "node_id": "n0", "pool": POOL, "alloc_id": alloc_id,
                "epoch": epoch, "job_id": job_id, "task_id": "train", "attempt": 1, "tenant": tenant,
                "handler": "gpu", "args_json": "{}", "gpu_indices": gpus, "leader": False,
                "resume_checkpoint": None, "lease_timeout_s": 30.0, "ts_ms": 0}))

        dispatch("a-victim", "evil", "mallory", [0, 1])    # the victim's allocation, for another job
        dispatch("a-forged", "evil", "mallory", [0, 1])    # an allocation the allocator never made
        dispatch("a-victim", "victim", "acme", [2, 3])     # the right job on GPUs not granted
        prod.flush()
        agent.step()
        assert agent.procs == {} and agent.refused == 2
        assert list(agent.waiting) == ["a-forged"]  # its grant may not be read yet: it waits, but not for ever
        now[0] += GRANT_WAIT_S + 1
        agent.step()
        assert agent.procs == {} and agent.waiting == {} and agent.refused == 3

        dispatch("a-victim", "victim", "acme", [0, 1])  # what the allocator granted
        prod.flush()
        agent.step()
        assert list(agent.procs) == ["a-victim"] and agent.procs["a-victim"].gpus == [0, 1]
    finally:
        agent.close()
        log.close()
