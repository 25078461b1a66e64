"""Errors shared by the plumbing packages."""


class DagfoldError(Exception):
    """Base of every dagfold error."""


class CodecError(DagfoldError):
    """A record could not be encoded or decoded; the message says why."""


class LogError(DagfoldError):
    """A log backend operation failed."""


class FencedError(LogError):
    """This writer was fenced by a newer instance (zombie); it must stop writing."""
