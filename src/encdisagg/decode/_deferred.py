"""Held requests: aborted ones whose KV pages and metadata slot a prefill write may still reach.

A request aborted after its pages were handed to the prefill ranks is *held* by the
:class:`DecodeTransferQueue`: its pages and slot stay out of use until every rank acked the
abort's generation, the proof that no write of theirs is in flight. Each held request carries
a :class:`~encdisagg.transfer.Hold` (counted in the queue's ledger, settled by that proof).
When the proof does not come within the release timeout, the queue's ``on_timeout`` policy
decides: give the memory back to use (``REUSE``, SGLang's behaviour), or *retire* it
(``RETIRE``): out of use until the acks arrive after all, or for good.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..transfer import Hold
from ._request import DecodeRequest

__all__ = ["DeferredResolution", "HeldRelease", "log_retired", "log_reused"]

_log = logging.getLogger("encdisagg.decode")


@dataclass(frozen=True, slots=True)
class HeldRelease:
    """A failed request whose pages are held until its prefill ranks drained."""

    req: DecodeRequest
    #: The generation whose acks release it.
    generation: int
    #: Distinct ranks that must ack, fixed when it was held.
    required_acks: int
    #: Clock reading when it was held.
    held_at: float
    #: Clock reading after which the queue's ``on_timeout`` policy applies to it.
    deadline: float
    #: "A write may still land in its pages and slot": settled once every rank acked its
    #: generation, or when ``REUSE`` gives its memory back at the deadline.
    hold: Hold = field(compare=False)
    #: Clock reading when its deadline found it without every ack under ``RETIRE``;
    #: ``None`` while it still waits for its deadline.
    retired_at: float | None = None


def _held_for(entry: HeldRelease, acked: int, now: float) -> tuple[object, ...]:
    """What both deadline logs say first: whose KV, held how long, with how many acks."""
    return (entry.req.rid, entry.req.room, now - entry.held_at, acked, entry.required_acks)


def log_reused(entry: HeldRelease, acked: int, now: float) -> None:
    """Log that ``entry`` is released at its deadline with ``acked`` acks (``REUSE``)."""
    _log.warning(
        "releasing KV of request %r (room %d) after %.1f s with %d of %d drained-acks: "
        "a late write could still land",
        *_held_for(entry, acked, now),
    )


def log_retired(entry: HeldRelease, acked: int, now: float) -> None:
    """Log, once, that ``entry`` is retired with ``acked`` acks (``RETIRE``)."""
    _log.error(
        "retired KV of request %r (room %d) after %.1f s with %d of %d drained-acks: its %d "
        "pages and metadata slot %s stay out of use until every rank acks generation %d "
        "(on_timeout=retire)",
        *_held_for(entry, acked, now),
        len(entry.req.pages),
        entry.req.metadata_slot,
        entry.generation,
    )


@dataclass(frozen=True, slots=True)
class DeferredResolution:
    """What one :meth:`DecodeTransferQueue.resolve_deferred` pass did, each in hold order."""

    #: Released without error once every required rank acked their generation (retired
    #: ones included).
    drained: tuple[DecodeRequest, ...] = ()
    #: Released without error at their deadline, without every ack (``HoldPolicy.REUSE``).
    timed_out: tuple[DecodeRequest, ...] = ()
    #: Retired now: their deadline passed without every ack (``HoldPolicy.RETIRE``).
    retired: tuple[DecodeRequest, ...] = ()
    #: Drained or timed out, but ``kv.release`` raised: dropped, never retried.
    failed: tuple[DecodeRequest, ...] = ()
    #: ``drained`` and ``timed_out`` together, in hold order.
    released: tuple[DecodeRequest, ...] = ()
