"""Spans from the events: the span exporter (see ``exporter``; the span model is ``dagfold.tracing``)."""

from dagfold.services.tracing.exporter import GROUP, SpanExporter, job_spans

__all__ = ["GROUP", "SpanExporter", "job_spans"]
