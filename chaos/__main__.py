"""``python -m chaos``: one chaos run; prints the report; exit 1 on any violation.

    python -m chaos --profile long --seed 20251130      # make chaos
    python -m chaos --profile short                      # the run of tests/test_chaos.py
    python -m chaos --profile failover                   # 3 schedulers, 3 brokers: kill one of each mid-run
    python -m chaos --profile commit-faults              # commit faults and SIGSTOP'd zombies alone (< 5 min)
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from dataclasses import replace
from pathlib import Path

from chaos.harness import PROFILES, ChaosRun
from chaos.report import format_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="long")
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp folder, "
                                                               "removed after a run without violations)")
    ap.add_argument("--min-faults", type=int, default=None, help="override the profile's minimum")
    ap.add_argument("--inject-s", type=float, default=None, help="override the profile's injection time")
    ap.add_argument("--max-inject-s", type=float, default=None,
                    help="override the profile's limit on injection time (it injects past --inject-s until "
                         "--min-faults, up to this)")
    ap.add_argument("--jobs", type=int, default=None, help="override the number of generated jobs")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 2**31)
    prof = PROFILES[a.profile]
    if a.min_faults is not None:
        prof = replace(prof, min_faults=a.min_faults)
    if a.inject_s is not None:
        prof = replace(prof, inject_s=a.inject_s, max_inject_s=max(prof.max_inject_s, a.inject_s))
    if a.max_inject_s is not None:
        prof = replace(prof, max_inject_s=max(a.max_inject_s, prof.inject_s))
    if a.jobs is not None:
        prof = replace(prof, generated_jobs=a.jobs)
    print(f"chaos: seed {seed} (reproduce with --seed {seed})", flush=True)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the run stops its processes and the cluster on the way out

    signal.signal(signal.SIGTERM, interrupted)
    report = ChaosRun(prof, seed, a.workdir).run()
    print(format_report(report), flush=True)
    print(f"report: {report['folder']}/report.json" if a.workdir else "", flush=True)
    return 1 if report["violations total"] else 0


if __name__ == "__main__":
    sys.exit(main())
