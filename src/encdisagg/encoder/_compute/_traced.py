"""The Encoder's span names and attributes (see ``encdisagg._tracing``).

One traced request has an ``encdisagg.encode`` span with ``encdisagg.queue`` (waiting for a
batch), ``encdisagg.preprocess``, ``encdisagg.forward`` and ``encdisagg.stage`` children, and
one ``encdisagg.transfer`` span per send or push (under the ``/send`` call's own trace when
it came with one, else under the encode span). Nothing here runs for an untraced request
beyond an ``is None`` test.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from ... import _tracing
from .._types import Destination, EncodeRequest, MooncakeDestination
from ._batcher import ForwardJob

__all__ = [
    "ENCODE_SPAN",
    "FORWARD_SPAN",
    "PREPROCESS_SPAN",
    "QUEUE_SPAN",
    "STAGE_SPAN",
    "TRANSFER_SPAN",
    "encode_attributes",
    "record_batched",
    "transfer_span",
]

ENCODE_SPAN: Final = "encdisagg.encode"
QUEUE_SPAN: Final = "encdisagg.queue"
PREPROCESS_SPAN: Final = "encdisagg.preprocess"
FORWARD_SPAN: Final = "encdisagg.forward"
STAGE_SPAN: Final = "encdisagg.stage"
TRANSFER_SPAN: Final = "encdisagg.transfer"


def encode_attributes(request: EncodeRequest) -> dict[str, Any]:
    return {
        "encdisagg.req_id": request.req_id,
        "encdisagg.modality": request.kind.value,
        "encdisagg.part_idx": request.part_idx,
        "encdisagg.num_parts": request.num_parts,
    }


def transfer_span(
    encode_trace: _tracing.Trace, destination: Destination
) -> AbstractContextManager[_tracing.Trace]:
    """The span of one send or push of a request whose encode span is ``encode_trace``."""
    # A /send that came with its own trace continues that one; a push (or a send without
    # a trace) continues the encode's.
    trace = _tracing.current()
    if trace is None or trace.traceparent() is None:
        trace = encode_trace
    kind = "mooncake" if isinstance(destination, MooncakeDestination) else "zmq"
    attributes = {"encdisagg.transfer": kind, "encdisagg.destination": destination.identity}
    return trace.span(TRANSFER_SPAN, attributes)


def record_batched(trace: _tracing.Trace, jobs: Sequence[ForwardJob], submitted_ns: int) -> None:
    """The queue and forward spans of a request's jobs, from the batcher's timestamps (a
    fused forward runs in the batcher's task, where no request's span is current)."""
    for job in jobs:
        if job.forward_ns is None:
            continue
        started_ns, ended_ns, fused = job.forward_ns
        trace.record(QUEUE_SPAN, submitted_ns, started_ns)
        trace.record(FORWARD_SPAN, started_ns, ended_ns, {"encdisagg.batch_size": fused})
