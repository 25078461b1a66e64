"""Shared fixtures. Each section belongs to one area; add new ones under their own heading."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dagfold.localkafka import LocalKafka, free_base_port
from dagfold.log.base import Log
from tests.cli_support import TEST_CONSUMER_CONFIG, UpProcess
from tests.s3_support import S3Server

# The suite runs as root in CI, and its stacks run shell tasks and GPU jobs without a task user: it says
# so explicitly, as an operator must (`--allow-root-tasks`; tests/test_task_isolation.py checks the refusal).
if os.geteuid() == 0:
    os.environ.setdefault("DAGFOLD_ALLOW_ROOT_TASKS", "1")

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------
# Options and markers
# --------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        longest_files_first(items)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------
# Parallel runs: `make test` runs pytest-xdist, `-n 3 --dist loadfile --no-loadscope-reorder`
#
# Each worker is a pytest session of its own: its own Kafka broker, S3 server and `dagfold up`
# (the session fixtures below) and tmp_path folders. A test file is the unit a worker takes: a
# module-scoped fixture starts once, and test_chaos.py's two 3-broker runs never overlap.
# (--dist loadgroup would hand out single tests, but its xdist_group marks do nothing under
# pytest 9.2 with pytest-xdist 3.8.0: xdist renames item._nodeid, which pytest no longer reads.)
# The longest files go first, so that none of them ends the run alone; the order changes nothing
# else (each test starts what it needs), and a run without xdist keeps the collection order.
# --------------------------------------------------------------------------

# longest first (from `make test`'s durations); the other files keep their collection order
LONG_FIRST = (
    "tests/test_chaos.py",
    "tests/test_soak.py",
    "tests/test_gpu_kafka.py",
    "tests/test_partitions.py",  # a 3-minute cut and a 20 s one, each with its own stack: about 7 minutes
    "tests/test_kafka_e2e.py",
    "tests/test_fold_properties.py",
    "tests/test_replay_window.py",
    "tests/test_scale_out.py",
    "tests/test_gpu_props.py",
    "tests/test_failure_scenarios.py",
    "tests/test_worker_loss.py",
    "tests/test_cli_embedded.py",
    "tests/test_wfcommons.py",
    "tests/test_kafka_runs.py",
    "tests/test_schemathesis.py",
    "tests/test_replay_audit.py",
    "tests/test_kafka_security.py",
    "tests/test_java_producer.py",
    "tests/test_sim_small.py",
)


def longest_files_first(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


# --------------------------------------------------------------------------
# Log backends: a Kafka broker for the session, and both backends per test
#
# kafka_bootstrap picks, in order:
#   DAGFOLD_TEST_KAFKA=host:port   an already running broker (nothing started or stopped)
#   a Docker daemon answering      testcontainers' KafkaContainer (KRaft),
#                                  image DAGFOLD_TEST_KAFKA_IMAGE (default confluentinc/cp-kafka:7.6.0)
#   otherwise                      deploy/kafka/kafka.sh on 127.0.0.1, port DAGFOLD_TEST_KAFKA_PORT
#                                  or the first free of 19092, 19192, ... (controller port +1000;
#                                  concurrent sessions each get their own broker), data in
#                                  $TMPDIR/dagfold-kafka-test/<port>, removed at session end
# --------------------------------------------------------------------------

KAFKA_TEST_BASE = Path(os.environ.get("TMPDIR", "/tmp")) / "dagfold-kafka-test"


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _kafka_sh(cmd: str, port: int, data: Path) -> None:
    LocalKafka(port, data).sh(cmd, timeout=180)


def _owner_alive(data: Path) -> bool:
    """Whether the test session that claimed ``data`` still runs (a zombie does not)."""
    try:
        pid = int((data / "owner.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    stat = Path(f"/proc/{pid}/stat")  # Linux only; elsewhere a live pid is enough
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[:1] != ["Z"]


def _claim_test_broker_dir() -> tuple[int, Path]:
    """Pick a port and claim its data folder, safely against concurrent test sessions.

    Under a file lock: stop brokers whose session died without teardown (kill -9), then
    take the first port whose folder is unclaimed and whose ports are free.
    """
    KAFKA_TEST_BASE.mkdir(parents=True, exist_ok=True)
    fixed = os.environ.get("DAGFOLD_TEST_KAFKA_PORT")
    candidates = [int(fixed)] if fixed else list(range(19092, 29092, 100))
    with open(KAFKA_TEST_BASE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for data in KAFKA_TEST_BASE.iterdir():
            if data.is_dir() and data.name.isdigit() and not _owner_alive(data):
                _kafka_sh("stop", int(data.name), data)
                shutil.rmtree(data, ignore_errors=True)
        for port in candidates:
            data = KAFKA_TEST_BASE / str(port)
            if not data.exists() and free_base_port([port]) == port:
                data.mkdir()
                (data / "owner.pid").write_text(str(os.getpid()))
                return port, data
    raise RuntimeError(f"no free port for the test broker among {candidates[:5]}...")


def _local_kafka() -> Iterator[str]:
    port, data = _claim_test_broker_dir()
    try:
        _kafka_sh("start", port, data)
        yield f"127.0.0.1:{port}"
    finally:
        _kafka_sh("stop", port, data)
        shutil.rmtree(data, ignore_errors=True)


def _container_kafka() -> Iterator[str]:
    from testcontainers.community.kafka import KafkaContainer

    image = os.environ.get("DAGFOLD_TEST_KAFKA_IMAGE", "confluentinc/cp-kafka:7.6.0")
    container = (
        KafkaContainer(image)
        .with_kraft()
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
    )
    container.start(timeout=120)
    try:
        yield container.get_bootstrap_server()
    finally:
        container.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a Kafka broker shared by the whole session (never skipped)."""
    external = os.environ.get("DAGFOLD_TEST_KAFKA")
    if external and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.fail(f"DAGFOLD_TEST_KAFKA={external} is one broker for every pytest-xdist worker, whose stacks "
                    "would share its topics and consumer groups: run in one process (make test PYTEST_XDIST=, "
                    "or pytest -n 0)")
    if external:
        yield external
    elif _docker_answers():
        yield from _container_kafka()
    else:
        yield from _local_kafka()


@pytest.fixture
def unique_topic() -> Callable[..., str]:
    """``unique_topic("events")`` -> ``events-<12 hex>``: tests sharing the session broker never collide."""

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}"

    return make


@pytest.fixture(params=["embedded", "memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def log_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Log]:
    """A fresh ``Log`` of each backend (the in-memory one is the virtual-time driver's); Kafka is
    started only when a Kafka test runs."""
    log: Log
    if request.param == "memory":
        from dagfold.log.memory import MemoryLog

        log = MemoryLog()
    elif request.param == "embedded":
        from dagfold.log.embedded import EmbeddedLog

        log = EmbeddedLog(tmp_path / "log")
    else:
        from dagfold.log.kafka import KafkaLog

        log = KafkaLog(request.getfixturevalue("kafka_bootstrap"), consumer_config=TEST_CONSUMER_CONFIG)
    try:
        yield log
    finally:
        log.close()


# -- object storage (S3-compatible: S3Proxy on loopback) ----------------------------------------
@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server shared by the session (tests/s3_support.py); boto3 gets its key."""
    from tests.s3_support import set_env

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    old = set_env(server)
    try:
        yield server
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- hosts with networks of their own (tests/netns_support.py) ----------------------------------------------
@pytest.fixture(scope="module")
def net() -> Iterator[object]:
    """A test network shared by a file's tests: namespaces, links and addresses of its own, removed after the
    file. A machine where ``ip netns`` cannot be used fails the test with the reason (never a skip)."""
    from tests.netns_support import Net, NetnsError

    try:
        n = Net()
    except NetnsError as exc:
        pytest.fail(f"network namespaces are needed (run the tests as root on Linux with iproute2): {exc}")
    try:
        yield n
    finally:
        n.close()


# -- `dagfold up` shared by the session ------------------------------------------------------------
@pytest.fixture(scope="session")
def up_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`dagfold up` on the embedded log (3 workers; noop, sleep and shell handlers; none of the caller's
    DAGFOLD_* settings), started once for the tests that submit their own jobs and only read: the CLI's,
    the dashboard's. A test that stops, kills or reconfigures its stack starts its own UpProcess."""
    with UpProcess(tmp_path_factory.mktemp("up") / "data", workers=3, args=("--handlers", "noop,sleep,shell"),
                   clean_env=True) as up:
        yield up
