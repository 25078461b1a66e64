"""The fault injector: kill -9 schedulers, workers and one broker at a time, at random times.

Seeded (``random.Random(seed)``), so a run's fault schedule can be reproduced as
far as timing allows. Each kind fires after an exponentially distributed wait
with its own mean:

* ``scheduler kill -9``: a random running scheduler instance; restarted after
  ``restart_delay_s`` on its data folder, or (``empty_state_share`` of the
  time) on an emptied one, which makes it rebuild every partition it gets from
  the events topic (``scheduler kill -9, empty state``);
* ``worker kill -9``: a random running worker process, restarted likewise;
* ``broker kill -9``: a random broker, only while all three run and every
  partition's ISR is complete; restarted ``broker_down_s`` later with
  ``kafka.sh start``, so at most one broker is ever down.

Duplicated and delayed worker reports come from the duplicator process
(``chaos.duplicator``); ``Injector.counts`` holds the kills, the duplicator's
stats file the copies. A supervisor pass restarts any process that exited
without being killed (and records it as an ``unexpected exit``: a crash, which
the report lists).

Commit faults and zombies (issue 13), when the plan enables them:

* commit faults (``chaos.commitfaults``), armed in turn for the schedulers' next commit: a commit that
  succeeds but reports an error, one whose outcome is unknown and that did commit, one whose
  outcome is unknown and that did not, and a broker kill -9 while the scheduler is inside
  ``commit_transaction`` (the broker comes back like any killed broker);
* ``scheduler SIGSTOP``: a scheduler stopped past the session timeout (its partitions move to
  the others), then resumed: its late transaction must be fenced and change nothing;
* ``allocator SIGSTOP``: the pool's allocator stopped, its standby started (as an orchestrator
  would: the new instance fences the old one), then the old one resumed: it must exit fenced.
  The two then swap roles.

Network partitions (issue 25), when the plan enables them (``tests/netns_support.py``: the GPU hosts, and with
``worker_hosts`` the workers, each in a network namespace of its own; the brokers each on a host of their own,
listening on its address), each healed after a while (``partition_s``, with ``partition_long_share`` of them
drawn log-uniformly from ``partition_long_s``):

* ``host cut off (link down)``: a host that is not cut now loses its link (up to ``max_hosts_cut`` hosts at once);
* ``host cut from the brokers``: a host loses its routes to the three brokers only, keeping its peers;
* ``broker isolated from the other two``: one broker loses its routes to the other two (neither direction of
  their connections gets through) while every client still reaches it; it takes the one broker slot (never
  while another broker is down or the ISR is not complete, as a broker kill).

The processes behind a cut must ride it out (an exit is an ``unexpected exit``): the agent fences itself if the
cut outlasts its lease and registers again, a worker stops an attempt whose lease it could not renew.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos import commitfaults
from chaos.cluster import BrokerCluster
from chaos.procs import Proc
from dagfold.cli.ux import EXIT_FENCED

SCHEDULER_KILL = "scheduler kill -9"
SCHEDULER_KILL_EMPTY = "scheduler kill -9, empty state"
WORKER_KILL = "worker kill -9"
BROKER_KILL = "broker kill -9"
COMMIT_COMMITTED_ERROR = "commit committed, error reported"
COMMIT_UNKNOWN_COMMITTED = "commit outcome unknown, committed"
COMMIT_UNKNOWN_ABORTED = "commit outcome unknown, not committed"
BROKER_RESTART_IN_COMMIT = "broker kill -9 during commit_transaction"
SCHEDULER_SIGSTOP = "scheduler SIGSTOP past session timeout"
ALLOCATOR_SIGSTOP = "allocator SIGSTOP, successor, SIGCONT"
COMMIT_KINDS = {"committed-error": COMMIT_COMMITTED_ERROR, "unknown-committed": COMMIT_UNKNOWN_COMMITTED,
                "unknown-aborted": COMMIT_UNKNOWN_ABORTED, "broker-restart": BROKER_RESTART_IN_COMMIT}
NEW_KINDS = (*COMMIT_KINDS.values(), SCHEDULER_SIGSTOP, ALLOCATOR_SIGSTOP)
HOST_CUT = "host cut off (link down)"
HOST_CUT_FROM_BROKERS = "host cut from the brokers"
BROKER_ISOLATED = "broker isolated from the other two"
HOST_PARTITION_KINDS = (HOST_CUT, HOST_CUT_FROM_BROKERS)
PARTITION_KINDS = (*HOST_PARTITION_KINDS, BROKER_ISOLATED)
KILL_KINDS = (SCHEDULER_KILL, SCHEDULER_KILL_EMPTY, WORKER_KILL, BROKER_KILL, *NEW_KINDS, *PARTITION_KINDS)


@dataclass(frozen=True)
class FaultPlan:
    scheduler_every_s: float = 6.0
    worker_every_s: float = 5.0
    broker_every_s: float = 30.0
    empty_state_share: float = 0.25
    restart_delay_s: tuple[float, float] = (0.3, 3.0)
    broker_down_s: tuple[float, float] = (3.0, 12.0)
    broker_settle_s: float = 5.0  # after a broker is back and healthy, before the next broker kill
    max_schedulers_down: int = 2
    # issue 13's kinds; 0 turns a kind off (and the kinds above take 0 as off too)
    commit_every_s: float = 0.0
    sigstop_every_s: float = 0.0
    allocator_sigstop_every_s: float = 0.0
    sigstop_s: float = 9.0  # past the session timeout (chaos.harness: 6 s)
    # issue 25's kinds (network partitions of hosts and brokers): 0 turns them off
    partition_every_s: float = 0.0  # host partitions (the two host kinds in turn)
    partition_s: tuple[float, float] = (5.0, 30.0)  # how long a partition lasts before it heals (uniform) ...
    partition_long_s: tuple[float, float] = (30.0, 180.0)  # ... or, for this share of them, log-uniform in here
    partition_long_share: float = 0.0
    max_hosts_cut: int = 1  # host partitions at once
    isolate_every_s: float = 0.0  # a broker isolated from the other two
    isolate_s: tuple[float, float] = (5.0, 12.0)  # uniform, or isolate_long_share of them from partition_long_s
    isolate_long_share: float = 0.0
    isolate_settle_s: float = 0.5  # after the cluster is whole again, before the next broker fault
    # at least this long between two broker kills inside a commit (0: no limit): each holds the one broker slot
    # for a minute or more on a loaded machine, and taken whenever the slot is free they starve the isolations
    commit_broker_gap_s: float = 0.0


class Injector:
    def __init__(self, rng: random.Random, plan: FaultPlan, cluster: BrokerCluster, schedulers: list[Proc],
                 scheduler_dirs: dict[str, Path], workers: list[Proc], others: list[Proc], journal: Path,
                 say: Callable[[str], None] = print, fault_dir: Path | None = None,
                 allocators: list[Proc] | None = None, require_kinds: tuple[str, ...] = (),
                 hosts: Sequence[Any] = (), broker_addrs: Sequence[str] = (), require_count: int = 1) -> None:
        self.rng = rng
        self.plan = plan
        self.cluster = cluster
        self.schedulers = schedulers
        self.scheduler_dirs = scheduler_dirs
        self.workers = workers
        self.others = others
        self.journal = journal.open("a")
        self.say = say
        self.counts: dict[str, int] = dict.fromkeys(KILL_KINDS, 0)
        self.unexpected: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._restarts: list[tuple[float, int, Proc, bool]] = []
        self._seq = 0
        self._broker_busy = False
        self._broker_ready_at = 0.0
        self._broker_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._due: dict[str, float] | None = None
        self.fault_dir = fault_dir
        self.allocators = allocators or []
        self.require_kinds = require_kinds  # the run needs each once: scheduled first, not left to chance
        self._disarm = threading.Event()  # set by recover(): stop waiting for a commit to take a fault
        self._commit_turn = rng.randrange(len(commitfaults.KINDS))
        self._armed_at = 0.0
        self._broker_commit_at = 0.0
        self._broker_kill_waiting = False  # a plain broker kill is due and waits for the slot: isolations wait
        self._armed_kind: str | None = None
        self._conts: list[tuple[float, int, Proc, int, Proc | None]] = []  # SIGCONT due: (t, seq, proc, pid, successor)
        self.hosts = list(hosts)  # hosts the partitions cut (tests.netns_support.Host); none: no host partitions
        self.broker_addrs = list(broker_addrs)
        self.require_count = require_count  # each required kind this many times (the partition kinds' minimum)
        self._heal_at: dict[str, tuple[float, Any]] = {}  # host ns -> (when it heals, the host)
        self._partition_turn = 0

    # -- bookkeeping ------------------------------------------------------------
    def record(self, kind: str, target: str, **detail: Any) -> None:
        with self._lock:
            if kind in self.counts:
                self.counts[kind] += 1
            row = {"t": round(time.monotonic() - self.t0, 3), "kind": kind, "target": target, **detail}
            self.journal.write(json.dumps(row) + "\n")
            self.journal.flush()

    @property
    def kills(self) -> int:
        self.count_commit_faults()
        return sum(self.counts.values())

    def count_commit_faults(self) -> None:
        """Commit faults count when a commit took them (``applied.jsonl``), not when armed."""
        taken: dict[str, int] = dict.fromkeys(COMMIT_KINDS.values(), 0)
        for row in commitfaults.applied(self.fault_dir) if self.fault_dir is not None else []:
            label = COMMIT_KINDS.get(row.get("kind", ""))
            if label is not None:
                taken[label] += 1
        with self._lock:
            self.counts.update(taken)

    # -- the loop -----------------------------------------------------------------
    def _next(self, mean: float) -> float:
        if mean <= 0:
            return float("inf")  # this kind is off
        return time.monotonic() + self.rng.expovariate(1.0 / mean)

    def _first(self, mean: float) -> float:
        """The first of a rare kind early in the run, so that a short run sees it."""
        return float("inf") if mean <= 0 else time.monotonic() + self.rng.uniform(8.0, 20.0)

    def step_until(self, until: float) -> None:
        """Inject faults (and restart what is due) until ``until`` (monotonic time)."""
        p = self.plan
        if self._due is None:
            self._due = {"scheduler": self._next(p.scheduler_every_s), "worker": self._next(p.worker_every_s),
                         "broker": (time.monotonic() + self.rng.uniform(3.0, min(20.0, p.broker_every_s))
                                    if p.broker_every_s > 0 else float("inf")),
                         "commit": (time.monotonic() + self.rng.uniform(1.0, 3.0)) if p.commit_every_s > 0
                         else float("inf"), "sigstop": self._first(p.sigstop_every_s),
                         "allocator": self._first(p.allocator_sigstop_every_s) + 10.0,
                         "partition": self._first(p.partition_every_s if self.hosts else 0.0),
                         # a required isolation first of all: it is short and gives the broker slot back
                         # within seconds, while a broker kill (inside a commit) can hold it for minutes
                         "isolate": (time.monotonic() + 0.2 if self._broker_reserved_for_isolation()
                                     else self._first(p.isolate_every_s if self.cluster.hosts else 0.0))}
        due = self._due
        while time.monotonic() < until:
            now = time.monotonic()
            self.restart_due(now)
            self.resume_due(now)
            self.heal_due(now)
            self.supervise()
            if now >= due["scheduler"]:
                self.kill_scheduler()
                due["scheduler"] = self._next(p.scheduler_every_s)
            if now >= due["worker"]:
                self.kill_worker()
                due["worker"] = self._next(p.worker_every_s)
            if now >= due["broker"]:
                if self._broker_reserved_for_commit() or self._broker_reserved_for_isolation():
                    due["broker"] = now + 1.0  # the one broker slot goes to the kill inside a commit first
                elif self.kill_broker():
                    due["broker"] = self._next(p.broker_every_s)
                    self._broker_kill_waiting = False
                else:
                    due["broker"] = now + 1.0  # not now: a broker is down or the ISR is not complete
                    self._broker_kill_waiting = True
            if now >= due["commit"]:
                # Until one broker kill inside a commit happened, that kind goes first whenever the
                # brokers are whole: broker kills keep one busy most of a short run.
                # (counted from what commits took: a kind counts when a commit took it, not when armed;
                # while the brokers are not whole, the other kinds go in turn meanwhile)
                self.count_commit_faults()
                if not self._commit_fault_armed():
                    self.arm_commit_fault("broker-restart" if not self.counts[BROKER_RESTART_IN_COMMIT]
                                          and not self._broker_busy and self.cluster.healthy() else None)
                # While a kind the run requires has not happened, the next is armed as soon as a commit took
                # the last: on a loaded machine the schedulers commit seldom, and a short run needs each once.
                due["commit"] = now + 0.5 if self._commit_kinds_missing() else self._next(p.commit_every_s)
            if now >= due["sigstop"]:
                self.sigstop_scheduler()
                due["sigstop"] = self._next(p.sigstop_every_s)
            if now >= due["allocator"]:
                self.sigstop_allocator()
                due["allocator"] = self._next(p.allocator_sigstop_every_s)
            if now >= due["partition"]:
                due["partition"] = self._next(p.partition_every_s) if self.partition_host() else now + 1.0
            if now >= due["isolate"]:
                # a plain broker kill that is due goes first: its settle time (5 s) is longer than an
                # isolation's, so with isolations back to back it never found the slot free (the long run of
                # 140b007 had none)
                if (self._broker_reserved_for_commit() or self._broker_kill_waiting) and \
                        not self._broker_reserved_for_isolation():
                    due["isolate"] = now + 1.0
                else:
                    due["isolate"] = self._next(p.isolate_every_s) if self.isolate_broker() else now + 0.5
            time.sleep(0.05)

    def _broker_reserved_for_commit(self) -> bool:
        """A run that requires a broker kill -9 inside a commit gets it before any plain broker kill.

        One broker is down at a time, and on a loaded machine a killed broker takes minutes to be back and
        whole: a plain broker kill that came first (at a random time) kept the broker busy past a short run's
        end, so the kind inside a commit never happened (both 3-worker pytest-xdist runs on 2 cores)."""
        if BROKER_RESTART_IN_COMMIT not in self.require_kinds or self.plan.commit_every_s <= 0:
            return False
        self.count_commit_faults()
        return not self.counts[BROKER_RESTART_IN_COMMIT]

    def _broker_reserved_for_isolation(self) -> bool:
        """A run that requires a broker isolated from the other two gets it before any plain broker kill (the
        slot is the same, and a killed broker can keep it busy for minutes on a loaded machine)."""
        return (BROKER_ISOLATED in self.require_kinds and self.plan.isolate_every_s > 0
                and bool(self.cluster.hosts) and not self.counts[BROKER_ISOLATED])

    def _commit_fault_armed(self) -> bool:
        return self.fault_dir is not None and (self.fault_dir / "next").exists()

    def _commit_kinds_missing(self) -> bool:
        return any(not self.counts[k] for k in COMMIT_KINDS.values() if k in self.require_kinds)

    def _in_commit_pid(self) -> int | None:
        """The scheduler inside the commit that took ``broker-restart`` (it waits there for the broker kill)."""
        try:
            return int((self.fault_dir / "committing").read_text()) if self.fault_dir is not None else None
        except (OSError, ValueError):
            return None

    def recover(self, timeout_s: float = 300.0) -> None:
        """Restart everything that is down and wait for the cluster to be whole."""
        deadline = time.monotonic() + timeout_s
        self._disarm.set()
        self.resume_due(float("inf"))
        self.heal_due(float("inf"))  # the hosts; an isolated broker is healed by its thread (joined below)
        if self.fault_dir is not None:  # disarm what no commit took
            (self.fault_dir / "next").unlink(missing_ok=True)
        while self._restarts and time.monotonic() < deadline:
            self.restart_due(float("inf"))
        if self._broker_thread is not None:
            self._broker_thread.join(max(1.0, deadline - time.monotonic()))
        self.supervise()
        if not self.cluster.wait_healthy(max(1.0, deadline - time.monotonic())):
            self.say("warning: the cluster is not whole after recovery")

    def restart_due(self, now: float) -> None:
        while self._restarts and self._restarts[0][0] <= now:
            _, _, proc, empty = heapq.heappop(self._restarts)
            if empty:
                shutil.rmtree(self.scheduler_dirs[proc.name], ignore_errors=True)
            proc.start()

    def _schedule_restart(self, proc: Proc, empty: bool = False) -> None:
        self._seq += 1
        delay = self.rng.uniform(*self.plan.restart_delay_s)
        heapq.heappush(self._restarts, (time.monotonic() + delay, self._seq, proc, empty))

    def supervise(self) -> None:
        """Restart processes that died without being killed; remember them. A resumed zombie that
        exits (fenced) is expected: recorded, and restarted unless it is an allocator's old instance."""
        for proc in [*self.schedulers, *self.workers, *self.others, *self.allocators]:
            with proc.lock:
                if proc.down_on_purpose or proc.proc is None or proc.alive():
                    continue
                code = proc.exit_code()
                expected = time.monotonic() < proc.expect_exit_until  # a resumed zombie, in its window
                if expected or code == EXIT_FENCED:
                    # Fenced by a newer instance of itself (also a scheduler whose transaction straddled a
                    # broker failover, or a zombie that noticed late on a loaded machine): it stands down by
                    # design, no crash. An allocator whose twin holds the pool is the standby now
                    # (restarting it would fence the holder, whose restart would fence it: a loop).
                    self.record("zombie exited (fenced)" if expected else "exited fenced", proc.name, exit_code=code)
                    proc.expect_exit_until = 0.0
                    if proc in self.allocators and (
                            expected or any(a.alive() for a in self.allocators if a is not proc)):
                        proc.down_on_purpose = True
                    else:
                        proc.start()
                    continue
                tail = "\n".join(line for line in proc.tail(60).splitlines()
                                 if "librdkafka" not in line and line.strip("│ "))[-3000:]
                # a traceback's last line ("LogError: ...") or the CLI's one-line error ("error: ...")
                errors = [ln.strip() for ln in tail.splitlines()
                          if ln[:1].isalpha() and ("Error" in ln.split(":")[0] or ln.startswith("error:"))]
                self.unexpected.append({"t": round(time.monotonic() - self.t0, 3), "process": proc.name,
                                        "exit_code": code, "reason": errors[-1][:300] if errors else "",
                                        "tail": tail})
                self.record("unexpected exit", proc.name, exit_code=code)
                self.say(f"unexpected exit of {proc.name} (code {code}); restarting it\n{tail}")
                proc.start()

    # -- faults ---------------------------------------------------------------------
    def kill_scheduler(self) -> None:
        alive = [s for s in self.schedulers if s.alive()]
        down = len(self.schedulers) - len(alive)
        # not the one inside the commit that waits for its broker kill: killed there, the fault never counts
        alive = [s for s in alive if s.pid != self._in_commit_pid()]
        if not alive or down >= self.plan.max_schedulers_down:
            return
        victim = self.rng.choice(alive)
        empty = self.rng.random() < self.plan.empty_state_share
        victim.kill9()
        self.record(SCHEDULER_KILL_EMPTY if empty else SCHEDULER_KILL, victim.name)
        self._schedule_restart(victim, empty)

    def kill_worker(self) -> None:
        alive = [w for w in self.workers if w.alive()]
        if not alive:
            return
        victim = self.rng.choice(alive)
        victim.kill9()
        self.record(WORKER_KILL, victim.name)
        self._schedule_restart(victim)

    def kill_broker(self) -> bool:
        if self._broker_busy or time.monotonic() < self._broker_ready_at + self.plan.broker_settle_s:
            return False
        if not self.cluster.healthy():
            return False
        node = self.rng.randint(1, 3)
        down_s = self.rng.uniform(*self.plan.broker_down_s)
        self._broker_busy = True
        if not self.cluster.kill9(node):
            self._broker_busy = False
            return False
        self.record(BROKER_KILL, f"broker-{node}", down_s=round(down_s, 1))
        self._broker_thread = threading.Thread(target=self._bring_back, args=(node, down_s), daemon=True,
                                               name="broker-restart")
        self._broker_thread.start()
        return True

    def _bring_back(self, node: int, down_s: float) -> None:
        """Restart a killed broker once it was down ``down_s`` and the controller fenced it.

        A broker restarted before it was fenced (KRaft's broker session timeout, 9 s) looks
        whole in the metadata while it is still catching up; killing another one then
        would take two brokers out at once.
        """
        time.sleep(down_s)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reg = self.cluster.registered()
            if reg is not None and node not in reg:
                break
            time.sleep(0.5)
        for attempt in range(5):
            try:
                self.cluster.restart_missing()
                break
            except Exception as exc:  # a restart that fails is retried; the run reports it if it never works
                self.say(f"restarting broker-{node} failed (attempt {attempt + 1}): {exc}")
                time.sleep(2)
        self.record("broker restarted", f"broker-{node}")
        if not self.cluster.wait_healthy(180):
            self.say(f"warning: broker-{node} is back but the ISR is not complete after 180 s")
        self._broker_ready_at = time.monotonic()
        self._broker_busy = False

    # -- issue 13: commit faults and zombies ----------------------------------------------
    def arm_commit_fault(self, kind: str | None = None) -> bool:
        """Arm the next commit-fault kind (in turn), or ``kind``, in the schedulers' shared folder: the
        first commit with records, of whichever scheduler, takes it; it stays armed until then (recover()
        takes back what none took). True if armed."""
        folder = self.fault_dir
        if folder is None:
            return False
        now = time.monotonic()
        if (folder / "next").exists():
            # A fault stays armed until a commit takes it. (It was taken back after 8 s without a commit and
            # armed again seconds later: on a loaded machine, where the schedulers commit seldom, a short run
            # lost most of its commits that way, and broker-restart lost the broker to a plain broker kill.)
            return False
        broker_free = not self._broker_busy and self.cluster.healthy()
        if kind is not None:
            if kind == "broker-restart" and not broker_free:
                return False
        else:
            # a kind no commit took yet goes first (a short run needs each once), else the next in turn
            n = len(commitfaults.KINDS)
            order = [commitfaults.KINDS[(self._commit_turn + i) % n] for i in range(n)]
            missing = [k for k in order if not self.counts[COMMIT_KINDS[k]] and (k != "broker-restart" or broker_free)]
            kind = missing[0] if missing else order[0]
            self._commit_turn += 1
            if kind == "broker-restart" and not broker_free:
                # a broker is down or coming back (minutes on a loaded machine): the next kind instead
                kind = commitfaults.KINDS[self._commit_turn % len(commitfaults.KINDS)]
                self._commit_turn += 1
        if kind == "broker-restart" and self.counts[BROKER_RESTART_IN_COMMIT] and \
                now < self._broker_commit_at + self.plan.commit_broker_gap_s:
            kind = commitfaults.KINDS[self._commit_turn % len(commitfaults.KINDS)]  # not yet: the next kind
            self._commit_turn += 1
            if kind == "broker-restart":
                return False
        self._armed_at = now
        self._armed_kind = kind
        commitfaults.arm(folder, kind)
        self.record("armed", "schedulers", fault=kind)
        if kind == "broker-restart":
            self._broker_commit_at = now
            self._broker_busy = True
            self._broker_thread = threading.Thread(target=self._kill_broker_in_commit, args=(folder,),
                                                   daemon=True, name="broker-in-commit")
            self._broker_thread.start()
        return True

    def _kill_broker_in_commit(self, folder: Path) -> None:
        """Wait for a scheduler to take the fault and be inside its commit, kill -9 a broker, let it commit.

        Waits as long as the fault is armed (until recover()), not a fixed time: the first commits of a
        run on a loaded machine come late. Gives up if the fault was taken and no commit says it is inside
        (``committing``) within 10 s: its taker died first."""
        taken_at: float | None = None
        while not (folder / "committing").exists():
            if self._disarm.is_set():
                break
            if not (folder / "next").exists():
                taken_at = taken_at or time.monotonic()
                if time.monotonic() - taken_at > 10.0:
                    break
            time.sleep(0.02)
        if not (folder / "committing").exists():
            (folder / "next").unlink(missing_ok=True)  # no commit took it: disarmed
            self._broker_busy = False
            return
        node = self.rng.randint(1, 3)
        down_s = self.rng.uniform(*self.plan.broker_down_s)
        killed = self.cluster.kill9(node)
        (folder / "go.tmp").write_text("killed" if killed else "")
        (folder / "go.tmp").replace(folder / "go")  # whole, never seen half-written
        # The commit removes both files when it goes on (within its 20 s wait); left there, its process died
        # first, and a later broker-restart commit would read this "go" as its own broker kill.
        deadline = time.monotonic() + 25
        while (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for f in ("go", "committing"):
            (folder / f).unlink(missing_ok=True)
        if not killed:
            self._broker_busy = False
            return
        self.record("broker kill -9 (in a commit)", f"broker-{node}", down_s=round(down_s, 1))
        self._bring_back(node, down_s)

    def sigstop_scheduler(self) -> None:
        alive = [s for s in self.schedulers if s.alive() and not s.stopped]
        victims = [s for s in alive if s.pid != self._in_commit_pid()]  # not the one waiting in its commit
        if len(alive) < 2 or not victims:
            return  # someone must take its partitions
        victim = self.rng.choice(victims)
        pid = victim.sigstop()
        if pid is None:
            return
        self.record(SCHEDULER_SIGSTOP, victim.name, stopped_s=self.plan.sigstop_s)
        self._seq += 1
        heapq.heappush(self._conts, (time.monotonic() + self.plan.sigstop_s, self._seq, victim, pid, None))

    def sigstop_allocator(self) -> None:
        active = [a for a in self.allocators if a.alive() and not a.stopped]
        standby = [a for a in self.allocators if not a.alive()]
        if len(active) != 1 or not standby:
            return
        pid = active[0].sigstop()
        if pid is None:
            return
        self.record(ALLOCATOR_SIGSTOP, active[0].name, stopped_s=self.plan.sigstop_s, successor=standby[0].name)
        self._seq += 1
        heapq.heappush(self._conts, (time.monotonic() + self.plan.sigstop_s, self._seq, active[0], pid, standby[0]))

    def resume_due(self, now: float) -> None:
        """SIGCONT stopped processes whose time is up (an allocator's successor is started first)."""
        while self._conts and self._conts[0][0] <= now:
            _, _, proc, pid, successor = heapq.heappop(self._conts)
            if successor is not None:
                successor.start()
                time.sleep(2.0)  # its transactional producer's initialisation fences the zombie
            proc.expect_exit_until = time.monotonic() + 60.0
            proc.sigcont(pid)

    # -- issue 25: network partitions of hosts and brokers ----------------------------------------
    def _partition_secs(self, short: tuple[float, float], long_share: float) -> float:
        """How long a partition lasts: uniform in ``short``, or (``long_share`` of them) log-uniform in
        ``partition_long_s``: most cuts are short, some outlast every lease and session."""
        p = self.plan
        if long_share > 0 and self.rng.random() < long_share:
            lo, hi = p.partition_long_s
            return float(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        return self.rng.uniform(*short)

    def partition_host(self) -> bool:
        """Cut a host that is not cut now (the host kinds in turn, the one with fewer so far first); False if
        ``max_hosts_cut`` are cut already."""
        free = [h for h in self.hosts if h.ns not in self._heal_at]
        if not free or len(self._heal_at) >= self.plan.max_hosts_cut:
            return False
        n = len(HOST_PARTITION_KINDS)
        order = [HOST_PARTITION_KINDS[(self._partition_turn + i) % n] for i in range(n)]
        kind = min(order, key=lambda k: self.counts[k])  # stable: the turn's first among the fewest
        self._partition_turn += 1
        host = self.rng.choice(free)
        secs = self._partition_secs(self.plan.partition_s, self.plan.partition_long_share)
        if kind == HOST_CUT:
            host.cut()
        else:
            host.cut_from(self.broker_addrs)
        self.record(kind, getattr(host, "label", host.ns), cut_s=round(secs, 1))
        self._heal_at[host.ns] = (time.monotonic() + secs, host)
        return True

    def heal_due(self, now: float) -> None:
        for ns, (at, host) in list(self._heal_at.items()):
            if now >= at:
                host.heal()
                del self._heal_at[ns]
                self.record("partition healed", getattr(host, "label", ns))

    def isolate_broker(self) -> bool:
        """Isolate a random broker from the other two (the cluster's ``isolate``), heal it after a while in a
        thread that then waits until the cluster is whole; False if the broker slot is not free now."""
        if self._broker_busy or time.monotonic() < self._broker_ready_at + self.plan.isolate_settle_s:
            return False
        if not self.cluster.healthy():
            return False
        node = self.rng.randint(1, 3)
        secs = self._partition_secs(self.plan.isolate_s, self.plan.isolate_long_share)
        self._broker_busy = True
        self.cluster.isolate(node)
        self.record(BROKER_ISOLATED, f"broker-{node}", cut_s=round(secs, 1))
        self._broker_thread = threading.Thread(target=self._heal_broker, args=(node, secs), daemon=True,
                                               name="broker-heal")
        self._broker_thread.start()
        return True

    def _heal_broker(self, node: int, secs: float) -> None:
        self._disarm.wait(secs)  # recover() heals at once
        self.cluster.heal()
        self.record("partition healed", f"broker-{node}")
        # Until the healed broker has caught up with the controller, its metadata (which clients may ask) is the
        # stale one of before the cut: whole, full ISRs. Look only after it had time to hear the news.
        time.sleep(1.0)
        if not self.cluster.wait_healthy(180):
            self.say(f"warning: broker-{node} is back in the network but the ISR is not complete after 180 s")
        self._broker_ready_at = time.monotonic()
        self._broker_busy = False
