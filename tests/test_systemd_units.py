"""The systemd units of deploy/systemd: systemd itself accepts them, and they say what docs/operations.md says.

`systemd-analyze verify` loads each unit as systemd would (every key known, every value parsed, ExecStart's
binary executable, drop-ins included) without a running systemd; it only warns about an unknown key or a bad
value, so any line it prints about a unit fails the test. The units name /opt/dagfold/venv/bin/dagfold; the
copies verified here name this checkout's `dagfold` instead (verify needs the binary to exist). Where
`systemd-analyze` is missing the test fails, never skips: `make systemd-tools` (part of `make test`) installs
Debian's systemd package.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "deploy" / "systemd"
INSTALLED = "/opt/dagfold/venv/bin/dagfold"
# unit file -> the instance verified (templates need one) and the subcommand its ExecStart runs
KINDS = {"dagfold-api.service": ("dagfold-api.service", "up"),
         "dagfold-scheduler@.service": ("dagfold-scheduler@0.service", "scheduler"),
         "dagfold-allocator@.service": ("dagfold-allocator@default.service", "allocator"),
         "dagfold-worker@.service": ("dagfold-worker@default.service", "worker"),
         "dagfold-agent.service": ("dagfold-agent.service", "agent"),
         "dagfold-callbacks.service": ("dagfold-callbacks.service", "callbacks")}
DAGFOLD = Path(sys.executable).parent / "dagfold"


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is missing: `make systemd-tools` installs it (Debian package systemd)"
    return found


def service_section(path: Path) -> dict[str, list[str]]:
    """The [Service] keys of a unit file, each with every value it is given (keys repeat in unit files)."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units and the worker's task-user drop-in, as an operator installs them, naming this `dagfold`."""
    assert DAGFOLD.exists(), DAGFOLD
    out = tmp_path_factory.mktemp("units")
    for name in KINDS:
        (out / name).write_text((UNITS / name).read_text().replace(INSTALLED, str(DAGFOLD)))
    dropins = out / "dagfold-worker@.service.d"
    dropins.mkdir()
    shutil.copy(UNITS / "worker-task-user.conf", dropins / "task-user.conf")
    return out


def test_every_process_kind_has_a_unit() -> None:
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(KINDS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_systemd_analyze_verify_accepts_the_unit(staged: Path, name: str) -> None:
    instance = KINDS[name][0]
    r = subprocess.run([systemd_analyze(), "verify", "--man=no", f"./{instance}"], cwd=staged, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if str(staged) in ln or instance in ln
            or name.split("@")[0] in ln]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


def test_a_misspelt_directive_fails_the_check(staged: Path, tmp_path: Path) -> None:
    """The check above can fail: verify's warning about an unknown key is caught."""
    bad = tmp_path / "dagfold-callbacks.service"
    bad.write_text((staged / "dagfold-callbacks.service").read_text().replace("ProtectSystem=", "ProtectSytem="))
    r = subprocess.run([systemd_analyze(), "verify", "--man=no", "./dagfold-callbacks.service"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert "Unknown key 'ProtectSytem'" in r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(KINDS))
def test_restart_policy_follows_the_exit_statuses(name: str) -> None:
    """docs/operations.md: 1 is restarted; 2 (a bad setting or flag), 75 (fenced) and 130 are not."""
    svc = service_section(UNITS / name)
    assert svc["Restart"] == ["on-failure"]
    assert set(svc["RestartPreventExitStatus"][0].split()) == {"2", "75", "130"}
    for key in ("User", "EnvironmentFile", "ReadWritePaths", "LimitNOFILE"):
        assert svc.get(key), f"{name}: no {key}="
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                       ("ProtectHome", "yes")):
        assert svc.get(key) == [value], f"{name}: {key}={svc.get(key)}"
    assert svc["User"] != ["root"]  # root only through the worker's task-user drop-in


@pytest.mark.parametrize("name", sorted(KINDS))
def test_execstart_runs_the_commands_flags(name: str) -> None:
    """Each ExecStart names an existing subcommand and only flags it has (its --help lists them)."""
    argv = shlex.split(service_section(UNITS / name)["ExecStart"][0].replace("%i", "x"))
    assert argv[0] == INSTALLED and argv[1] == KINDS[name][1]
    helptext = subprocess.run([str(DAGFOLD), argv[1], "--help"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "200"}).stdout
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert flag in helptext, f"{name}: dagfold {argv[1]} has no {flag}"


def test_a_bad_setting_exits_with_the_status_the_units_do_not_restart(tmp_path: Path) -> None:
    """Status 2 for a bad setting, as RestartPreventExitStatus= assumes (a restart could not fix it)."""
    r = subprocess.run([str(DAGFOLD), "scheduler", "--data", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "DAGFOLD_PARTITIONS": "zero"})
    assert r.returncode == 2, r.stderr


def test_the_task_user_dropin_grants_only_what_switching_users_needs() -> None:
    parser = configparser.ConfigParser(strict=False)
    parser.read(UNITS / "worker-task-user.conf")
    assert parser["Service"]["User"] == "root"
    assert set(parser["Service"]["CapabilityBoundingSet"].split()) == {
        "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_KILL"}
