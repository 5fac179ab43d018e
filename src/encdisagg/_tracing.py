"""OpenTelemetry spans along a request's path, and nothing at all when nobody traces.

Tracing is on when the ``opentelemetry-api`` package is installed (the ``otel`` extra) *and*
a real tracer provider was set (``opentelemetry.trace.set_tracer_provider``, or
``opentelemetry-instrument``). Otherwise every entry point here returns ``None`` or a shared
no-op context manager after one check, so the hot path pays nothing else: callers capture a
:class:`Trace` once per request and test it for ``None`` before doing any tracing work.

A request's trace crosses processes as a W3C ``traceparent``: HTTP requests carry it in the
``traceparent`` header (the server continues it; :class:`~encdisagg.receiver.EncoderClient`
sends the caller's), and an embedding push carries it in the header field of the same name,
so the receiver's spans join the trace of the encode that produced the embedding.

The context travels in context variables, which both backends copy into the tasks a task
group starts and AnyIO copies into worker threads. Spans here are only ever opened and closed
on the event loop, around the awaits; a worker thread never needs to know about them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, cast

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

try:
    from opentelemetry import context as otel_context, trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - the otel extra is part of the dev install
    HAVE_OTEL = False
    _INACTIVE: tuple[type, ...] = ()
else:
    HAVE_OTEL = True
    _PROPAGATOR = TraceContextTextMapPropagator()
    # What get_tracer_provider() returns until a real provider is set.
    _INACTIVE = (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)

__all__ = [
    "TRACEPARENT",
    "TRACER_NAME",
    "Trace",
    "current",
    "current_traceparent",
    "from_traceparent",
    "now_ns",
    "outgoing_headers",
    "server_span",
    "set_status",
    "span",
]

#: The W3C header (and embedding header field) that carries a trace across processes.
TRACEPARENT: Final = "traceparent"
#: The instrumentation scope of every span encdisagg makes.
TRACER_NAME: Final = "encdisagg"
#: Longest ``traceparent`` taken from a peer (the W3C form is 55 characters).
MAX_TRACEPARENT_CHARS: Final = 128

_UNKNOWN: Final = object()
#: Whether the SDK may load a provider from the environment on first use.
_PROVIDER_FROM_ENV: Final = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_NO_SPAN: Final[AbstractContextManager[None]] = contextlib.nullcontext()
#: (provider, its tracer): one slot, so a provider set later is picked up.
_cached: tuple[object, Tracer] | None = None


def _tracer() -> Tracer | None:
    """The tracer of the global provider, or ``None`` while no real provider is set."""
    global _cached
    if not HAVE_OTEL:
        return None
    # get_tracer_provider() reads os.environ on every call while no provider is set (about
    # 0.6 us): too much for a check made once per request when nobody traces. The module
    # global it returns is read directly; the public call is made only when the variable
    # it would load a provider from is set, or when the global is gone from a later release.
    raw: object = getattr(otel_trace, "_TRACER_PROVIDER", _UNKNOWN)
    if raw is None and not _PROVIDER_FROM_ENV:
        return None
    provider = otel_trace.get_tracer_provider() if raw is None or raw is _UNKNOWN else raw
    if isinstance(provider, _INACTIVE):
        return None
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = cast("TracerProvider", provider).get_tracer(TRACER_NAME)
    _cached = (provider, tracer)
    return tracer


class Trace:
    """Where the spans of one request hang: a tracer and a parent context.

    Made by :func:`current` or :func:`from_traceparent`, which return ``None`` when nobody
    traces; code holding a ``Trace`` knows tracing is on.
    """

    __slots__ = ("context", "tracer")

    def __init__(self, tracer: Tracer, context: Context) -> None:
        self.tracer = tracer
        self.context = context

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Trace]:
        """A child span, current in this task while the block runs (an exception marks it
        failed and propagates); yields the child's own :class:`Trace`."""
        with self.tracer.start_as_current_span(name, self.context, attributes=attributes):
            yield Trace(self.tracer, otel_context.get_current())

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A child span that already happened, from ``start_ns`` to ``end_ns``
        (:func:`now_ns` clock): for phases timed where no span could be opened (in the
        batcher's task, for a fused batch)."""
        child: Span = self.tracer.start_span(
            name, self.context, attributes=attributes, start_time=start_ns
        )
        child.end(end_time=end_ns)

    @property
    def trace_id(self) -> str | None:
        """This context's trace id as 32 hex digits (``None`` if it has no valid span)."""
        span_context = otel_trace.get_current_span(self.context).get_span_context()
        return format(span_context.trace_id, "032x") if span_context.is_valid else None

    def traceparent(self) -> str | None:
        """This context as a W3C ``traceparent`` value (``None`` if it has no valid span)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, self.context)
        return carrier.get(TRACEPARENT)


def now_ns() -> int:
    """The clock of span timestamps (nanoseconds since the epoch)."""
    return time.time_ns()


def current() -> Trace | None:
    """The calling task's context as a :class:`Trace`; ``None`` when nobody traces."""
    tracer = _tracer()
    if tracer is None:
        return None
    return Trace(tracer, otel_context.get_current())


def from_traceparent(value: object) -> Trace | None:
    """Continue the trace a peer sent; ``None`` when nobody traces.

    A missing or malformed value (the W3C rules decide) starts a new trace instead: a peer
    cannot fail a request through this field.
    """
    tracer = _tracer()
    if tracer is None:
        return None
    carrier: dict[str, str] = {}
    if isinstance(value, str) and len(value) <= MAX_TRACEPARENT_CHARS:
        carrier[TRACEPARENT] = value
    return Trace(tracer, _PROPAGATOR.extract(carrier))


def span(
    trace: Trace | None, name: str, attributes: Mapping[str, Any] | None = None
) -> AbstractContextManager[Trace | None]:
    """``trace.span(name)``, or a shared no-op when ``trace`` is ``None``."""
    if trace is None:
        return _NO_SPAN
    return trace.span(name, attributes)


def current_traceparent() -> str | None:
    """The calling task's context as a ``traceparent`` value (``None`` when nobody traces)."""
    trace = current()
    return None if trace is None else trace.traceparent()


def outgoing_headers() -> dict[str, str]:
    """The ``traceparent`` header for an HTTP call made now (empty when nobody traces)."""
    value = current_traceparent()
    return {} if value is None else {TRACEPARENT: value}


@contextlib.contextmanager
def _server_span(trace: Trace, route: str) -> Iterator[Trace]:
    with trace.tracer.start_as_current_span(
        f"POST {route}",
        trace.context,
        kind=otel_trace.SpanKind.SERVER,
        attributes={"http.request.method": "POST", "http.route": route},
    ):
        yield Trace(trace.tracer, otel_context.get_current())


def server_span(route: str, traceparent: str | None) -> AbstractContextManager[Trace | None]:
    """A SERVER span for one HTTP request, continuing the caller's ``traceparent`` header
    (a new trace without one); current in this task while the block runs, so the Encoder's
    spans become its children. A no-op when nobody traces."""
    trace = from_traceparent(traceparent)
    if trace is None:
        return _NO_SPAN
    return _server_span(trace, route)


def set_status(trace: Trace | None, status: int) -> None:
    """Note an HTTP response status on ``trace``'s span (5xx marks it failed)."""
    if trace is None:
        return
    current_span = otel_trace.get_current_span(trace.context)
    current_span.set_attribute("http.response.status_code", status)
    if status >= 500:
        current_span.set_status(otel_trace.StatusCode.ERROR)
