"""The shape every ASGI middleware of the server shares: one kind of scope, the rest passed on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar

__all__ = ["App", "Middleware", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[..., Awaitable[None]]


class Middleware:
    """An ASGI middleware around ``app`` that handles the scopes whose ``type`` is
    :attr:`scope_type` in :meth:`handle` and hands every other scope to ``app`` as it is."""

    #: The ``type`` of the scopes :meth:`handle` takes (``"http"``, ``"lifespan"``).
    scope_type: ClassVar[str]

    def __init__(self, app: App) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == self.scope_type:
            await self.handle(scope, receive, send)
        else:
            await self._app(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one scope of :attr:`scope_type`; ``self._app`` is the app around which
        this middleware sits."""
        raise NotImplementedError
