"""Errors shared by the plumbing packages."""


class DagfoldError(Exception):
    """Base of every dagfold error."""


class CodecError(DagfoldError):
    """A record could not be encoded or decoded; the message says why."""


class LogError(DagfoldError):
    """A log backend operation failed."""


class FencedError(LogError):
    """This writer was fenced by a newer instance (zombie); it must stop writing."""


class TransactionAbortedError(LogError):
    """A log transaction failed and is known to have committed nothing (it was aborted)."""


class CommitUnknownError(LogError):
    """A log transaction's commit failed with an outcome the backend cannot tell.

    ``committed`` is True when the backend knows the transaction committed but not
    where its records landed (Kafka: the commit succeeded, delivery reports are
    missing); None when it may or may not have committed (a commit that timed out or
    ran out of retries). Either way the writer must reconcile from the log.
    """

    def __init__(self, message: str, committed: bool | None = None) -> None:
        super().__init__(message)
        self.committed = committed


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk is full (ENOSPC).

    RocksDB reports it as a plain ``Exception`` whose message holds the OS error text, so the text is
    matched as well as ``OSError.errno``.
    """
    import errno

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc) or "os error 28" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
