"""What a receiver hands back: a request's assembled embeddings, and its own statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._modality import Modality

__all__ = ["EmbeddingPart", "ModalityEmbeddings", "ReceivedEmbeddings", "ReceiverStats"]


@dataclass(frozen=True, slots=True)
class EmbeddingPart:
    """One received part: ``tensor`` is ``[tokens, hidden]``."""

    part_idx: int
    modality: Modality
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ModalityEmbeddings:
    """Every item of one modality, in the request's item order."""

    modality: Modality
    #: ``[tokens, hidden]``: the items' tokens, one after the other.
    tensor: torch.Tensor
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ReceivedEmbeddings:
    """A request's embeddings, all parts in ``part_idx`` order.

    The tensors may be views of landing memory: valid only inside the ``expect`` block
    (or :func:`fetch_embeddings` block) that produced them. Copy what must outlive it.
    """

    rid: str
    parts: tuple[EmbeddingPart, ...]

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
        )


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """A snapshot of a receiver. ``live_requests``, ``landing_pages_in_use`` and
    ``quarantined_pages`` are zero when it is idle."""

    live_requests: int
    parts_received: int
    stale_parts_dropped: int
    malformed_messages: int
    landing_pages: int
    landing_pages_in_use: int
    quarantined_pages: int
