"""The reaper: one small parent per task process, so that every process of a task ends with it.

A task (a ``shell`` command on a CPU worker, a job process on a GPU agent) runs as the child of its
own reaper, started by ``spawn``::

    worker or agent ──> reaper (the service's user; its own session)
                          └── the command (the task user; its own process group) ──> whatever it starts

The reaper is a *child sub-reaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process of the task that
leaves its group or session (``setsid``, a double fork) is re-parented to the reaper, never to
init, so the reaper always finds every one of them (its descendants, read from ``/proc``). It
ends the task whole:

* when the command exits, it kills (SIGKILL) every process the command left behind, reaps them,
  and exits with the command's status (a command killed by a signal: the reaper kills itself with
  that signal). So once the worker or agent sees the reaper exit, no process of the task is left
  to rewrite or swap its outputs;
* on SIGTERM or SIGINT it hands the signal to the command's process group (a job checkpoints);
* on SIGUSR1 (``kill``) it kills the whole task at once and exits;
* when its parent dies, even by ``kill -9``, it gets SIGHUP (``prctl(PR_SET_PDEATHSIG)``) and kills
  the whole task too: a dead worker leaves no task running.

Why this mechanism: it needs no privilege and no cgroup delegation (it works for a worker running as
root with ``--task-user``, and for one running as an ordinary user), and it covers the processes
that leave the process group, which a ``killpg`` alone misses, and the worker's own death, which
``PR_SET_PDEATHSIG`` on the command alone misses (it covers only the direct child). A cgroup v2
per task would also contain a task running as the service's own user (which could kill its
reaper); that case is why running tasks as root without a task user is refused (docs/security.md).
The reaper runs as the service's user, so a task running as another user cannot signal it.

Run as a script (``python -I -S reaper.py PARENT_PID UID GID UMASK -- ARGV...``, ``-`` for no user
switch): it imports the standard library only, so that it starts fast and trusts no search path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_SIGNAL = signal.SIGUSR1  # to the reaper: kill the task now (a SIGKILL would leave its processes behind)
STATUS_KILLED = 128 + signal.SIGKILL


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _descendants(me: int) -> list[int]:
    """Every process below ``me`` (children first level by level), from ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold anything
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], list(children.get(me, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, ())
    return found


def kill_all() -> None:
    """SIGKILL every descendant until none is left (the sub-reaper inherits the orphans, and reaps them)."""
    me = os.getpid()
    while True:
        for pid in _descendants(me):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main(argv: Sequence[str]) -> int:
    parent, uid, gid, umask = int(argv[0]), argv[1], argv[2], argv[3]
    command = list(argv[5:])  # argv[4] is "--"
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    child: list[int] = []

    def end_all(signum: int, frame: object) -> None:
        kill_all()
        os._exit(STATUS_KILLED)

    def forward(signum: int, frame: object) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child[0], signum)

    signal.signal(signal.SIGHUP, end_all)
    signal.signal(KILL_SIGNAL, end_all)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if os.getppid() != parent:  # the parent died before PR_SET_PDEATHSIG took hold
        return STATUS_KILLED
    identity: dict[str, Any] = {}
    if uid != "-":
        identity = {"user": int(uid), "group": int(gid), "extra_groups": [], "umask": int(umask, 8)}
    try:
        proc = subprocess.Popen(command, process_group=0, close_fds=True, **identity)
    except OSError as exc:
        print(f"cannot start {command[0]}: {exc}", file=sys.stderr)
        return 127
    child.append(proc.pid)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # cannot happen while the command runs; be safe
            return STATUS_KILLED
        if pid == proc.pid:
            break
    kill_all()  # what the command left behind, setsid or not
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        for s in (signal.SIGHUP, KILL_SIGNAL, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status)


class ReapedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """The Popen of a reaper: ``kill`` ends every process of the task (a SIGKILL would end the reaper
    alone and leave the task's processes to init); ``terminate``/``send_signal(SIGTERM)`` reach the
    command's process group; ``wait`` returns once they are all gone, with the command's status."""

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.send_signal(KILL_SIGNAL)


def spawn(argv: Sequence[str], *, env: dict[str, str], cwd: str | None, user: tuple[int, int] | None,
          stdout: int | IO[Any] | None, stderr: int | IO[Any] | None, text: bool = False,
          bufsize: int = -1) -> ReapedPopen:
    """Start ``argv`` under its own reaper (module docstring), in a new session.

    ``user``: (uid, gid) the command runs as (no supplementary groups, umask 077).
    """
    uid, gid = (str(user[0]), str(user[1])) if user is not None else ("-", "-")
    # the stdlib only, no site packages, no PYTHON* variables: the task's environment cannot steer it
    argv0 = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), uid, gid, "077", "--"]
    return ReapedPopen([*argv0, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                       text=text, bufsize=bufsize, start_new_session=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
