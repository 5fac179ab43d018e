"""Cache-affine routing: each item goes to the encoder most likely to hold its embedding.

Pure and synchronous. An item's *affinity key* is a digest of the item as the client holds
it before sending (:func:`affinity_key`); the encoders are ranked for that key by
rendezvous (highest-random-weight) hashing, so a repeated item keeps going to the same
encoder, whose prefix cache then serves it, and an encoder joining or leaving moves only the
keys it wins or held. A *load bound* keeps one hot item from piling onto one encoder: an
encoder is skipped while taking one more part would put its in-flight count over
``load_bound`` times its fair share of everything in flight (bounded-load consistent
hashing); when every encoder is over its bound, or an item has no key, the least-loaded one
takes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Final, Self

from .._errors import ConfigError
from .._numbers import real

__all__ = ["ROUTINGS", "FleetRouting", "Slot", "affinity_key", "rendezvous_weight", "route_items"]

ROUTINGS: Final = ("affine", "least_loaded")
#: Strings and byte strings up to this size are hashed whole; a longer one by its length,
#: its first and its last ``_SAMPLE`` bytes, so planning a large data URL costs microseconds.
_SAMPLE: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class FleetRouting:
    """How :class:`~encdisagg.receiver.EncoderFleet` picks encoders for a request's items.

    :param routing: ``"affine"`` (by the items' content, under the load bound) or
        ``"least_loaded"`` (the least-loaded encoders, items cut into consecutive runs).
    :param load_bound: ``c`` of the bound: an encoder takes an item only while its
        in-flight count stays within ``c`` times its capacity's share of all in flight.
        At least 1; closer to 1 spreads hot items sooner, larger keeps them together longer.
    """

    routing: str = "affine"
    load_bound: float = 1.25

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {', '.join(ROUTINGS)}; got {self.routing!r}")
        real("load_bound", self.load_bound, least=1, error=ConfigError)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> Self:
        """Build from a mapping (a TOML table); unknown keys are refused by name.

        :raises ConfigError: an unknown key or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ConfigError(
                f"unknown routing option(s): {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        return cls(**mapping)


def _digest(tag: bytes, data: bytes) -> bytes:
    hasher = hashlib.blake2b(tag, digest_size=16)
    if len(data) <= 2 * _SAMPLE:
        hasher.update(data)
    else:
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data[:_SAMPLE])
        hasher.update(data[-_SAMPLE:])
    return hasher.digest()


def affinity_key(item: object) -> bytes | None:
    """A digest of ``item`` as the client holds it, or ``None`` (no affinity).

    Strings (data URLs, base64, http URLs, server-side paths) and byte strings are
    digested as they are; a :class:`~pathlib.Path` by its path (it is not read here); a
    ``{"url", ...}`` map by its ``content_hash`` if it has one, else its URL. Other items
    (PIL images, frame lists) have no key. Never blocks for long: long values are sampled
    (their length, head and tail), which only ever costs locality, never correctness.
    """
    if isinstance(item, str):
        return _digest(b"s", item.encode())
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _digest(b"b", bytes(item))
    if isinstance(item, PurePath):
        return _digest(b"p", str(item).encode())
    if isinstance(item, Mapping):
        content_hash, url = item.get("content_hash"), item.get("url")
        if isinstance(content_hash, str):
            return _digest(b"h", content_hash.lower().encode())
        if isinstance(url, str):
            return _digest(b"s", url.encode())
    return None


@dataclass(slots=True)
class Slot:
    """One candidate encoder as routing sees it: its in-flight count and capacity."""

    url: str
    inflight: float
    capacity: int


def rendezvous_weight(key: bytes, url: str) -> bytes:
    """``url``'s weight for ``key`` in rendezvous hashing: each key ranks the encoders in
    its own stable order."""
    return hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()


def route_items(
    keys: Sequence[bytes | None], slots: Sequence[Slot], *, load_bound: float
) -> list[str]:
    """The encoder URL of each item, in item order. Each choice counts as one more part in
    flight on its encoder before the next item is routed (``slots`` are updated).

    An item with a key goes to the first encoder in its rendezvous order whose in-flight
    count, plus this item, is within ``ceil(load_bound * capacity * (all in flight + 1) /
    all capacity)``; with no such encoder, or no key, to the least-loaded one.

    :raises ValueError: if ``slots`` is empty.
    """
    if not slots:
        raise ValueError("no encoder to route to")
    total_capacity = sum(slot.capacity for slot in slots)
    chosen = []
    for key in keys:
        target = None
        if key is not None:
            in_flight = sum(slot.inflight for slot in slots)
            for slot in sorted(slots, key=lambda s: rendezvous_weight(key, s.url), reverse=True):
                share = load_bound * slot.capacity * (in_flight + 1) / total_capacity
                # The epsilon keeps a share that is whole on paper whole in floating point.
                bound = math.ceil(share - 1e-9)
                if slot.inflight + 1 <= bound:
                    target = slot
                    break
        if target is None:  # the least-loaded one
            target = min(slots, key=lambda s: ((s.inflight + 1) / s.capacity, s.url))
        target.inflight += 1
        chosen.append(target.url)
    return chosen
