"""The states a decode request's KV transfer passes through."""

from __future__ import annotations

import enum

__all__ = ["KVPoll"]


class KVPoll(enum.IntEnum):
    """What polling a request's KV receiver reports.

    The values are ordered: a transfer only moves up (``Bootstrapping`` → ``WaitingForInput``
    → ``Transferring`` → ``Success``), except ``Failed``, which is terminal and overrides
    everything. Keeping them integers lets several ranks agree on the least advanced state
    with a plain ``min``.
    """

    #: The transfer failed or was aborted; nothing more is coming.
    Failed = 0
    #: The handshake with the prefill side is in progress.
    Bootstrapping = 1
    #: Handshake done: the request may be given KV pages and a metadata slot.
    WaitingForInput = 2
    #: The prefill side is writing KV into the request's pages.
    Transferring = 3
    #: Every prefill rank reported its part written.
    Success = 4
