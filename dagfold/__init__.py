"""dagfold: an event-sourced scheduler for DAG and GPU jobs.

This package holds the shared plumbing (codec, log backends, state store,
config, CLI). The writers live in ``services/`` and the read models in
``projections/``.
"""

__version__ = "0.1.0"
