from dagfold.exceptions import DagfoldError


class SchedulerError(DagfoldError):
    """Base of scheduler errors."""


class UnknownCommandError(SchedulerError):
    """A decodable record on the commands topic that the scheduler does not process."""
