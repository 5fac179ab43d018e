"""Tracing: nothing at all without a tracer provider; with one, a W3C traceparent from a peer
(HTTP header or push header field) is continued, and a malformed one only starts a new trace."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from encdisagg import BadRequestError, _tracing
from encdisagg.transfer import EmbeddingHeader, decode_header, encode_header

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", provider)
    yield memory
    provider.shutdown()


def header(**changes: object) -> EmbeddingHeader:
    fields: dict[str, object] = {
        "req_id": "r#0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "image",
        "shape": (2, 4),
        "dtype": "float16",
        "token_counts": (2,),
        "grid": ((1, 2, 4),),
    }
    fields.update(changes)
    return EmbeddingHeader(**fields)  # type: ignore[arg-type]


def hex_ids(span: ReadableSpan) -> tuple[str, str | None]:
    """A finished span's trace id and its parent's span id, in their W3C hex forms."""
    assert span.context is not None
    parent = None if span.parent is None else f"{span.parent.span_id:016x}"
    return f"{span.context.trace_id:032x}", parent


def own_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def test_without_a_provider_nothing_is_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", None)
    assert _tracing.current() is None
    assert _tracing.from_traceparent(PARENT) is None
    assert _tracing.outgoing_headers() == {}
    with _tracing.span(None, "x") as nothing, _tracing.server_span("/encode", PARENT) as none:
        assert nothing is None
        assert none is None


def test_a_server_span_continues_the_callers_traceparent(
    exporter: InMemorySpanExporter,
) -> None:
    with _tracing.server_span("/encode", PARENT) as server:
        assert server is not None
        # What the app's code sees as current, and what it sends on.
        inner = _tracing.current()
        assert inner is not None
        with inner.span("child"):
            assert _tracing.outgoing_headers()[_tracing.TRACEPARENT].startswith(f"00-{TRACE_ID}-")
        _tracing.set_status(server, 503)
        assert server.trace_id == TRACE_ID, "what the access line shows"
    child, span = exporter.get_finished_spans()
    assert span.name == "POST /encode"
    assert hex_ids(span) == (TRACE_ID, "b7ad6b7169203331")
    assert hex_ids(child) == (TRACE_ID, f"{own_id(span):016x}")
    assert (span.attributes or {})["http.response.status_code"] == 503
    assert not span.status.is_ok


@pytest.mark.parametrize("value", [None, "", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_a_missing_or_malformed_traceparent_starts_a_new_trace(
    exporter: InMemorySpanExporter, value: str | None
) -> None:
    with _tracing.server_span("/send", value):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


def test_recorded_spans_keep_their_times(exporter: InMemorySpanExporter) -> None:
    trace = _tracing.from_traceparent(PARENT)
    assert trace is not None
    trace.record("encdisagg.forward", 1_000, 5_000, {"encdisagg.batch_size": 3})
    (span,) = exporter.get_finished_spans()
    assert (span.start_time, span.end_time) == (1_000, 5_000)
    assert hex_ids(span) == (TRACE_ID, "b7ad6b7169203331")


@pytest.mark.anyio
async def test_child_tasks_inherit_the_current_span(exporter: InMemorySpanExporter) -> None:
    trace = _tracing.from_traceparent(PARENT)
    assert trace is not None
    seen: list[str | None] = []

    async def child() -> None:
        inner = _tracing.current()
        seen.append(None if inner is None else inner.traceparent())

    with trace.span("parent") as parent:
        assert parent is not None
        async with anyio.create_task_group() as group:
            group.start_soon(child)
        seen.append(
            await anyio.to_thread.run_sync(lambda: _tracing.outgoing_headers()["traceparent"])
        )
        expected = parent.traceparent()
    assert seen == [expected, expected]


def test_the_push_header_carries_an_optional_traceparent() -> None:
    plain = header()
    assert "traceparent" not in encode_header(plain).decode("latin-1")
    assert decode_header(encode_header(plain)).traceparent is None
    traced = header(traceparent=PARENT)
    assert decode_header(encode_header(traced)) == traced
    for bad in (5, "", "x" * 129, "tab\there", "é"):
        with pytest.raises(BadRequestError, match="'traceparent'"):
            header(traceparent=bad)


def test_worker_calls_carry_the_callers_traceparent(exporter: InMemorySpanExporter) -> None:
    from encdisagg.server._dp._ipc import MalformedMessage, WorkMessage, pack
    from encdisagg.server._serve._worker import _call_span

    untraced = WorkMessage(1, "encode", {"req_id": "r"})
    assert "traceparent" not in untraced.to_wire()
    assert WorkMessage.decode(pack(untraced.to_wire())) == untraced
    traced = WorkMessage(2, "encode", {"req_id": "r"}, PARENT)
    assert WorkMessage.decode(pack(traced.to_wire())) == traced
    for bad in ("", "x" * 129, 5):
        with pytest.raises(MalformedMessage):
            WorkMessage.decode(pack({**traced.to_wire(), "traceparent": bad}))
    # In the worker, the call's span is current: the Encoder's spans hang under it.
    with _call_span(traced):
        inner = _tracing.current_traceparent()
    assert inner is not None
    assert inner.startswith(f"00-{TRACE_ID}-")
    (span,) = exporter.get_finished_spans()
    assert span.name == "encdisagg.worker encode"
    assert hex_ids(span) == (TRACE_ID, "b7ad6b7169203331")
    with _call_span(untraced) as nothing:
        assert nothing is None
