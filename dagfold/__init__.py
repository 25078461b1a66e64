"""dagfold: an event-sourced scheduler for DAG and GPU jobs.

This package holds the shared plumbing (codec, log backends, state store, config, processor) and,
on top, the CLI (``dagfold.cli``) and the SDK (``dagfold.client``). The writers and the API
(``dagfold.services``) and the read models (``dagfold.projections``) keep their folders at the
project's root, ``services/`` and ``projections/``; the build maps them into this namespace
(``package-dir`` in pyproject.toml), so an installed dagfold has one top-level name. In a source
checkout the links ``dagfold/services`` and ``dagfold/projections`` (to those folders) give the same
names to Python, mypy and pytest.
"""

__version__ = "0.1.0"
