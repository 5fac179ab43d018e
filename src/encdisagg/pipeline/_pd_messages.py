"""What the prefill and decode workers tell each other: control messages, and the words
prefill adds to a request's metadata row.

The messages are plain frozen values of ints and strings: in one process they are handed over
as they are; across processes they would travel as msgpack maps with the same fields. The row
words are written by prefill when it packs a request's KV, and read by decode when it commits
the request, before the transfer queue zeroes the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "ROPE_DELTA_WORD",
    "SEQ_LEN_WORD",
    "AbortRequest",
    "BootstrapInfo",
    "DecodeMessage",
    "DrainedAck",
    "KVDestination",
    "PrefillMessage",
    "TransferDone",
]

#: Words of a metadata row past the four the decode side defines: the pipeline writes the
#: multimodal RoPE offset and the prompt length there.
ROPE_DELTA_WORD: Final = 4
SEQ_LEN_WORD: Final = 5


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
