"""Control messages between the prefill and decode workers.

Plain frozen values of ints and strings: in one process they are handed over as they are;
across processes they would travel as msgpack maps with the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AbortRequest",
    "BootstrapInfo",
    "DecodeMessage",
    "DrainedAck",
    "KVDestination",
    "PrefillMessage",
    "TransferDone",
]


# -- prefill -> decode --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BootstrapInfo:
    """Prefill knows the request's length: decode may give it pages."""

    rid: str
    room: int
    seq_len: int
    rank: int


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A prefill rank finished with a request: every write landed (``ok``), or it failed and
    stopped writing (``error`` says why)."""

    rid: str
    room: int
    rank: int
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class DrainedAck:
    """A prefill rank wrote its last byte for ``(room, generation)``."""

    room: int
    rank: int
    generation: int


DecodeMessage = BootstrapInfo | TransferDone | DrainedAck


# -- decode -> prefill --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVDestination:
    """Where a request's KV goes: one address per page, and its metadata row."""

    rid: str
    room: int
    session_id: str
    page_bytes: int
    page_addresses: tuple[int, ...]
    row_address: int
    row_bytes: int


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop working on ``room``. With a ``generation``, its pages were handed out: ack the
    drain with that generation once the last write is over."""

    rid: str
    room: int
    generation: int | None


PrefillMessage = KVDestination | AbortRequest
