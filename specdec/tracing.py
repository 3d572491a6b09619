"""OpenTelemetry traces, off unless `--otlp-endpoint` names an OTLP/gRPC collector: one
trace per request across orchestrator -> drafter -> verifier, its context carried in
gRPC metadata (W3C `traceparent`). The orchestrator's `Generate` span has a child per
round (attributes: K, drafts, accepted), whose `Propose` and `Verify` calls are the
parents of the drafter's and verifier's own spans."""

import contextlib
import logging

from opentelemetry import context as otel_context, propagate, trace

log = logging.getLogger(__name__)

tracer = trace.get_tracer("specdec")


def setup(service: str, endpoint: str) -> None:
    """Exports this process's spans to the collector at `endpoint` (host:port); with no
    endpoint the tracer stays OpenTelemetry's no-op one and costs nothing."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"specdec-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    log.info("traces go to %s", endpoint)


def headers() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata, for a call downstream."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def incoming(context) -> otel_context.Context:
    """The trace context a caller sent in the call's metadata (an empty one if none)."""
    metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    return propagate.extract(metadata)


@contextlib.contextmanager
def server_span(name: str, context, **attributes):
    """A span for a handler, the child of the caller's span. It is not made the current
    span: a streaming handler yields inside it, and one its caller cancels may be closed
    from another context, where undoing "current" fails (the handlers call nothing
    downstream that would need it)."""
    span = tracer.start_span(name, context=incoming(context), kind=trace.SpanKind.SERVER, attributes=attributes)
    try:
        yield span
    except Exception as err:
        span.record_exception(err)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(err).__name__}: {err}"))
        raise
    finally:
        span.end()
