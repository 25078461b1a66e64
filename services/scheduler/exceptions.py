from dagfold.exceptions import DagfoldError


class SchedulerError(DagfoldError):
    """Base of scheduler errors."""


class UnknownCommandError(SchedulerError):
    """A decodable record on the commands topic that the scheduler does not process."""


class InvalidSettingsError(SchedulerError):
    """A settings command (SetTenantEntitlements) whose content is invalid: dead-lettered with the reason."""
