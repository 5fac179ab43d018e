"""The real encoder server app, wrapped in an ASGI middleware that can inject faults.

The middleware answers a route with an error status instead of passing it on (``fail``),
delays it (``delay``), and records every call, so the receiver's tests drive real HTTP
against the real server on asyncio and on Trio, failures included.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import sniffio

from encdisagg import Encoder
from encdisagg.server import create_app

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Faults:
    #: route -> status answered instead of serving the route.
    fail: dict[str, int] = field(default_factory=dict)
    #: route -> seconds to wait before serving it.
    delay: dict[str, float] = field(default_factory=dict)
    #: ``(route, req_id)`` of every POST, in arrival order.
    calls: list[tuple[str, str | None]] = field(default_factory=list)


class FaultyApp:
    def __init__(self, encoder: Encoder, faults: Faults) -> None:
        flavour = "trio" if sniffio.current_async_library() == "trio" else "asyncio"
        self.app = create_app(encoder, flavour=flavour)
        self.faults = faults

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        path = scope["path"]
        try:
            req_id = json.loads(body).get("req_id")
        except (ValueError, AttributeError):
            req_id = None
        self.faults.calls.append((path, req_id))
        if path in self.faults.delay:
            await anyio.sleep(self.faults.delay[path])
        status = self.faults.fail.get(path)
        if status is not None:
            payload = json.dumps({"status": "error", "message": "injected", "req_id": req_id})
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload.encode()})
            return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
