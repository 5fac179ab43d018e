"""How a request's media items are split into parts across encoders.

Synchronous and free of I/O: the client asks for a plan, then performs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._errors import BadRequestError
from .._modality import Modality

__all__ = [
    "PartPlan",
    "RequestPlan",
    "assign_parts",
    "cut",
    "group_items",
    "numbered",
    "part_req_id",
    "split_part_id",
]

# -- part ids: built and parsed here only ----------------------------------------------------

#: Separates a request id from its part number in a part's id. Callers' request ids may not
#: contain it: the library alone uses it, also to name a failed-over request's attempts.
PART_SEPARATOR = "#"
#: Follows ``PART_SEPARATOR`` in an attempt's id, before the attempt number.
ATTEMPT_MARK = "~"


def check_rid(rid: object) -> str:
    """``rid`` if it may name a caller's request: a non-empty string without ``#``.

    :raises BadRequestError: naming the field.
    """
    if not isinstance(rid, str) or not rid:
        raise BadRequestError("rid must be a non-empty string")
    if PART_SEPARATOR in rid:
        raise BadRequestError(f"rid must not contain {PART_SEPARATOR!r}; got {rid!r}", req_id=rid)
    return rid


def attempt_rid(rid: str, attempt: int) -> str:
    """The id attempt ``attempt`` of request ``rid`` is planned under: ``rid`` itself first,
    then ``"{rid}#~{attempt}"`` (its parts ``"{rid}#~{attempt}#0"``...).

    A caller's id has no ``#``, so no attempt id is ever a caller's id, nor another
    request's attempt id; the receiver routes a part to it by its last ``#`` as any other.
    """
    if attempt == 0:
        return rid
    return f"{rid}{PART_SEPARATOR}{ATTEMPT_MARK}{attempt}"


def part_req_id(rid: str, part_idx: int) -> str:
    """The id a part of request ``rid`` has on its encoder: ``"{rid}#{part_idx}"``."""
    return f"{rid}{PART_SEPARATOR}{part_idx}"


def split_part_id(part_id: str) -> tuple[str, str]:
    """``(rid, index)`` of a part id, split at its last ``#``: the request a part belongs to,
    attempts included. ``rid`` is empty (no request's: none is) for an id without ``#``."""
    rid, _, index = part_id.rpartition(PART_SEPARATOR)
    return rid, index


@dataclass(frozen=True, slots=True)
class PartPlan:
    """One part: a run of consecutive items of one modality, encoded by one encoder."""

    rid: str
    part_idx: int
    num_parts: int
    modality: Modality
    #: The encoder's base URL, e.g. ``"http://127.0.0.1:8000"``.
    url: str
    items: tuple[object, ...]
    #: Index of the first item within the request's items of this modality.
    first_item: int

    @property
    def req_id(self) -> str:
        """The part's id on its encoder."""
        return part_req_id(self.rid, self.part_idx)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Every part of one request, ordered by ``part_idx`` (modality-outer, item order inside)."""

    rid: str
    parts: tuple[PartPlan, ...]

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def modalities(self) -> tuple[Modality, ...]:
        """The modalities present, in part order."""
        seen: list[Modality] = []
        for part in self.parts:
            if part.modality not in seen:
                seen.append(part.modality)
        return tuple(seen)


#: A part before it is numbered: its modality, encoder URL, items and first item's index.
Run = tuple[Modality, str, tuple[object, ...], int]


def group_items(
    rid: str, items: Mapping[Modality | str, Sequence[object]]
) -> list[tuple[Modality, tuple[object, ...]]]:
    """The items of request ``rid`` by modality, in enum order, so that the same request
    always gets the same part numbering.

    :raises BadRequestError: naming the field: not a map of lists, an unknown modality, no item.
    """
    if not isinstance(items, Mapping):
        raise BadRequestError("items must map a modality to its list of media items")
    grouped: dict[Modality, list[object]] = {}
    for key, values in items.items():
        modality = Modality.parse(key, field="items modality")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise BadRequestError(f"items[{modality.value!r}] must be a list of media items")
        grouped.setdefault(modality, []).extend(values)
    ordered = [(m, tuple(grouped[m])) for m in Modality if grouped.get(m)]
    if not ordered:
        raise BadRequestError(f"request {rid!r} has no media items", req_id=rid)
    return ordered


def cut(values: tuple[object, ...], n_runs: int) -> list[tuple[tuple[object, ...], int]]:
    """``values`` cut into ``n_runs`` runs of consecutive items whose sizes differ by one at
    most, each with its first item's index."""
    base, extra = divmod(len(values), n_runs)
    runs, offset = [], 0
    for run in range(n_runs):
        size = base + (1 if run < extra else 0)
        runs.append((values[offset : offset + size], offset))
        offset += size
    return runs


def numbered(rid: str, runs: Sequence[Run]) -> RequestPlan:
    """The plan of request ``rid`` whose parts are ``runs``, numbered in their order."""
    parts = tuple(
        PartPlan(rid, index, len(runs), modality, url, run_items, first)
        for index, (modality, url, run_items, first) in enumerate(runs)
    )
    return RequestPlan(rid=rid, parts=parts)


def assign_parts(
    rid: str,
    items: Mapping[Modality | str, Sequence[object]],
    urls: Sequence[str],
    *,
    start: int = 0,
) -> RequestPlan:
    """Split the items of request ``rid`` across the encoders at ``urls``.

    Per modality, the items are cut into at most ``len(urls)`` runs of consecutive items
    whose sizes differ by one at most; each run is one part, sent to its own encoder.
    Encoders are taken in turn starting at ``start`` and continuing across modalities, so
    the load spreads over requests (vary ``start``) and over modalities. Parts are numbered
    modality-outer (image, video, audio), item order inside: concatenating the parts of a
    modality in ``part_idx`` order gives its items in their original order.

    Does not block.

    :raises BadRequestError: naming the field for an empty ``rid``, no encoder URL, or no item.
    """
    check_rid(rid)
    if not urls:
        raise BadRequestError("urls must name at least one encoder", req_id=rid)
    cursor = start % len(urls)
    runs: list[Run] = []
    for modality, values in group_items(rid, items):
        for run_items, first in cut(values, min(len(urls), len(values))):
            runs.append((modality, urls[cursor], run_items, first))
            cursor = (cursor + 1) % len(urls)
    return numbered(rid, runs)
