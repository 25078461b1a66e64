"""Errors of the node agent."""

from __future__ import annotations


class AgentError(Exception):
    """Base class of node agent errors."""


class NvmlUnavailable(AgentError):
    """NVML (nvidia-ml-py) is not installed or finds no GPU: use the simulated device model."""
