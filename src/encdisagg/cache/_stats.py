"""The global tier's counters: their snapshot (:class:`GlobalCacheStats`) and their events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["COUNTERS", "EVENT_NAMES", "GlobalCacheStats"]

#: The counters of :class:`GlobalCacheStats` a cache counts itself, each with the event
#: (its singular) it reports to ``on_event``.
EVENT_NAMES: Final = {
    "hits": "hit",
    "misses": "miss",
    "fallbacks": "fallback",
    "skipped": "skipped",
    "invalid": "invalid",
    "lookup_failures": "lookup_failure",
    "fetch_failures": "fetch_failure",
    "inserts": "insert",
    "insert_failures": "insert_failure",
    "inserts_dropped": "insert_dropped",
    "evictions": "eviction",
    "eviction_failures": "eviction_failure",
    "connect_failures": "connect_failure",
}
COUNTERS: Final = tuple(EVENT_NAMES)


@dataclass(frozen=True, slots=True)
class GlobalCacheStats:
    """Counters of one :class:`GlobalCache` since it opened (items, unless said otherwise)."""

    #: Whether a store client is set up.
    connected: bool
    #: ``"closed"`` (in use), ``"open"`` (skipped) or ``"half_open"`` (probing).
    breaker: str
    #: How many times the breaker opened.
    breaker_opens: int
    #: Items served from the store.
    hits: int
    #: Items the store did not have.
    misses: int
    #: Items computed because a lookup or a fetch failed or was late.
    fallbacks: int
    #: Items not looked up: the breaker was open or the store not connected.
    skipped: int
    #: Entries found invalid (evicted and recomputed).
    invalid: int
    #: Lookup calls that failed or were late (each makes all its items fallbacks).
    lookup_failures: int
    #: Fetches that could not read some of the entries the lookup found.
    fetch_failures: int
    #: Entries stored.
    inserts: int
    #: Inserts the store failed.
    insert_failures: int
    #: Inserts not attempted: breaker not closed, not connected, or too many pending.
    inserts_dropped: int
    #: Invalid entries removed from the store.
    evictions: int
    #: Removals the store failed.
    eviction_failures: int
    #: Failed attempts to set up the store client.
    connect_failures: int
    #: Inserts and evictions waiting or running now.
    pending: int
