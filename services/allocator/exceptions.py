"""Errors raised by the allocator; all derive from AllocatorError."""

from __future__ import annotations


class AllocatorError(Exception):
    """Base class of allocator errors."""


class UnknownCommandError(AllocatorError):
    """A record on allocator.commands that is not an allocator command (dead-letter it)."""


class InvalidCommandError(AllocatorError):
    """A command whose fields are inconsistent beyond what the schema checks."""


class TraceError(AllocatorError):
    """A trace file for the simulator is missing or malformed."""
