"""One trace per demo request: encoder server, Encoder phases, push, receiver, prefill and
decode, seen by an in-memory span exporter, on both backends."""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from encdisagg.pipeline import DecodeStatus, DemoOptions, run_demo

#: Every span a demo request over ZMQ has, at least once, in its one trace.
EXPECTED = {
    "encdisagg.demo.request",
    "encdisagg.prefill",
    "POST /encode",
    "encdisagg.encode",
    "encdisagg.preprocess",
    "encdisagg.queue",
    "encdisagg.forward",
    "encdisagg.stage",
    "encdisagg.transfer",
    "encdisagg.receive",
    "encdisagg.kv_write",
    "encdisagg.decode",
}

#: Where the spans that cross a boundary hang.
PARENTS = {
    # Continued from the push header's traceparent, in another component.
    "encdisagg.receive": "encdisagg.transfer",
    # Continued from the HTTP request's traceparent header.
    "encdisagg.encode": "POST /encode",
    # Recorded from the batcher's timestamps.
    "encdisagg.queue": "encdisagg.encode",
    "encdisagg.forward": "encdisagg.encode",
    "encdisagg.stage": "encdisagg.encode",
    # Captured when decode admitted the request.
    "encdisagg.decode": "encdisagg.demo.request",
}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """A global tracer provider for one test (the API lets a process set it only once, so
    the test swaps the global it reads and monkeypatch puts it back)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", provider)
    yield memory
    provider.shutdown()


def _by_trace(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    traces: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        assert span.context is not None
        traces[span.context.trace_id].append(span)
    return traces


@pytest.mark.anyio
async def test_one_trace_covers_encoder_receiver_prefill_and_decode(
    exporter: InMemorySpanExporter, anyio_backend: str
) -> None:
    report = await run_demo(
        DemoOptions(requests=2, encoders=1, new_tokens=3, max_images=1, verbose=False),
        err=io.StringIO(),
    )
    assert report.ok, report.summary_line()
    assert [o.status for o in report.outcomes] == [DecodeStatus.COMPLETED] * 2
    traces = _by_trace(exporter.get_finished_spans())
    roots = {
        span.attributes["encdisagg.rid"]: trace_id
        for trace_id, spans in traces.items()
        for span in spans
        if span.name == "encdisagg.demo.request" and span.attributes is not None
    }
    assert sorted(roots) == sorted(o.rid for o in report.outcomes)
    for rid, trace_id in roots.items():
        spans = traces[trace_id]
        names = {span.name for span in spans}
        assert names >= EXPECTED, (rid, sorted(EXPECTED - names))
        by_id = {span.context.span_id: span for span in spans if span.context is not None}
        parents = {
            span.name if span.parent is None or span.parent.span_id not in by_id else None
            for span in spans
        }
        # Exactly one root; every other span's parent is in the same trace.
        assert parents - {None} == {"encdisagg.demo.request"}
        for span in spans:
            assert span.parent is not None or span.name == "encdisagg.demo.request"
            if span.name in PARENTS:
                assert span.parent is not None
                assert by_id[span.parent.span_id].name == PARENTS[span.name], span.name
    # Nothing of the demo went untraced: every span is in a request's trace.
    assert set(traces) == set(roots.values())
