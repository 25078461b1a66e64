"""The HTTP API: job submission and cancellation (commands), queries (the read model)."""

from services.api.app import create_app

__all__ = ["create_app"]
