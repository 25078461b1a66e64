"""Task processes inside a deployment (issue 24): what a task leaves behind, what it inherits, and the
folders it is given, on CPU workers and GPU agents alike.

* Outputs are read through one open file each: a file swapped for a symlink to a secret between the
  listing and the read is never followed, and the sha256 reported is that of the bytes stored even when
  the file is rewritten while it is read (the reads a leftover process of the task would race).
* Every process a task starts ends with it: a ``setsid`` leftover is gone before the outputs are read
  (recipe 1 of the issue, on the real stack), and a worker killed with ``kill -9`` leaves no shell task
  running (``dagfold up`` killed as an operator or the OOM killer would).
* A GPU job gets the shell tasks' allow-listed environment, not the agent's (no
  ``AWS_SECRET_ACCESS_KEY``, no ``DAGFOLD_CALLBACK_SECRET``), and the task user.
* Task processes as root without a task user are refused at start, in one line.
* Relative folders, as users give them: a GPU job's checkpoint is stored when the agent's work folder
  is relative (``make run``'s default) and a job preempted to another host resumes from it; a shell
  task's HOME is absolute with a relative ``--task-dir``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dagfold.artifacts import HashingReader, LocalArtifactStore, output_prefix
from dagfold.commands import submit_job
from dagfold.config import Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.services.agent.launcher import JobProcess, Launcher
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.handlers import HandlerRegistry, TaskContext, TaskRuntime, shell
from tests.cli_support import DAGFOLD, ROOT, UpProcess

ROOT_USER = os.geteuid() == 0
TASK_USER = "nobody" if ROOT_USER else None  # what a root deployment must give (the refusal below)
DEMO_JOB = [sys.executable, "-m", "dagfold.services.agent.demo_job"]


def _secret(tmp: Path) -> Path:
    """A 0600 file of the service's user: the auth file or the callback secret of the issue's recipe."""
    f = tmp / "auth.yaml"
    f.write_text("keys: {admin-key-0123456789: admin}\n")
    f.chmod(0o600)
    return f


def _gone(pid: int) -> bool:
    """No such process (or only its zombie, waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _SwappingStore(LocalArtifactStore):
    """A real local store; while it stores ``a.bin``, ``during`` runs: what a leftover process of the task
    does at the worst moment for the reader (the issue's recipes, without their timing)."""

    def __init__(self, root: Path, during: Any) -> None:
        super().__init__(root)
        self.during = during

    def _hook(self, key: str) -> None:
        if key.endswith("/a.bin"):
            self.during()

    def put_file(self, key: str, path: Path, content_type: str) -> None:
        self._hook(key)
        super().put_file(key, path, content_type)

    def put_stream(self, key: str, reader: HashingReader, content_type: str) -> None:
        self._hook(key)
        super().put_stream(key, reader, content_type)


def test_an_output_swapped_for_a_symlink_to_a_secret_while_another_is_stored_is_never_followed(
        tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.bin").write_bytes(b"\0" * 100_000)
    (out / "z.txt").write_text("x\n")

    def swap() -> None:
        (out / "z.txt").unlink()
        (out / "z.txt").symlink_to(secret)

    store = _SwappingStore(tmp_path / "store", swap)
    arts = store.upload_outputs(out, "t/j/a/1/outputs/")
    stored = {a.name: b"".join(store.iter_bytes(store.key_of(a.uri) or "")) for a in arts}
    assert secret.read_bytes() not in stored.values(), stored.keys()
    assert sorted(stored) == ["a.bin"]  # z.txt was a symlink when it was opened: skipped


def test_the_reported_sha256_is_that_of_the_stored_bytes_when_the_file_changes_meanwhile(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.bin").write_bytes(b"A" * 3_000_000)

    def rewrite() -> None:  # `dd conv=notrunc` by a leftover process: same size, other bytes
        with open(out / "a.bin", "r+b") as f:
            f.write(b"B" * 1_000_000)

    store = _SwappingStore(tmp_path / "store", rewrite)
    [art] = store.upload_outputs(out, "t/j/a/1/outputs/")
    stored = b"".join(store.iter_bytes(store.key_of(art.uri) or ""))
    assert (art.size, art.sha256) == (len(stored), hashlib.sha256(stored).hexdigest())


def test_a_hard_link_to_a_file_of_another_user_is_not_an_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    me = os.geteuid()
    arts = LocalArtifactStore(tmp_path / "store").upload_outputs(out, "t/j/a/1/outputs/", owner=me + 1)
    assert arts == []  # with tasks running as another user, only that user's files are theirs
    arts = LocalArtifactStore(tmp_path / "store").upload_outputs(out, "t/j/a/1/outputs/", owner=me)
    assert [a.name for a in arts] == ["mine.txt"]


def _shell_stack(tmp: Path) -> Stack:
    cfg = Config(data_dir=tmp / "data", partitions=2, dispatch_partitions=2)
    runtime = TaskRuntime(user=TASK_USER, allow_root=True)
    return Stack(cfg, StackOptions(workers=1, api=False, callbacks=False,
                                   registry=HandlerRegistry.with_builtins(shell=True), runtime=runtime))


def test_a_setsid_leftover_of_a_shell_task_is_gone_before_its_outputs_are_read(tmp_path: Path) -> None:
    """Recipe 1 of the issue (with a 20 MB file, and the leftover's PID kept as an output)."""
    secret = _secret(tmp_path)
    cmd = ('cd "$DAGFOLD_OUTPUT_DIR"; head -c 20M /dev/zero >a.bin; echo x>z.txt; '
           f"setsid sh -c 'echo $$ >\"$0/pid.tmp\"; mv \"$0/pid.tmp\" \"$0/pid.txt\"; sleep 0.5; "
           f"rm \"$0/z.txt\"; ln -s {secret} \"$0/z.txt\"; sleep 30' \"$PWD\" </dev/null >/dev/null 2>&1 & "
           "while [ ! -f pid.txt ]; do sleep 0.01; done; exit 0")
    spec = to_job_spec(parse_spec({"id": "leftover", "tasks": [{"id": "t", "handler": "shell",
                                                                  "args": {"cmd": cmd}}]}))
    with _shell_stack(tmp_path) as stack:
        stack.sender.send(submit_job(spec, source="test"))
        job = stack.wait_job("leftover", timeout_s=60)
        assert job is not None and job["state"] == "succeeded", job
        prefix = output_prefix("default", "leftover", "t", 1)
        stored = {k[len(prefix):]: b"".join(stack.artifacts.iter_bytes(k)) for k in stack.artifacts.list(prefix)}
    assert sorted(stored) == ["a.bin", "pid.txt", "z.txt"]
    assert stored["z.txt"] == b"x\n"
    pid = int(stored["pid.txt"])
    assert _gone(pid), f"the task's setsid process {pid} outlived the task"


def test_a_gpu_job_gets_the_allow_listed_environment_and_the_task_user(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-5up3r")
    monkeypatch.setenv("DAGFOLD_CALLBACK_SECRET", "callback-secret-5up3r")
    launcher = Launcher(["/bin/sh", "-c", "env; echo uid=$(id -u)"], LocalArtifactStore(tmp_path / "store"),
                        tmp_path / "work", runtime=TaskRuntime(user=TASK_USER, allow_root=True))
    try:
        jp = launcher.start("a1", 1, "job", "run", 1, [0, 1], None, args_json='{"steps": 1}')
        assert jp.proc.wait(30) == 0
        launcher.finish(jp)
    finally:
        launcher.close()
    env = dict(line.split("=", 1) for line in jp.lines if "=" in line)
    assert "AWS_SECRET_ACCESS_KEY" not in env and "DAGFOLD_CALLBACK_SECRET" not in env
    assert not [v for v in env.values() if "5up3r" in v]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["DAGFOLD_ARGS_JSON"] == '{"steps": 1}'
    assert Path(env["DAGFOLD_CHECKPOINT_DIR"]).is_absolute() and Path(env["HOME"]).is_absolute()
    # what sh itself sets (PWD, SHLVL, OLDPWD, _) and the allow list: nothing else of the agent's
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR", "PWD", "SHLVL", "OLDPWD", "_", "uid",
                        "TRACEPARENT"} | {
        k for k in env if k.startswith("DAGFOLD_") or k == "CUDA_VISIBLE_DEVICES"}, sorted(env)
    if TASK_USER is not None:
        assert env["uid"] == str(pwd.getpwnam(TASK_USER).pw_uid)


def _run_demo(launcher: Launcher, steps: int, resume: str | None, stop_after: float | None = None) -> JobProcess:
    jp = launcher.start("a1" if resume is None else "a2", 1, "job", "run", 1 if resume is None else 2, [0],
                        resume, args_json=json.dumps({"steps": steps, "step_s": 0.02}))
    if stop_after is not None:
        _wait_for(lambda: jp.checkpoint_uri is not None, 30, "a stored checkpoint")
        launcher.stop(jp, "preempted", time.monotonic() + 10)
    assert jp.proc.wait(30) == 0
    launcher.finish(jp)
    return jp


def test_a_relative_work_folder_stores_checkpoints_and_a_preempted_job_resumes_on_another_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recipe 10: `make run`'s relative data folder; the job prints the checkpoint path it was given."""
    monkeypatch.chdir(tmp_path)
    store = LocalArtifactStore(Path("data/artifacts"))
    runtime = TaskRuntime(allow_root=True)  # the demo job's Python (under /root here) is the service user's
    first = Launcher(DEMO_JOB, store, Path("data/agent-work/node-0"), runtime=runtime)
    other = Launcher(DEMO_JOB, store, Path("data/agent-work/node-1"), runtime=runtime)
    try:
        jp = _run_demo(first, 40, None, stop_after=0)
        assert jp.checkpoint_uri is not None, jp.lines  # before: "checkpoint ... ignored"
        again = _run_demo(other, 40, jp.checkpoint_uri)
    finally:
        first.close()
        other.close()
    assert again.results[-1]["resumed_from"] >= 5, again.results  # not step 0


def test_a_checkpoint_folder_swapped_for_a_symlink_is_not_written_through_on_resume(tmp_path: Path) -> None:
    """An attempt stores a checkpoint folder, then leaves a symlink to another folder in its place; the
    next attempt on the same host resumes from the stored copy, and the agent writes nothing there."""
    victim, store = tmp_path / "victim", LocalArtifactStore(tmp_path / "store")
    victim.mkdir()
    stored = tmp_path / "store/default/job/run/checkpoints/ck/model.bin"
    first = ('d="$DAGFOLD_CHECKPOINT_DIR/ck"; mkdir -p "$d"; echo weights >"$d/model.bin"; '
             f'echo "{{\\"checkpoint\\": \\"$d\\"}}"; while [ ! -e {stored} ]; do sleep 0.01; done; '
             f'rm -r "$d"; ln -s {victim} "$d"')
    launcher = Launcher(["/bin/sh", "-c", first], store, tmp_path / "work", runtime=TaskRuntime(allow_root=True))
    try:
        jp = launcher.start("a1", 1, "job", "run", 1, [0], None)
        assert jp.proc.wait(30) == 0
        launcher.finish(jp)
        assert jp.checkpoint_uri is not None and (jp.checkpoint_dir / "ck").is_symlink(), jp.lines
        launcher.command = ["/bin/sh", "-c", 'cat "$DAGFOLD_RESUME_CHECKPOINT/model.bin"']
        again = launcher.start("a2", 1, "job", "run", 2, [0], jp.checkpoint_uri)
        assert again.proc.wait(30) == 0
        launcher.finish(again)
    finally:
        launcher.close()
    assert again.lines == ["weights"]
    assert list(victim.iterdir()) == []


def test_a_checkpoint_folder_left_as_a_symlink_is_replaced_not_handed_over(tmp_path: Path) -> None:
    """The task's folder on a host outlives an attempt: a symlink the attempt left for its checkpoint
    folder is neither followed nor given to the task user by the next attempt's start."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    work = Path(tempfile.mkdtemp(prefix="dagfold-agent-work-"))  # where the task user reaches (tmp_path: 0700)
    work.chmod(0o711)
    launcher = Launcher(["/bin/sh", "-c", 'echo w >"$DAGFOLD_CHECKPOINT_DIR/step-1.json"'],
                        LocalArtifactStore(tmp_path / "store"), work,
                        runtime=TaskRuntime(user=TASK_USER, allow_root=True))
    ckdir = launcher.task_dir("job", "run") / "checkpoints"
    ckdir.symlink_to(victim)
    try:
        jp = launcher.start("a1", 1, "job", "run", 1, [0], None)
        assert jp.proc.wait(30) == 0, jp.lines
        launcher.finish(jp)
        assert not ckdir.is_symlink() and (ckdir / "step-1.json").read_text() == "w\n"
    finally:
        launcher.close()
        shutil.rmtree(work, ignore_errors=True)
    assert jp.lines == [] and list(victim.iterdir()) == [] and victim.stat().st_uid == os.geteuid()


def test_a_relative_task_folder_gives_shell_tasks_an_absolute_home(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("work").mkdir()
    ctx = TaskContext("j", "t", 1, "k", args={"cmd": 'cd /; test -d "$HOME" && echo "$HOME"'},
                      runtime=TaskRuntime(work_root=Path("work"), allow_root=True))
    shell(ctx)
    home = Path(ctx.stdout_tail.strip())
    assert home.is_absolute() and home.parent == tmp_path / "work"


def test_a_worker_killed_with_kill_9_leaves_no_shell_task_running(tmp_path: Path) -> None:
    """Recipe 9: `dagfold up` killed with SIGKILL while a shell task runs (and its setsid child)."""
    pids = Path(tempfile.mkdtemp(prefix="dagfold-pids-"))  # where the task user reaches (tmp_path is 0700)
    pids.chmod(0o777)
    cmd = (f"setsid sh -c 'echo $$ >{pids}/setsid.tmp; mv {pids}/setsid.tmp {pids}/setsid; sleep 60' "
           f"</dev/null >/dev/null 2>&1 & echo $$ >{pids}/sh.tmp; mv {pids}/sh.tmp {pids}/sh; sleep 60")
    args: tuple[str, ...] = ("--handlers", "noop,shell")
    if TASK_USER is not None:
        args += ("--task-user", TASK_USER)
    up = UpProcess(tmp_path / "data", workers=1, args=args).start()
    try:
        up.submit({"id": "long", "tasks": [{"id": "t", "handler": "shell", "args": {"cmd": cmd}}]})
        _wait_for(lambda: (pids / "sh").exists() and (pids / "setsid").exists(), 60, "the task's processes")
        started = [int((pids / n).read_text()) for n in ("sh", "setsid")]
        up.kill9()
    finally:
        up.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in started):
        time.sleep(0.1)
    alive = [p for p in started if not _gone(p)]
    for p in alive:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    shutil.rmtree(pids, ignore_errors=True)
    assert not alive, f"processes of the task outlived their worker: {alive}"


@pytest.mark.skipif(not ROOT_USER, reason="the refusal is about running tasks as root")
@pytest.mark.parametrize("command", [
    ["worker", "--handlers", "noop,shell"],
    ["up", "--handlers", "noop,shell"],
    ["up", "--gpu-nodes", "1"],
    ["agent", "--simulate", "--log", "kafka://127.0.0.1:1"],
])
def test_task_processes_as_root_without_a_task_user_are_refused_at_start(tmp_path: Path,
                                                                         command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGFOLD_ALLOW_ROOT_TASKS", "DAGFOLD_TASK_USER")}
    r = subprocess.run([*DAGFOLD, *command, "--data", str(tmp_path / "d")] if command[0] != "agent"
                       else [*DAGFOLD, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert "--task-user" in r.stderr and "--allow-root-tasks" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()  # nothing started
