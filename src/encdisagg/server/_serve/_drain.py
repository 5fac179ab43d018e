"""``encdisagg serve``'s drain: what happens between the first signal and the closed listener.

The command turns readiness false and withdraws the registry key first; then
:meth:`ServeDrain.settle` keeps the listener open for ``drain_delay_s`` (encodes are still
admitted: a load balancer or a fleet client may not have seen the 503 yet), then refuses new
encodes with 503 and waits, bounded by ``drain_timeout_s``, until every request it admitted
was delivered, released or expired. Only then does Hypercorn stop accepting. The requests a
stop at once (a second signal) leaves behind are counted for the log line that says so.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

import anyio
import anyio.lowlevel

from .._metrics import ServiceSnapshot

__all__ = ["ServeDrain"]

_log = logging.getLogger("encdisagg.server")

#: How often the drain reads what the service still holds (no event says it).
_POLL_S: Final = 0.05


class _Backend(Protocol):
    async def snapshot(self) -> ServiceSnapshot: ...


class _Service(Protocol):
    @property
    def backend(self) -> _Backend | None: ...

    def refuse_encodes(self) -> None: ...


class ServeDrain:
    """The drain of one served app.

    :param service: the app's encoder service.
    :param delay_s: how long encodes are still admitted after :meth:`settle` began.
    :param timeout_s: how long, after the delay, the admitted requests are waited for.
    """

    def __init__(self, service: _Service, *, delay_s: float, timeout_s: float) -> None:
        self._service = service
        self._delay_s = delay_s
        self._timeout_s = timeout_s
        #: What the service held when last asked (``None``: not asked yet).
        self.held: int | None = None

    async def count(self) -> int:
        """The requests the service holds now (0 once it closed). A checkpoint."""
        backend = self._service.backend
        if backend is None:
            await anyio.lowlevel.checkpoint()
            self.held = 0
        else:
            # Requests encoding, staged or delivering.
            gauges = (await backend.snapshot()).encoder.gauges
            self.held = int(gauges.get("live_requests", 0))
        return self.held

    async def settle(self) -> None:
        """Wait for the delay, then refuse encodes and wait (at most the timeout) until
        nothing admitted is left. A checkpoint; cancelling it ends the wait at once."""
        await anyio.sleep(self._delay_s)
        self._service.refuse_encodes()
        with anyio.move_on_after(self._timeout_s) as scope:
            # No event tells when the last admitted request ended (in a data-parallel
            # worker it ends in another process): ask again every _POLL_S.
            while await self.count() > 0:  # noqa: ASYNC110
                await anyio.sleep(_POLL_S)
        if scope.cancelled_caught:
            _log.warning(
                "drain timeout (%s s) passed with %s admitted request(s) left; closing",
                self._timeout_s,
                self.held,
            )
        else:
            _log.info("drained: every admitted request was delivered, released or expired")
