"""GPU processes: ``dagfold allocator`` (one per pool) and ``dagfold agent`` (one per GPU host).

On Kafka each runs as its own process (a host runs its agent next to its
GPUs); ``dagfold up --gpu-nodes N`` runs one allocator and N simulated agents
inside the local stack instead. Registered on the main ``dagfold`` app by
``dagfold.cli``.
"""

from __future__ import annotations

import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import typer

from dagfold.cli.common import (
    ALLOW_ROOT_HELP,
    TASK_ENV_HELP,
    DataOpt,
    LogOpt,
    VerboseOpt,
    _config,
    _logging,
    app,
    fail,
    out,
    run_until_stopped,
    serve_metrics,
    task_runtime,
)

PoolOpt = typer.Option("default", "--pool", help="GPU pool: the queue name of the GPU tasks it serves")
MetricsPortOpt = typer.Option(None, "--metrics-port", envvar="DAGFOLD_METRICS_PORT",
                              help="serve Prometheus /metrics on this port")
MetricsAddrOpt = typer.Option("127.0.0.1", "--metrics-addr", help="address for --metrics-port")


@app.command()
def allocator(pool: str = PoolOpt, log: LogOpt = None, data: DataOpt = None,
              lease_s: float = typer.Option(30.0, "--lease-s", help="node lease: heartbeats must come this often"),
              grace_s: float = typer.Option(30.0, "--grace-s", help="preemption/drain: checkpoint -> forced stop"),
              metrics_port: int | None = MetricsPortOpt, metrics_addr: str = MetricsAddrOpt,
              tenants_file: Path | None = typer.Option(
                  None, "--auth-file", envvar="DAGFOLD_AUTH_FILE",
                  help="the auth file: its tenants' fair-share weights and this pool's GPU quotas at start "
                       "(the API's admin changes reach the allocator through the log, live)"),
              verbose: VerboseOpt = False) -> None:
    """Run the GPU allocator of one pool (one writer per pool; a newer instance fences an older one)."""
    from dagfold.log import open_log
    from dagfold.services.allocator.options import options_for_pool
    from dagfold.services.allocator.runner import AllocatorRunner, tune_gc
    from dagfold.services.api.auth import AuthConfig, AuthConfigError

    _logging(verbose)
    try:
        tenants = AuthConfig.from_env(tenants_file, env={}).limits if tenants_file else {}
    except AuthConfigError as exc:
        raise fail(str(exc)) from None
    cfg = _config(log, data)
    serve_metrics(metrics_port, metrics_addr)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    lg.create_topics(cfg.core_topics())
    runner = AllocatorRunner(lg, options_for_pool(pool, tenants, lease_s=lease_s, grace_s=grace_s), cfg.data_dir)
    tune_gc()  # caught up: freeze the state, collect less often (decision p99; see runner.GC_THRESHOLD)
    out.print(f"dagfold allocator: pool {pool} on {cfg.log_url}")
    run_until_stopped(runner.run, lg.close)


def _sync_faults(devices: object, faults_file: Path) -> None:
    """Make the simulated device's faults those listed in ``faults_file`` (one name a line)."""
    from dagfold.services.agent.devices import FAULTS, SimulatedDevices

    if not isinstance(devices, SimulatedDevices):
        return
    try:
        wanted = {ln.strip() for ln in faults_file.read_text().splitlines() if ln.strip() in FAULTS}
    except FileNotFoundError:
        wanted = set()
    for f in wanted - devices.faults:
        devices.inject(f)
    for f in devices.faults - wanted:
        devices.clear(f)


@app.command()
def agent(pool: str = PoolOpt, log: LogOpt = None,
          node: str = typer.Option(socket.gethostname(), "--node", help="node ID, unique in the pool"),
          command: str = typer.Option(f"{shlex.quote(sys.executable)} -m dagfold.services.agent.demo_job", "--command",
                                      help="the job process a grant runs (DAGFOLD_* environment, see docs)"),
          artifacts: str = typer.Option("", "--artifacts", envvar="DAGFOLD_ARTIFACTS",
                                        help="artifact storage of outputs and checkpoints: a folder every host "
                                        "and the API reach, or s3://bucket/prefix?endpoint=URL (default: "
                                        ".dagfold/artifacts)"),
          work_dir: Path | None = typer.Option(None, "--work-dir", help="host-local folder of the job processes' "
                                               "checkpoint and output folders (default .dagfold/agent-work/NODE)"),
          keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints",
                                                help="keep a task's checkpoints in storage after it succeeded"),
          simulate: bool = typer.Option(False, "--simulate", help="simulated GPUs instead of NVML"),
          gpus: int = typer.Option(8, "--gpus", min=1, max=64, help="simulated GPU count"),
          gpu_type: str = typer.Option("H100", "--gpu-type", help="simulated GPU type"),
          faults_file: Path | None = typer.Option(None, "--faults-file",
                                                  help="simulated faults to apply, one a line (throttle, ecc, ...)"),
          hb_interval_s: float = typer.Option(1.0, "--heartbeat-s", min=0.05, help="heartbeat every this many "
                                              "seconds"),
          task_user: str | None = typer.Option(None, "--task-user", envvar="DAGFOLD_TASK_USER",
                                               help="run job processes as this user (the agent must run as root)"),
          task_env: list[str] = typer.Option([], "--task-env", help=TASK_ENV_HELP),
          allow_root_tasks: bool = typer.Option(False, "--allow-root-tasks", envvar="DAGFOLD_ALLOW_ROOT_TASKS",
                                                help=ALLOW_ROOT_HELP),
          metrics_port: int | None = MetricsPortOpt, metrics_addr: str = MetricsAddrOpt,
          verbose: VerboseOpt = False) -> None:
    """Run the node agent of one GPU host: register, heartbeat health, run granted jobs."""
    from dagfold.artifacts import ArtifactError, LocalArtifactStore, open_store
    from dagfold.exceptions import LogError
    from dagfold.log import open_log
    from dagfold.services.agent.agent import NodeAgent
    from dagfold.services.agent.devices import Devices, NvmlDevices, SimulatedDevices
    from dagfold.services.agent.exceptions import NvmlUnavailable
    from dagfold.services.agent.launcher import Launcher

    _logging(verbose)
    runtime = task_runtime(task_user, None, task_env, allow_root_tasks, runs_processes=True)
    cfg = _config(log, None)
    if cfg.log_url == "embedded":
        raise fail("an agent process needs a shared log (kafka://...); `dagfold up --gpu-nodes N` runs "
                   "simulated agents inside the embedded stack")
    devices: Devices
    try:
        devices = SimulatedDevices(gpus, gpu_type) if simulate else NvmlDevices()
    except NvmlUnavailable as exc:
        raise fail(f"no GPUs found through NVML ({exc}); use --simulate for a simulated host") from None
    try:
        store = open_store(artifacts, Path(".")) if "://" in artifacts or artifacts.startswith("file:") \
            else LocalArtifactStore(Path(artifacts or ".dagfold/artifacts"))
    except (ArtifactError, OSError) as exc:
        raise fail(f"--artifacts: {exc}") from None
    serve_metrics(metrics_port, metrics_addr)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    launcher = Launcher(shlex.split(command), store, work_dir or Path(".dagfold") / "agent-work" / node,
                        runtime=runtime)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while True:  # a log unreachable at start is waited for, as one that goes away later is ridden out
        try:
            node_agent = NodeAgent(lg, pool, node, devices, launcher, hb_interval_s=hb_interval_s,
                                   keep_checkpoints=keep_checkpoints)
            break
        except LogError as exc:
            out.print(f"dagfold agent: waiting for the log: {exc}")
            if stop.wait(2.0):
                launcher.close()
                lg.close()
                return
    out.print(f"dagfold agent: node {node} ({devices.count}x {devices.gpu_type}) in pool {pool}")
    node_agent.register()
    try:
        while not stop.is_set():
            if faults_file is not None:
                _sync_faults(devices, faults_file)
            node_agent.step()
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        node_agent.close()
        lg.close()
