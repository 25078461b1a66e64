"""The scheduler: a single-writer deterministic fold per commands partition."""
