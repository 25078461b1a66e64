"""A newcomer's first hour, black box: the ``dagfold`` command as a new user runs it (issue 17).

Every test runs the CLI as a process (``python -m dagfold``, stdout and stderr piped, no terminal) against
``dagfold up`` started here, or runs ``dagfold run`` on its own throwaway stack. Each one covers a bullet of
the issue's "Why" and fails on the code before it: failures that hide their stderr, silence during long runs,
truncated and unresolvable job IDs, noisy history, tracebacks for user errors, and help without examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_support import free_port
from tests.cli_support import UpProcess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def dagfold(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (no terminal: output piped)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DAGFOLD_")}
    full_env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "80", **(env or {})})
    return subprocess.run([sys.executable, "-m", "dagfold", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


def cli(up: UpProcess, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The CLI against ``up``'s API (DAGFOLD_API set, as after `dagfold up`)."""
    return dagfold(*args, env={"DAGFOLD_API": up.api}, timeout=timeout)


@pytest.fixture
def up(up_stack: UpProcess) -> UpProcess:
    """The session's `dagfold up` (tests/conftest.py): these tests submit their own jobs and only read."""
    return up_stack


# -- 1. failures explain themselves ---------------------------------------------------------------------
def test_run_prints_failed_task_reason_and_stderr_and_json_has_them(tmp_path: Path) -> None:
    r = dagfold("run", str(EXAMPLES / "failing.yaml"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "about to fail" in r.stdout  # the task's own stderr, not only "exit code 3"
    assert "bad failed" in r.stdout and "exit code 3" in r.stdout
    assert "--keep" in r.stderr  # says how to keep the data folder
    r = dagfold("run", str(EXAMPLES / "failing.yaml"), "--json")
    failures = json.loads(r.stdout)["failures"]
    assert [(f["task_id"], f["exit_code"]) for f in failures] == [("bad", 3)]
    assert "about to fail" in failures[0]["stderr_tail"]


def test_run_keep_keeps_the_data_folder() -> None:
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), "--keep")
    assert r.returncode == 0, r.stdout + r.stderr
    kept = Path(r.stderr.split("data kept in ", 1)[1].split(" ", 1)[0])
    try:
        assert kept.is_dir() and (kept / "projections").is_dir()
    finally:
        import shutil

        shutil.rmtree(kept, ignore_errors=True)


def test_submit_wait_prints_failed_task_stderr(up: UpProcess) -> None:
    r = cli(up, "submit", str(EXAMPLES / "failing.yaml"), "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "about to fail" in r.stdout and "exit code 3" in r.stdout
    r = cli(up, "submit", str(EXAMPLES / "failing.yaml"), "--wait", "--json")
    assert "about to fail" in json.loads(r.stdout)["failures"][0]["stderr_tail"]


# -- 2. live progress ---------------------------------------------------------------------------------
def test_run_and_submit_wait_show_progress_lines_when_piped(up: UpProcess) -> None:
    r = dagfold("run", str(EXAMPLES / "failing.yaml"))
    # piped: plain progress lines on stderr (state, finished/total, counts), then each failure as it happens
    assert "6/6" in r.stderr and "failed=1" in r.stderr, r.stderr
    assert "✗ bad attempt 1: exit code 3" in r.stderr
    r = cli(up, "submit", str(EXAMPLES / "diamond.yaml"), "--wait")
    assert r.returncode == 0 and "succeeded 4/4" in r.stderr, r.stderr


# -- 4. readable history ------------------------------------------------------------------------------
def test_history_says_each_reason_once_with_readable_times_and_filters_by_type(up: UpProcess) -> None:
    job_id = up.submit({"tasks": [{"id": "bad", "handler": "shell", "args": {"cmd": "exit 3"}},
                                  {"id": "ok", "handler": "noop"}]})
    up.wait(job_id)
    r = cli(up, "history", job_id, "--type", "TaskFailed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("exit code 3") == 1, r.stdout  # was "exit code 3, exit code 3"
    assert "LeaseGranted" not in r.stdout and "ago)" in r.stdout
    r = cli(up, "history", job_id, "--json")
    events = json.loads(r.stdout)
    lease = next(e for e in events if e["type"] == "LeaseGranted")
    assert "lease until 1" not in lease["detail"] and "lease 30s" in lease["detail"], lease
    r = cli(up, "history", job_id, "--type", "NoSuchEvent")
    assert r.returncode == 2 and "TaskFailed" in r.stdout + r.stderr  # the choices are listed


# -- 3. usable IDs and names --------------------------------------------------------------------------
def test_full_ids_at_80_columns_prefixes_and_names(up: UpProcess) -> None:
    named = up.submit({"name": "nightly-etl", "tasks": [{"id": "a"}]})
    other = up.submit({"name": "adhoc report", "tasks": [{"id": "a"}]})
    up.wait(named)
    up.wait(other)
    for cols in ("80", "120"):
        r = dagfold("jobs", env={"DAGFOLD_API": up.api, "COLUMNS": cols})
        assert r.returncode == 0, r.stderr
        assert named in r.stdout and other in r.stdout, r.stdout  # whole, not "3f2a…"
        assert "nightly-etl" in r.stdout
    r = cli(up, "jobs", "--name", "NIGHTLY", "--json")
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == [named]
    r = cli(up, "jobs", "--since", "1h", "--state", "succeeded", "--sort", "name", "--json")
    listed = [j["job_id"] for j in json.loads(r.stdout)["jobs"]]
    assert listed.index(other) < listed.index(named)  # "adhoc report" < "nightly-etl"
    r = cli(up, "jobs", "--state", "finished")
    assert r.returncode == 2 and "succeeded_partial" in r.stdout + r.stderr  # the choices, listed
    # a unique prefix, or the name, wherever a job ID goes
    prefix = named[:8] if not other.startswith(named[:8]) else named[:13]
    r = cli(up, "status", prefix)
    assert r.returncode == 0 and named in r.stdout and "nightly-etl" in r.stdout, r.stdout + r.stderr
    for cmd in (("tasks", prefix), ("history", prefix), ("attempts", prefix, "a"), ("status", "nightly-etl")):
        r = cli(up, *cmd)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    r = cli(up, "status", "zzzz-no-such-job")
    assert r.returncode == 1 and "no job 'zzzz-no-such-job'" in r.stderr
    no_traceback(r)


# -- 5. configuration in one place --------------------------------------------------------------------
def test_environment_is_not_overridden_by_flag_defaults_and_bad_values_name_the_setting(tmp_path: Path) -> None:
    # DAGFOLD_LOG was silently replaced by --log's default "embedded": the job ran anyway
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), env={"DAGFOLD_LOG": "bogus://nowhere"}, cwd=tmp_path)
    assert r.returncode != 0 and "bogus://nowhere" in r.stderr, r.stdout + r.stderr
    no_traceback(r)
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), "--log", "embedded", env={"DAGFOLD_LOG": "bogus://x"},
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # a flag wins over the environment
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), env={"DAGFOLD_PARTITIONS": "many"}, cwd=tmp_path)
    assert r.returncode == 2 and "DAGFOLD_PARTITIONS='many'" in r.stderr and "int" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no ValueError traceback


def test_dagfold_up_listens_on_dagfold_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:  # a port in use: `up` must try exactly it (it tried 8080 before)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = dagfold("up", "--data", str(tmp_path / "d"), env={"DAGFOLD_PORT": str(port)}, timeout=60)
    assert r.returncode == 1 and f"127.0.0.1:{port}" in r.stderr, r.stdout + r.stderr


def test_config_lists_every_setting_with_its_source_and_the_docs_table_is_current(tmp_path: Path) -> None:
    from dagfold.settings import Settings, settings_markdown

    conf = tmp_path / "dagfold.toml"
    conf.write_text("partitions = 4\nport = 9000\n")
    r = dagfold("--config", str(conf), "config", "--json", env={"DAGFOLD_PORT": "9100"})
    assert r.returncode == 0, r.stderr
    rows = {x["env"]: x for x in json.loads(r.stdout)}
    assert set(rows) == {"DAGFOLD_" + n.upper() for n in Settings.model_fields}
    assert (rows["DAGFOLD_PORT"]["value"], rows["DAGFOLD_PORT"]["source"]) == ("9100", "env")  # env > file
    assert (rows["DAGFOLD_PARTITIONS"]["value"], rows["DAGFOLD_PARTITIONS"]["source"]) == ("4", "file")
    assert rows["DAGFOLD_LOG"]["source"] == "default" and rows["DAGFOLD_LOG"]["flag"] == "--log"
    assert all(x["meaning"] for x in rows.values())
    conf.write_text("prot = 9000\n")
    r = dagfold("--config", str(conf), "config")
    assert r.returncode == 2 and "unknown setting 'prot'" in r.stderr
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert settings_markdown() in docs, "docs/operations.md: refresh the table with `dagfold config --markdown`"


def test_every_variable_read_is_a_declared_setting_and_none_is_dead() -> None:
    import re

    from dagfold.settings import TASK_ENVIRONMENT, Settings, env_name

    declared = {env_name(n) for n in Settings.model_fields}
    read: set[str] = set()
    for folder in ("dagfold", "services", "projections"):
        for f in (ROOT / folder).rglob("*.py"):
            if f.name != "settings.py":
                text = f.read_text()
                read |= set(re.findall(r"\bDAGFOLD_[A-Z0-9_]*[A-Z0-9]", text))
                for prefix in re.findall(r"\b(DAGFOLD_[A-Z0-9_]+_)\{", text):  # f"DAGFOLD_CALLBACK_{name}"
                    read |= {d for d in declared if d.startswith(prefix)}
    undeclared = read - declared - set(TASK_ENVIRONMENT) - {"DAGFOLD_CONFIG", "DAGFOLD_DEBUG", "DAGFOLD_CALLBACK",
                                                             "DAGFOLD_SUBMIT"}
    assert not undeclared, f"read but not in dagfold.settings: {sorted(undeclared)}"
    config_src = (ROOT / "dagfold" / "config.py").read_text()
    dead = {n for n in Settings.model_fields if env_name(n) not in read and f"s.{n}" not in config_src
            and n not in ("log_format", "api")}  # read by the CLI: logging set-up, typer's envvar
    assert not dead, f"declared but never read: {sorted(dead)}"
    # defaults kept in one place: the services' own option classes agree with the table
    from dagfold.services.api.admission import AdmissionConfig
    from dagfold.services.callbacks.options import CallbackOptions

    s = Settings()
    assert (s.submit_rate, s.submit_burst, s.max_open_jobs) == (AdmissionConfig.rate_per_s, AdmissionConfig.burst,
                                                                 AdmissionConfig.max_open_jobs)
    assert (s.callback_timeout_s, s.callback_max_attempts, s.callback_base_backoff_s, s.callback_max_backoff_s,
            s.callback_concurrency, s.callback_tenant_concurrency) == (
        CallbackOptions.timeout_s, CallbackOptions.max_attempts, CallbackOptions.base_backoff_s,
        CallbackOptions.max_backoff_s, CallbackOptions.concurrency, CallbackOptions.tenant_concurrency)
    assert s.callback_allow == "" and CallbackOptions(secret="x").egress.allow == ()
    from dagfold.config import SchedulerOptions

    assert s.commit_interval_s == SchedulerOptions.commit_interval_s


def test_the_scheduler_commit_interval_is_an_operator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """DAGFOLD_COMMIT_INTERVAL_S reaches the scheduler's runtime (0: a transaction per poll); a bad value is
    refused with the setting's name."""
    from dagfold.config import Config
    from dagfold.settings import SettingsError

    monkeypatch.setenv("DAGFOLD_COMMIT_INTERVAL_S", "0")
    assert Config.from_env().scheduler.commit_interval_s == 0
    monkeypatch.setenv("DAGFOLD_COMMIT_INTERVAL_S", "-1")
    with pytest.raises(SettingsError, match="DAGFOLD_COMMIT_INTERVAL_S"):
        Config.from_env()


# -- 6. errors are one line and say what to do --------------------------------------------------------
def test_start_up_errors_are_one_line(up: UpProcess, tmp_path: Path) -> None:
    r = dagfold("up", "--data", str(tmp_path / "d"), "--port", str(up.port), timeout=60)
    assert r.returncode == 1 and "in use" in r.stderr and "--port" in r.stderr, r.stderr
    assert "API http" not in r.stdout  # it claimed the API was up
    no_traceback(r)
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), "--data", str(up.data))
    assert r.returncode == 1 and "in use by another dagfold process" in r.stderr and "--data" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr  # was 76 lines
    # styled, never rich markup printed as text (the consoles read none: "[red]error:[/red]" before)
    assert r.stderr.startswith("error: ") and "[red]" not in r.stderr and "[dim]" not in r.stderr, r.stderr
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), "--data", str(up.data), "-v")
    assert "Traceback" in r.stderr  # -v shows it
    r = dagfold("jobs", "--api", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "start one with `dagfold up`, or pass --api" in r.stderr, r.stderr


def test_missing_broker_and_full_disk_explained() -> None:
    from dagfold.cli.ux import explain
    from dagfold.exceptions import LogError

    line = explain(LogError("cannot read cluster metadata from 127.0.0.1:1: KafkaError{code=_TRANSPORT}"))
    assert "no Kafka broker answers" in line and "make kafka-up" in line
    import errno

    assert "disk full" in explain(OSError(errno.ENOSPC, "No space left on device"))


# -- 7. help like a polished CLI ----------------------------------------------------------------------
def _commands() -> Iterator[tuple[list[str], Any]]:
    import typer

    from dagfold.cli import app

    def walk(c: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        if hasattr(c, "commands"):
            for n, sub in c.commands.items():
                yield from walk(sub, [*path, n])
        else:
            yield path, c

    yield from walk(typer.main.get_command(app), [])


def test_help_has_panels_examples_units_and_no_bool_metavars() -> None:
    r = dagfold("--help", env={"COLUMNS": "120"})
    for panel in ("Run locally", "Client", "Operate", "Kafka deployment", "GPU"):
        assert panel in r.stdout, r.stdout
    assert "<bool>" not in r.stdout
    r = dagfold("--version")
    assert r.returncode == 0 and r.stdout.startswith("dagfold 0.")
    from typer.testing import CliRunner

    from dagfold.cli import app

    for name in {p[0] for p, _ in _commands()}:  # in this process: 27 interpreters would take a minute
        h = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "120"})
        assert h.exit_code == 0 and "Example" in h.output, (name, h.output)
        assert "<bool>" not in h.output, name
    for path, c in _commands():
        missing = [p.name for p in c.params if not (getattr(p, "help", None) or "").strip()]
        assert not missing, f"dagfold {' '.join(path)}: options without help: {missing}"
    r = dagfold("audit", "x", "--format", "xml")
    assert r.returncode == 2 and "csv" in r.stdout + r.stderr


def test_readme_tour_cancel_step_cancels_a_running_job(up: UpProcess) -> None:
    r = cli(up, "submit", str(EXAMPLES / "long.yaml"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    r = cli(up, "cancel", "long-running")
    assert r.returncode == 0, r.stdout + r.stderr
    assert up.wait(job_id)["state"] == "cancelled"


# -- 9. structured logs -------------------------------------------------------------------------------
def test_log_format_json_lines_carry_job_task_attempt() -> None:
    r = dagfold("run", str(EXAMPLES / "failing.yaml"), "-v", "--log-format", "json")  # after the command too
    lines = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    assert lines and all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
    failed = [x for x in lines if x["message"].startswith("attempt failed")]
    assert failed and failed[0]["task_id"] == "bad" and failed[0]["attempt"] == 1 and "job_id" in failed[0], failed
    assert any("partition" in x for x in lines if x["logger"] == "dagfold.processor")


# -- 10. packaging -------------------------------------------------------------------------------------
def test_every_imported_distribution_is_declared() -> None:
    import ast
    import importlib.metadata as md
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ;]", d)[0].lower().replace("_", "-") for d in project["dependencies"]}
    optional = {re.split(r"[<>=\[ ;]", d)[0].lower().replace("_", "-")
                for group in project["optional-dependencies"].values() for d in group}
    dists = md.packages_distributions()
    known_optional = {"pynvml": "nvidia-ml-py"}  # the gpu extra; not installed on CPU machines
    missing = []
    for folder in ("dagfold", "services", "projections"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("dagfold", "services", "projections"):
                        continue
                    if known_optional.get(top) in optional:
                        continue
                    owners = {d.lower().replace("_", "-") for d in dists.get(top, [])}
                    if not owners & declared:
                        missing.append(f"{f.relative_to(ROOT)}: {top}")
    assert not missing, missing
