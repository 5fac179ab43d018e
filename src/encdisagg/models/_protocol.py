"""What an encoder needs from a vision model: the ``VisionModel`` protocol and its values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .._errors import InternalError

if TYPE_CHECKING:
    from .._modality import Modality
    from .._video_timing import VideoTiming
    from ..transfer import EmbeddingLayout

__all__ = ["ModelOptions", "Preprocessed", "VisionModel", "split_embedding"]


# eq=False: features hold tensors, whose == is elementwise; two Preprocessed values are the
# same input exactly when their cache keys are, which callers compare directly.
@dataclass(frozen=True, eq=False)
class Preprocessed:
    """The result of preprocessing one request's items, ready for ``forward``; its tensors
    are on the CPU (on the model's device where an image model preprocesses there).

    :param token_counts: LLM tokens each item becomes, one entry per item.
    :param grid: each item's patch grid (``(t, h, w)`` for the Qwen2-VL family), one per item.
    :param features: model-specific tensors ``forward`` consumes (e.g. ``pixel_values``).
    :param cache_key: a content hash of ``features`` (or of input they follow from exactly,
        such as the resized pixels of the fast image path), ``grid`` and the model's identity;
        ``None`` means the result must not be cached.
    :param video_timing: for videos, each item's timing (fps, ``second_per_grid_ts``,
        timestamps) as the model's video processor computes it; ``None`` otherwise.
    :raises InternalError: if ``token_counts`` and ``grid`` disagree on the number of items or
        a count is negative, or ``video_timing`` has not one entry per item; a model that
        builds such a value broke its own contract.
    """

    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    features: Mapping[str, Any] = field(default_factory=dict)
    cache_key: str | None = None
    video_timing: tuple[VideoTiming, ...] | None = None

    def __post_init__(self) -> None:
        counts = tuple(int(count) for count in self.token_counts)
        grid = tuple(tuple(int(size) for size in row) for row in self.grid)
        if len(counts) != len(grid):
            raise InternalError(
                f"Preprocessed has {len(counts)} token counts but {len(grid)} grid rows"
            )
        if any(count < 0 for count in counts):
            raise InternalError(f"Preprocessed token_counts must not be negative: {counts}")
        if self.video_timing is not None and len(self.video_timing) != len(grid):
            raise InternalError(
                f"Preprocessed has {len(self.video_timing)} video timings for {len(grid)} items"
            )
        # Callers pass lists as often as tuples; store the declared types so the value
        # compares, hashes and serialises the same whichever they passed.
        object.__setattr__(self, "token_counts", counts)
        object.__setattr__(self, "grid", grid)

    @property
    def num_tokens(self) -> int:
        """All tokens of the request: ``sum(token_counts)``."""
        return sum(self.token_counts)


@runtime_checkable
class VisionModel(Protocol):
    """A vision (or other media) encoder the Encoder can drive.

    ``preprocess`` may run in several worker threads at once; ``forward`` runs in one worker
    thread at a time, which need not be the thread that built the model.

    A model may also declare the optional members :class:`ModelOptions` lists (with the
    defaults a model that leaves one out gets); the protocol itself asks only for these four.
    """

    @property
    def hidden_size(self) -> int:
        """Width of every embedding row ``forward`` returns."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the embeddings ``forward`` returns."""
        ...

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        """Decode and preprocess one request's items. Blocks on CPU work (and on media fetches).

        :raises BadRequestError: (or ``ValueError``/``TypeError``) for input it rejects.
        """
        ...

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        """Encode a batch; one ``[tokens, hidden_size]`` tensor per element. Blocks on compute.

        :raises InternalError: if the encoder's output disagrees with the token counts.
        """
        ...


def split_embedding(rows: torch.Tensor, token_counts: Sequence[int]) -> list[torch.Tensor]:
    """Split ``rows`` (``[tokens, hidden]``) into consecutive pieces of ``token_counts`` rows.

    The pieces are views of ``rows``. Does not block.

    :raises InternalError: if ``rows`` is not 2-D or does not have exactly
        ``sum(token_counts)`` rows.
    """
    if rows.dim() != 2:
        raise InternalError(
            f"Encoder produced a tensor of shape {tuple(rows.shape)}, expected [tokens, hidden]"
        )
    expected = sum(token_counts)
    produced = int(rows.shape[0])
    if produced != expected:
        raise InternalError(
            f"Encoder produced {produced} tokens, but preprocessor metadata expected {expected}"
        )
    return list(torch.split(rows, list(token_counts), dim=0))


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """The optional members of a :class:`VisionModel`, each with the default a model that does
    not declare it gets. A model declares one as an attribute (or property) of that name.

    The protocol keeps them out of its required members, so that any object with the four
    required ones is a model; :meth:`of` is the one place their presence is asked.
    """

    #: ``False``: ``preprocess`` and ``forward`` finish in microseconds without I/O (like
    #: :class:`NullVisionModel`), so the Encoder calls them inline on its event loop, with
    #: no worker thread and no batching.
    blocking: bool = True
    #: ``True``: ``preprocess`` takes a ``limits=`` keyword (the config's media budgets).
    accepts_media_limits: bool = False
    #: How an embedding's columns split (Qwen3-VL's deepstack), for receivers to check.
    embedding_layout: EmbeddingLayout | None = None
    #: Where ``forward`` leaves its tensors (CPU when not said).
    device: torch.device | None = None
    #: The modalities the model encodes.
    modalities: frozenset[Modality] | None = None
    #: A digest of the weights and preprocessing settings (the global cache's namespace).
    identity: str | None = None

    @classmethod
    def of(cls, model: object) -> ModelOptions:
        """What ``model`` declares, defaults for the rest. Not async; reads each member once
        (a value of the wrong type counts as not declared)."""
        blocking = getattr(model, "blocking", True)
        device = getattr(model, "device", None)
        modalities = getattr(model, "modalities", None)
        identity = getattr(model, "identity", None)
        return cls(
            blocking=bool(blocking),
            accepts_media_limits=getattr(model, "accepts_media_limits", False) is True,
            embedding_layout=getattr(model, "embedding_layout", None),
            device=device if isinstance(device, torch.device) else None,
            modalities=modalities if isinstance(modalities, frozenset) else None,
            identity=identity if isinstance(identity, str) and identity else None,
        )
