"""Chaos harness: dagfold on a 3-broker Kafka cluster while processes die.

Everything runs as real processes on loopback (``harness.py``): a 3-broker KRaft
cluster started by ``deploy/kafka/kafka.sh`` (``cluster.py``), one
``dagfold up --no-scheduler`` for the API and projector, three
``dagfold scheduler`` instances, worker processes running the side-effecting
handler of ``handlers.py``, and a report duplicator (``duplicator.py``). A
seeded fault injector (``faults.py``) kill -9's schedulers (restarting them on
their data folder or on an empty one), workers and one broker at a time, while
a mixed workload (``workload.py``: generated DAGs and WfCommons workflows) runs.
At the end ``checks.py`` inspects the log, the stores and the side-effect
records, and the run exits non-zero on any violation.

    python -m chaos --seed 7 --faults 1000      # the long run (make chaos)
    python -m chaos --profile short              # what tests/test_chaos.py runs
"""
