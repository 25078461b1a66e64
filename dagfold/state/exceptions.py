from dagfold.exceptions import DagfoldError


class StateError(DagfoldError):
    """The state store failed or was used wrongly (e.g. a closed transaction)."""
