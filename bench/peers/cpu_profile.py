"""Run a module under cProfile timed by CPU, not wall clock: ``python -m bench.peers.cpu_profile OUT -m MOD ARGS``.

``python -m cProfile`` times calls by the wall clock, which on a loaded machine charges every
function for the time other processes ran. Here the timer is ``time.process_time`` (this
process's CPU), so the profile says where the process's CPU went. The profile is written when
the module returns (a service stops on SIGTERM and returns).
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: python -m bench.peers.cpu_profile OUT -m MODULE [ARGS...]")
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    prof = cProfile.Profile(time.process_time)
    try:
        prof.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
