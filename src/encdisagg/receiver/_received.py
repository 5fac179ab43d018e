"""What a receiver hands back: a request's assembled embeddings, and its own statistics."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .._modality import Modality
from .._video_timing import VideoTiming
from ..transfer import MAIN_SECTION, EmbeddingLayout

__all__ = ["EmbeddingPart", "ModalityEmbeddings", "ReceivedEmbeddings", "ReceiverStats"]

_DEEPSTACK = re.compile(r"deepstack_[0-9]+")


@dataclass(frozen=True, slots=True)
class EmbeddingPart:
    """One received part: ``tensor`` is ``[tokens, hidden]``."""

    part_idx: int
    modality: Modality
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    #: Video parts: each item's fps, second_per_grid_ts and timestamps, when the encoder
    #: sent them (checked against ``grid`` on arrival).
    video_timing: tuple[VideoTiming, ...] | None = None


@dataclass(frozen=True, slots=True)
class ModalityEmbeddings:
    """Every item of one modality, in the request's item order."""

    modality: Modality
    #: ``[tokens, hidden]``: the items' tokens, one after the other.
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    #: Each item's video timing, when every part carried it (``None`` otherwise).
    video_timing: tuple[VideoTiming, ...] | None = None
    #: The column sections of ``tensor`` (``None``: one section, the embedding itself).
    layout: EmbeddingLayout | None = None

    def sections(self) -> dict[str, torch.Tensor]:
        """Each section of :attr:`tensor` by name, as a view (no copy): ``"embedding"``,
        then e.g. ``"deepstack_0"``... Valid while :attr:`tensor` is."""
        if self.layout is None:
            return {MAIN_SECTION: self.tensor}
        return self.layout.split(self.tensor)

    @property
    def main(self) -> torch.Tensor:
        """The embedding the language model splices in at the media tokens (a view)."""
        return self.sections()[MAIN_SECTION]

    @property
    def deepstack(self) -> tuple[torch.Tensor, ...]:
        """The ``deepstack_<i>`` sections (views) in column order, which is layer order;
        empty for a one-section layout."""
        return tuple(view for name, view in self.sections().items() if _DEEPSTACK.fullmatch(name))


@dataclass(frozen=True, slots=True)
class ReceivedEmbeddings:
    """A request's embeddings, all parts in ``part_idx`` order.

    The tensors may be views of landing memory: valid only inside the ``expect`` block
    (or :func:`fetch_embeddings` block) that produced them. Copy what must outlive it.
    """

    rid: str
    parts: tuple[EmbeddingPart, ...]
    #: The receiver's layout of every part's tensor (``None``: one section).
    layout: EmbeddingLayout | None = None

    def of(self, modality: Modality | str) -> ModalityEmbeddings | None:
        """The parts of ``modality`` joined (a copy when there are several), or ``None``."""
        kind = Modality.parse(modality)
        chosen = [part for part in self.parts if part.modality is kind]
        if not chosen:
            return None
        tensor = chosen[0].tensor if len(chosen) == 1 else torch.cat([p.tensor for p in chosen])
        return ModalityEmbeddings(
            modality=kind,
            tensor=tensor,
            token_counts=tuple(n for part in chosen for n in part.token_counts),
            grid=tuple(g for part in chosen for g in part.grid),
            video_timing=_joined_timing(chosen),
            layout=self.layout,
        )


def _joined_timing(parts: list[EmbeddingPart]) -> tuple[VideoTiming, ...] | None:
    if any(part.video_timing is None for part in parts):
        return None
    return tuple(timing for part in parts for timing in part.video_timing or ())


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """A snapshot of a receiver. ``live_requests`` and ``landing_pages_in_use`` are zero
    when it is idle; the held figures too, once every encoder confirmed its writes ended.

    Landing pages (Mooncake) are free, in use by a live request, or *held*: a write may
    still land in them, so they are out of use. Held pages are *quarantined* while the
    receiver asks their encoder whether the write ended (within ``quarantine_s``), then,
    unconfirmed, *retired* for good (``on_quarantine_timeout="retire"``) or reused.
    """

    live_requests: int
    parts_received: int
    stale_parts_dropped: int
    malformed_messages: int
    landing_pages: int
    #: Pages of live requests' runs.
    landing_pages_in_use: int
    #: Held pages whose encoder is asked whether the write into them ended.
    quarantined_pages: int
    #: Held pages past ``quarantine_s`` without confirmation: out of use for good.
    retired_pages: int = 0
    #: Pages out of use because a write may still land in them: quarantined + retired.
    held_pages: int = 0
    #: Bytes a write may still land in. Above ``held_pages`` x the page size when pages
    #: were reused past ``quarantine_s`` (``on_quarantine_timeout="reuse"``).
    held_bytes: int = 0
