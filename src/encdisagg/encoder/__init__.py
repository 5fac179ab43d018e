"""The Encoder: request lifecycle, batching, caching, staging and delivery."""

from .._exports import claim_exports
from ._compute._cache import PrefixCache as PrefixCache
from ._encoder import Encoder as Encoder, EncoderEvents as EncoderEvents
from ._types import (
    Destination as Destination,
    EncodeRequest as EncodeRequest,
    EncodeResult as EncodeResult,
    EncoderStats as EncoderStats,
    MooncakeDestination as MooncakeDestination,
    ZmqDestination as ZmqDestination,
)

__all__ = (
    "Encoder",
    "EncoderEvents",
    "EncodeRequest",
    "EncodeResult",
    "EncoderStats",
    "Destination",
    "MooncakeDestination",
    "ZmqDestination",
    "PrefixCache",
)

claim_exports(globals())
