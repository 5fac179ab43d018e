"""What the ZMQ push-pool tests share: endpoints, headers, and a context that records every
tracker a send hands out (so a test can see when ZMQ let go of a payload)."""

from __future__ import annotations

import socket
from typing import Any

import zmq

from encdisagg.transfer import EmbeddingHeader

#: An endpoint nobody listens at: a pool with immediate=False queues on it and never sends.
NOBODY = "tcp://127.0.0.1:1"
#: Rows of 16 float16 values in a payload that is sent zero-copy (tracked) by default: 128 KiB.
TRACKED = 4096


class TrackingSocket(zmq.Socket):  # type: ignore[type-arg]
    """Records every tracker a send hands out in its context's ``trackers``."""

    def send(
        self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kw: Any
    ) -> Any:
        tracker = super().send(data, flags, copy=copy, track=track, **kw)
        if tracker is not None:
            self.context.trackers.append(tracker)
        return tracker


class TrackingContext(zmq.Context):  # type: ignore[type-arg]
    _socket_class = TrackingSocket
    trackers: list[zmq.MessageTracker] | None = None


def image_header(
    req_id: str, tokens: int, hidden: int = 16, dtype: str = "float16"
) -> EmbeddingHeader:
    return EmbeddingHeader(
        req_id=req_id,
        num_parts=1,
        part_idx=0,
        modality="image",
        shape=(tokens, hidden),
        dtype=dtype,
        token_counts=(tokens,),
        grid=((1, tokens),),
    )


def free_tcp_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
