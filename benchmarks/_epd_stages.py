"""Where an E->P->D request's time to first token goes, hop by hop, from the pipeline's own spans.

The demo pipeline already opens OpenTelemetry spans along a request's path (``docs/tracing.md``):
the decode side's admission, prefill, the encoder's HTTP calls and their ``encode``,
``preprocess``, ``queue``, ``forward`` and ``stage`` spans, the push (``transfer``), the
landing (``receive``) and the KV write. One traced run of a cell, with an in-memory exporter,
gives every request's timeline; cut at consecutive instants of the part that landed last (the
one the prefill waited for), the stages add up to the request's TTFT exactly, so nothing is
left unexplained.

Tracing costs a little per span, so the traced run is separate from the timed ones and its own
TTFT is reported beside the stages.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

#: The stages of one disaggregated request, in the order they happen; each runs from the
#: instant named by the previous stage's end to its own.
STAGES: tuple[str, ...] = (
    "decode admission -> prefill starts",
    "prefill starts -> /encode sent",
    "/encode: HTTP in, admission",
    "preprocess",
    "queue, batching window",
    "vision forward",
    "stage into registered memory",
    "/encode answer -> /send arrives",
    "/send: HTTP in -> push starts",
    "push -> landed in prefill",
    "prefill forward",
    "KV write",
    "first decode step",
)

#: The colocated request's stages (``bench_epd._colocated_one``'s stamps).
COLOCATED_STAGES: tuple[str, ...] = ("decode image", "preprocess", "generate -> first token")


def _children(spans: Iterable[Any]) -> dict[int, list[Any]]:
    by_parent: dict[int, list[Any]] = defaultdict(list)
    for span in spans:
        if span.parent is not None:
            by_parent[span.parent.span_id].append(span)
    return by_parent


def _only(spans: list[Any], name: str) -> Any:
    found = [span for span in spans if span.name == name]
    if len(found) != 1:
        raise LookupError(f"expected one {name!r} span, found {len(found)}")
    return found[0]


def request_stages(spans: list[Any], ttft_s: float) -> dict[str, float]:
    """One request's stages in milliseconds, from the spans of its trace.

    :raises LookupError: a span the timeline needs is missing (tracing was off somewhere).
    """
    children = _children(spans)
    decode = _only(spans, "encdisagg.decode")
    prefill = _only(spans, "encdisagg.prefill")
    kv_write = _only(children[prefill.context.span_id], "encdisagg.kv_write")
    # The part the prefill waited for: the last to land. Over ZMQ the receiver's span says
    # when a part landed; over Mooncake the write is done when its ``/send`` answers.
    received = [span for span in spans if span.name == "encdisagg.receive"]
    if received:
        landed = max(received, key=lambda s: s.end_time)
        landed_ns = landed.end_time
        transfer = next(s for s in spans if s.context.span_id == landed.parent.span_id)
        send_http = next(s for s in spans if s.context.span_id == transfer.parent.span_id)
        part = landed.attributes["encdisagg.req_id"]
        encode = next(
            s
            for s in spans
            if s.name == "encdisagg.encode" and s.attributes.get("encdisagg.req_id") == part
        )
    else:
        send_http = max(
            (span for span in spans if span.name == "POST /send"), key=lambda s: s.end_time
        )
        landed_ns = send_http.end_time
        transfer = _only(children[send_http.context.span_id], "encdisagg.transfer")
        # Its part: the encode that ended last before this /send began.
        encode = max(
            (
                s
                for s in spans
                if s.name == "encdisagg.encode" and s.end_time <= send_http.start_time
            ),
            key=lambda s: s.end_time,
        )
    encode_http = next(s for s in spans if s.context.span_id == encode.parent.span_id)
    steps = children[encode.context.span_id]
    preprocess = _only(steps, "encdisagg.preprocess")
    forward = _only(steps, "encdisagg.forward")
    instants = (
        decode.start_time,
        prefill.start_time,
        encode_http.start_time,
        preprocess.start_time,
        preprocess.end_time,
        forward.start_time,
        forward.end_time,
        encode.end_time,
        send_http.start_time,
        transfer.start_time,
        landed_ns,
        kv_write.start_time,
        kv_write.end_time,
        decode.start_time + round(ttft_s * 1e9),
    )
    return {
        stage: (end - start) / 1e6
        for stage, start, end in zip(STAGES, instants[:-1], instants[1:], strict=True)
    }


def traced_stages(spans: Iterable[Any], ttft_by_rid: Mapping[str, float]) -> dict[str, float]:
    """The median of each stage over every request of one traced run, in milliseconds."""
    traces: dict[int, list[Any]] = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    per_request: list[dict[str, float]] = []
    for trace in traces.values():
        roots = [span for span in trace if span.name == "encdisagg.demo.request"]
        if not roots:
            continue
        rid = roots[0].attributes["encdisagg.rid"]
        per_request.append(request_stages(trace, ttft_by_rid[rid]))
    if not per_request:
        raise LookupError("no traced request: is the OpenTelemetry SDK installed?")
    return {stage: statistics.median(r[stage] for r in per_request) for stage in STAGES}


def colocated_stages(requests: Mapping[str, Any]) -> dict[str, float]:
    """The median of each colocated stage, in milliseconds."""
    return {
        stage: statistics.median(r["stages"][stage] for r in requests.values()) * 1e3
        for stage in COLOCATED_STAGES
    }


def in_memory_tracing() -> Any:
    """Install a tracer provider that keeps every finished span; returns its exporter.

    OpenTelemetry lets a process set its provider once, so call this once per process.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter
