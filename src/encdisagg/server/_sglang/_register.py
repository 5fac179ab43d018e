"""Registering with SGLang's encoder bootstrap (``--register-with URL``).

SGLang's language-only tokenizer can run an ``EncoderBootstrapServer``: encoders announce
themselves with ``POST /register_encoder_url {"url": ...}`` and leave with
``DELETE /unregister_encoder_url``. The bootstrap may come up after the encoder, so the
registration is retried with a growing pause; the server serves meanwhile. On shutdown the
registration is withdrawn (bounded), so the tokenizer stops routing here before the encoder
closes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

import anyio
import httpx

__all__ = ["BootstrapRegistration", "registered_with"]

_log = logging.getLogger("encdisagg.server.sglang")

#: Attempts before giving up, as SGLang's own encoders do (30, about 5 s apart at most).
_ATTEMPTS: Final = 30
_FIRST_PAUSE_S: Final = 0.5
_MAX_PAUSE_S: Final = 5.0
#: Bound on one registration call, and on the unregistration at shutdown.
_CALL_TIMEOUT_S: Final = 5.0
_UNREGISTER_TIMEOUT_S: Final = 2.0


@dataclass(eq=False)
class BootstrapRegistration:
    """How the registration went.

    :ivar registered: set once the bootstrap accepted the URL.
    :ivar attempts: calls made so far.
    :ivar last_error: why the latest attempt failed (``""`` when none did).
    """

    bootstrap: str
    url: str
    registered: anyio.Event
    attempts: int = 0
    last_error: str = ""


@asynccontextmanager
async def registered_with(
    bootstrap: str,
    url: str,
    *,
    attempts: int = _ATTEMPTS,
    first_pause_s: float = _FIRST_PAUSE_S,
    max_pause_s: float = _MAX_PAUSE_S,
) -> AsyncGenerator[BootstrapRegistration]:
    """Register ``url`` with the bootstrap at ``bootstrap`` while the block runs.

    Entering starts the registration in the background (not a checkpoint); each failed
    attempt is logged and retried after a pause that doubles up to ``max_pause_s``, at most
    ``attempts`` times. Leaving stops it and, if it succeeded, unregisters (shielded, at
    most 2 s); a failed unregistration is logged, never raised.
    """
    state = BootstrapRegistration(bootstrap.rstrip("/"), url, anyio.Event())
    async with httpx.AsyncClient(timeout=_CALL_TIMEOUT_S) as client:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_register, client, state, attempts, first_pause_s, max_pause_s)
                try:
                    yield state
                finally:
                    group.cancel_scope.cancel()
        finally:
            if state.registered.is_set():
                with anyio.CancelScope(shield=True):
                    await _unregister(client, state)


async def _register(
    client: httpx.AsyncClient,
    state: BootstrapRegistration,
    attempts: int,
    pause_s: float,
    max_pause_s: float,
) -> None:
    target = f"{state.bootstrap}/register_encoder_url"
    while state.attempts < attempts:
        state.attempts += 1
        try:
            response = await client.post(target, json={"url": state.url})
        except httpx.HTTPError as exc:
            state.last_error = f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code == 200:
                _log.info(
                    "registered %s with the SGLang encoder bootstrap %s (attempt %d)",
                    state.url,
                    state.bootstrap,
                    state.attempts,
                )
                state.last_error = ""
                state.registered.set()
                return
            state.last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        if state.attempts >= attempts:
            break
        _log.warning(
            "registering %s with %s failed (attempt %d of %d): %s; retrying in %.1f s",
            state.url,
            target,
            state.attempts,
            attempts,
            state.last_error,
            pause_s,
        )
        await anyio.sleep(pause_s)
        pause_s = min(pause_s * 2, max_pause_s)
    _log.error(
        "gave up registering %s with %s after %d attempts: %s",
        state.url,
        target,
        attempts,
        state.last_error,
    )


async def _unregister(client: httpx.AsyncClient, state: BootstrapRegistration) -> None:
    target = f"{state.bootstrap}/unregister_encoder_url"
    try:
        with anyio.fail_after(_UNREGISTER_TIMEOUT_S):
            response = await client.request("DELETE", target, json={"url": state.url})
    except (TimeoutError, httpx.HTTPError) as exc:
        _log.warning("unregistering %s from %s failed: %s", state.url, target, exc or "timeout")
        return
    if response.status_code != 200:
        _log.warning(
            "unregistering %s from %s answered HTTP %d", state.url, target, response.status_code
        )
        return
    _log.info("unregistered %s from the SGLang encoder bootstrap %s", state.url, state.bootstrap)
