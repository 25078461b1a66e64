"""Processes the harness starts, kills and restarts (each in its own process group)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """One long-running process: ``start``, ``kill9``, ``terminate``; output appended to ``log_path``.

    ``down_on_purpose`` is set while the harness keeps it down (killed, restart pending),
    so a supervisor can tell an injected death from a crash.
    """

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path,
                 cwd: Path = ROOT) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.down_on_purpose = False
        self.stopped = False  # SIGSTOP'd by the harness (a zombie to be)
        self.expect_exit_until = 0.0  # a resumed zombie may exit (fenced) until then
        self.starts = 0
        self.lock = threading.RLock()
        self._log: IO[bytes] | None = None

    def start(self) -> Proc:
        with self.lock:
            if self.alive():
                return self
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            if self._log is not None:
                self._log.close()
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
            self._log.write(f"\n=== {time.strftime('%H:%M:%S')} start #{self.starts + 1}: "
                            f"{' '.join(self.argv)}\n".encode())
            self._log.flush()
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            self.starts += 1
            self.down_on_purpose = False
            self.stopped = False
            return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def sigstop(self) -> int | None:
        """SIGSTOP the process group; its pid (for the matching ``sigcont``), None if it was not alive."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGSTOP)
            self.stopped = True
            return self.proc.pid

    def sigcont(self, pid: int) -> None:
        """SIGCONT the group of ``pid`` if it is still this process (not killed and restarted since)."""
        with self.lock:
            if self.proc is not None and self.proc.pid == pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGCONT)
            self.stopped = False

    def kill9(self) -> bool:
        """SIGKILL the process group; True if it was alive."""
        with self.lock:
            self.down_on_purpose = True
            if self.proc is None or self.proc.poll() is not None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            self.stopped = False
            return True

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; the exit code."""
        with self.lock:
            self.down_on_purpose = True
            if self.proc is None:
                return None
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    if self.stopped:
                        os.killpg(self.proc.pid, signal.SIGCONT)
                        self.stopped = False
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(30)
            return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:])

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def terminate_all(procs: Sequence[Proc], timeout_s: float = 30.0) -> None:
    """``terminate`` every process side by side: SIGTERM to all, then each waits (at most ``timeout_s``) in
    its own thread, so that stopping a dozen processes takes the slowest one's time, not the sum."""
    threads = [threading.Thread(target=p.terminate, args=(timeout_s,), name=f"terminate-{p.name}", daemon=True)
               for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 40)  # terminate's own bound: timeout_s, then SIGKILL and 30 s
