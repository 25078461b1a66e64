from dagfold.exceptions import DagfoldError


class ProcessorError(DagfoldError):
    """The partition processor was used wrongly (e.g. a transaction driven out of order)."""
