"""The HTTP API: job submission and cancellation (commands), queries (the read model)."""

from dagfold.services.api.app import create_app

__all__ = ["create_app"]
