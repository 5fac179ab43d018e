"""A decode request: what the transfer queue holds, and what a held release names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._slots import MetadataRow

__all__ = ["DecodeRequest"]


@dataclass(eq=False, slots=True)
class DecodeRequest:
    """One request on the decode side, from preallocation until its KV is committed or freed.

    Mutable and compared by identity: two requests with the same ``rid`` are still two.
    """

    rid: str
    #: The bootstrap room: the handle the prefill ranks know this request by.
    room: int
    #: The metadata slot the prefill side writes into; ``None`` once it has been freed.
    metadata_slot: int | None
    #: How many prefill ranks write into this request's pages, so how many drained-acks
    #: an abort must collect before the pages are safe to reuse.
    required_acks: int
    #: The :class:`AbortAckTracker` generation of the abort sent for this request, if any.
    generation: int | None = None
    #: True once an abort was sent to the prefill ranks (their drained-acks will follow).
    abort_notified: bool = False
    #: The KV pages preallocated for this request (for sinks that free pages by index).
    pages: tuple[int, ...] = ()
    #: The metadata row a sink read when it committed the request.
    metadata: MetadataRow | None = None
    #: A speculative draft state that a sink found in the metadata slot at commit (views into
    #: the slot's memory, not copies). While it is set the request keeps its slot: the first
    #: real decode step reads it, and only then may the slot be freed and written again.
    draft: Any = None
