"""A small ASGI app that serves an Encoder with the routes of the encoder server.

Framework-free, so Hypercorn serves it on asyncio and on Trio alike; the receiver's tests use
it to drive real HTTP against a real Encoder on both backends, and to inject faults.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from encdisagg import (
    EncdisaggError,
    Encoder,
    EncodeRequest,
    MooncakeDestination,
    ZmqDestination,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Faults:
    """Faults to inject: route -> status to answer instead of serving it."""

    fail: dict[str, int] = field(default_factory=dict)
    #: Seconds to sleep before serving a route.
    delay: dict[str, float] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)


class EncoderApp:
    def __init__(self, encoder: Encoder, faults: Faults | None = None) -> None:
        self.encoder = encoder
        self.faults = faults or Faults()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer = await self.handle(scope["path"], json.loads(body or b"null"))
        payload = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def handle(self, path: str, body: Any) -> tuple[int, Any]:
        req_id = body.get("req_id") if isinstance(body, dict) else None
        self.faults.calls.append((path, req_id))
        if path in self.faults.delay:
            await anyio.sleep(self.faults.delay[path])
        if path in self.faults.fail:
            return self.faults.fail[path], {
                "status": "error",
                "message": "injected",
                "req_id": req_id,
            }
        try:
            return 200, await self.route(path, body)
        except EncdisaggError as exc:
            return exc.status, {"status": "error", "message": exc.message, "req_id": req_id}

    async def route(self, path: str, body: dict[str, Any]) -> Any:
        enc = self.encoder
        if path == "/encode":
            result = await enc.encode(
                EncodeRequest(
                    body["req_id"],
                    body["mm_items"],
                    modality=body["modality"],
                    num_parts=body["num_parts"],
                    part_idx=body["part_idx"],
                )
            )
            return {
                "req_id": result.req_id,
                "part_idx": body["part_idx"],
                "embedding_size": result.nbytes,
                "embedding_len": result.num_tokens,
                "embedding_dim": result.hidden_size,
                "token_counts": list(result.token_counts),
                "grid": [list(g) for g in result.grid],
            }
        if path == "/send":
            destination: ZmqDestination | MooncakeDestination
            if "receive_url" in body:
                destination = ZmqDestination(body["receive_url"])
            else:
                destination = MooncakeDestination(
                    body["session_id"],
                    body["buffer_address"],
                    f"{body['prefill_host']}:{body['embedding_port']}",
                )
            await enc.send(body["req_id"], destination, receive_count=body.get("receive_count"))
            return None
        if path == "/release":
            await enc.release(body["req_id"])
            return None
        return None
