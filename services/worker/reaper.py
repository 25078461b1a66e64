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
* on SIGUSR1 (``KILL_SIGNAL``; ``ReapedPopen.kill``) it kills the whole task at once and exits;
* when its parent dies, even by ``kill -9``, it gets SIGHUP (``prctl(PR_SET_PDEATHSIG)``) and kills
  the whole task too: a dead worker leaves no task running. (The signal comes when the *thread* that
  started the reaper ends: a worker starts it from the thread that waits for the task, an agent from
  its loop's thread.)

Why this mechanism: it needs no privilege and no cgroup delegation (it works for a worker running as
root with ``--task-user``, and for one running as an ordinary user), and it covers the processes
that leave the process group, which a ``killpg`` alone misses, and the worker's own death, which
``PR_SET_PDEATHSIG`` on the command alone misses (it covers only the direct child). A cgroup v2
per task would also contain a task running as the service's own user (which could kill its
reaper); that case is why running tasks as root without a task user is refused (docs/security.md).
The reaper runs as the service's user, so a task running as another user cannot signal it.

Run as a script (``python -I -S reaper.py PARENT_PID UID GID UMASK -- ARGV...``, ``-`` for no user
switch; ``TaskRuntime.spawn`` starts it): it imports a few standard modules only, so that it starts fast
and trusts no search path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence

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


def _exec(command: list[str], uid: str, gid: str, umask: str) -> None:
    """In the forked child: its own process group, the task user, default signals, then the command."""
    try:
        os.setpgid(0, 0)
        for s in (signal.SIGHUP, KILL_SIGNAL, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)  # SIGPIPE: Python ignores it, and an ignored signal survives exec
        if uid != "-":
            os.setgroups([])
            os.setgid(int(gid))
            os.setuid(int(uid))
        os.umask(int(umask, 8))
        os.execvp(command[0], command)
    except OSError as exc:
        os.write(2, f"cannot start {command[0]}: {exc}\n".encode())
    os._exit(127)


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
    pid = os.fork()  # (no subprocess module: its import is most of a reaper's start-up time)
    if pid == 0:
        _exec(command, uid, gid, umask)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # here too, so that a SIGTERM forwarded at once finds the group
    child.append(pid)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:  # cannot happen while the command runs; be safe
            return STATUS_KILLED
        if done == child[0]:
            break
    kill_all()  # what the command left behind, setsid or not
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        for s in (signal.SIGHUP, KILL_SIGNAL, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
