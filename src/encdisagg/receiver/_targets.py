"""Where an encoder delivers a part: the ``/send`` body of each transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MooncakeSendTarget", "SendTarget", "ZmqSendTarget"]


@dataclass(frozen=True, slots=True)
class ZmqSendTarget:
    """``/send`` body for a ZMQ delivery: the receiver's PULL endpoint."""

    receive_url: str

    def body(self, req_id: str) -> dict[str, Any]:
        return {"req_id": req_id, "receive_url": self.receive_url}


@dataclass(frozen=True, slots=True)
class MooncakeSendTarget:
    """``/send`` body for a Mooncake delivery: where in the receiver's registered memory the
    encoder writes, and which engine session owns it."""

    session_id: str
    buffer_address: int
    prefill_host: str
    embedding_port: int

    def body(self, req_id: str) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "session_id": self.session_id,
            "buffer_address": self.buffer_address,
            "prefill_host": self.prefill_host,
            "embedding_port": self.embedding_port,
        }


SendTarget = ZmqSendTarget | MooncakeSendTarget
