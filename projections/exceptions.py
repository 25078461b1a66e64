"""Errors of the read-model projections."""

from __future__ import annotations

from dagfold.exceptions import DagfoldError


class ProjectionError(DagfoldError):
    """Base of the projection errors."""


class StoreError(ProjectionError):
    """The read-model store could not be opened or written."""


class InvalidCursor(ProjectionError):
    """A pagination cursor is malformed or belongs to another listing."""
