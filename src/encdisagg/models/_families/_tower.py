"""What every model adapter shares around its tower: identity and cache-key hashing, one
processor per thread, the request checks of ``preprocess`` and the batch plumbing of
``forward``, and the properties that read the same in every family.

Each adapter keeps only what is specific to it: its processor, its grids and token rule, and
the call of its own tower.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, TypeVar

import torch

from ..._errors import BadRequestError, InternalError
from ..._modality import Modality
from .._media._limits import MediaLimits, PixelBudget, ResizeRule, derived_image_pixels
from .._media._pixels import load_image
from .._media._policy import MediaPolicy, item_label
from .._protocol import Preprocessed, split_embedding

if TYPE_CHECKING:
    from PIL import Image

    from ..._video_timing import VideoTiming
    from ._fast_pixels import FastPixels

__all__ = [
    "PROVENANCE_KEYS",
    "Patches",
    "PerThread",
    "TowerModel",
    "architecture_json",
    "checked_request",
    "identity_digest",
    "pixel_budget",
    "settings_json",
    "state_digest",
]

_T = TypeVar("_T")

#: One item's ``pixel_values``, its grid rows and, where the fast path made them, the resized
#: ``uint8`` pixels they follow from (``None`` on the processor's path).
Patches = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

# Config entries that say where a model came from or which library wrote it, not what it
# computes; leaving them out of the identity keeps it equal across a save/load round trip.
PROVENANCE_KEYS: Final = frozenset(
    {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype"}
)


def update_with_tensor(digest: Any, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s dtype, shape and bytes to ``digest``. Blocks on a copy to the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest.update(f"{flat.dtype}{tuple(tensor.shape)}".encode())
    # Reinterpreted as bytes so dtypes numpy lacks (bfloat16) hash the same way.
    digest.update(flat.view(torch.uint8).numpy().data)


def architecture_json(config: Mapping[str, Any]) -> str:
    """``config`` without its top-level provenance entries, as canonical JSON."""
    kept = {key: value for key, value in config.items() if key not in PROVENANCE_KEYS}
    return json.dumps(kept, sort_keys=True, default=str)


def state_digest(module: torch.nn.Module) -> str:
    """sha256 over a module's parameters and buffers (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        update_with_tensor(digest, tensor)
    return digest.hexdigest()


def settings_json(settings: Mapping[str, Any]) -> str:
    """A processor's settings as canonical JSON (what identities hash)."""
    return json.dumps(settings, sort_keys=True, default=str)


def identity_digest(*parts: str) -> str:
    """sha256 over ``parts`` in order: a model's identity from its type, architecture,
    processor settings and weight digests. Does not block."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
    return digest.hexdigest()


def content_key(
    identity: str,
    grid: tuple[tuple[int, ...], ...],
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> str:
    """The ``cache_key`` of preprocessed input: sha256 over the model's identity, the grid
    and each named tensor (its name, then its dtype, shape and bytes). Blocks on hashing.

    The processor's path names its feature tensors; the fast path passes each item's resized
    ``uint8`` pixels, unnamed, which the features follow from exactly at an eighth of their
    bytes. Device pixels are hashed on the CPU, so the ``"device"`` mode's keys are the
    ``"fast"`` mode's."""
    digest = hashlib.sha256()
    digest.update(identity.encode())
    digest.update(json.dumps(grid).encode())
    for name, tensor in tensors:
        digest.update(name.encode())
        update_with_tensor(digest, tensor)  # in its canonical (contiguous) layout
    return digest.hexdigest()


class PerThread(Generic[_T]):
    """One private copy of a third-party processor per thread.

    Processors only read their settings today, but they are third-party code with attributes
    any release could start caching into; a copy per thread keeps concurrent ``preprocess``
    calls independent. ``fresh`` builds a copy; it must not hold the adapter (no cycle).
    """

    def __init__(self, first: _T, fresh: Callable[[], _T]) -> None:
        self._fresh = fresh
        self._threads = threading.local()
        self._threads.value = first

    def get(self) -> _T:
        """This thread's copy, built on its first call in the thread. Does not block."""
        value: _T | None = getattr(self._threads, "value", None)
        if value is None:
            value = self._fresh()
            self._threads.value = value
        return value


def checked_request(
    items: object, modality: Modality | str, supported: frozenset[Modality], name: str
) -> Modality:
    """The parsed ``modality`` of a request, once it and ``items`` fit the model.

    :raises BadRequestError: naming ``modality`` for one not in ``supported``, ``mm_items``
        if ``items`` is not a list.
    """
    modality = Modality.parse(modality)
    if modality not in supported:
        listed = ", ".join(sorted(m.value for m in supported))
        raise BadRequestError(
            f"modality {modality.value!r} is not supported by model {name!r} (supported: {listed})"
        )
    if isinstance(items, (str, bytes, bytearray)) or not isinstance(items, Sequence):
        raise BadRequestError(f"mm_items must be a list; got {type(items).__name__}")
    return modality


def pixel_budget(
    limits: MediaLimits, count: int, image_rule: ResizeRule, video_rule: ResizeRule
) -> PixelBudget:
    """The pixel budget of one request of ``count`` items under ``limits``; without a
    configured per-image limit, images may be as large as ``image_rule`` keeps them.

    :raises BadRequestError: naming ``mm_items`` for more than ``limits.max_items``.
    """
    limits.check_items(count)
    image_pixels = limits.max_image_pixels or derived_image_pixels(image_rule.max_pixels)
    return PixelBudget(
        limits, image_pixels=image_pixels, image_rule=image_rule, video_rule=video_rule
    )


class TowerModel:
    """What every adapter has in common: its properties, ``forward``, an image family's image
    items and the result of ``preprocess``. A subclass sets ``_name``, ``_identity``, ``_limits``,
    ``_hidden_size`` and ``_weights`` (the module whose dtype and device the embeddings have)
    in its constructor, names its two feature tensors in ``_feature_keys`` and defines
    ``_encode``."""

    _name: str
    _identity: str
    _limits: MediaLimits
    _media: MediaPolicy
    _hidden_size: int
    _weights: Any
    #: The keys of ``Preprocessed.features`` ``preprocess`` writes and ``forward`` reads.
    _feature_keys: tuple[str, str]
    _MODALITIES: ClassVar[frozenset[Modality]]
    #: The fast image path (on the CPU or the model's device), or ``None`` where the
    #: processor itself runs (``"reference"``).
    _pixels: FastPixels | None

    #: ``(label, attribute)`` of each value ``repr`` shows between the name and the dtype.
    _SHOWN: ClassVar[tuple[tuple[str, str], ...]] = (("hidden_size", "_hidden_size"),)

    #: ``preprocess`` takes a per-call ``limits`` keyword (the encoder passes its config's).
    accepts_media_limits: Final = True

    def __repr__(self) -> str:
        shown = "".join(f"{label}={getattr(self, name)!r}, " for label, name in self._SHOWN)
        return (
            f"{type(self).__name__}(name={self._name!r}, {shown}"
            f"dtype={self.dtype}, device={self.device})"
        )

    @property
    def name(self) -> str:
        """The built-in name or checkpoint folder this model was loaded from."""
        return self._name

    @property
    def modalities(self) -> frozenset[Modality]:
        """The modalities ``preprocess`` accepts."""
        return self._MODALITIES

    @property
    def identity(self) -> str:
        """sha256 over the architecture, processor settings and weights; part of cache keys."""
        return self._identity

    @property
    def hidden_size(self) -> int:
        """Width of every embedding row: the language model's hidden size (times the
        sections of :attr:`embedding_layout`, where a model has one)."""
        return self._hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, which the embeddings have too."""
        dtype: torch.dtype = self._weights.dtype
        return dtype

    @property
    def device(self) -> torch.device:
        """Where the model runs and its embeddings are returned."""
        device: torch.device = self._weights.device
        return device

    @property
    def preprocess_mode(self) -> str:
        """How images are preprocessed: ``"fast"``, ``"device"`` (the fast path on
        :attr:`device`) or ``"reference"`` (the processor)."""
        return "reference" if self._pixels is None else self._pixels.preprocess

    @property
    def _pixels_identity(self) -> str:
        # What the identity names: the processor's pixel values differ slightly from the fast
        # kernels', so those never share a cache entry; on the CPU or a device the kernels
        # write the same values from the same resized pixels, which the key hashes.
        return "reference" if self._pixels is None else "fast"

    @property
    def media_limits(self) -> MediaLimits:
        """The budgets ``preprocess`` applies when its caller passes none."""
        return self._limits

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        """Encode a batch in one fused call of the model; one ``[tokens, hidden_size]``
        tensor per element, on :attr:`device` in :attr:`dtype`. Blocks on the compute.

        :raises InternalError: if an element lacks this model's features, or the model
            produced other token counts or widths than the elements' ``token_counts``.
        """
        totals: list[int] = []
        firsts: list[torch.Tensor] = []
        seconds: list[torch.Tensor] = []
        for number, element in enumerate(batch):
            totals.append(element.num_tokens)
            if not element.token_counts:
                continue
            first, second = (element.features.get(key) for key in self._feature_keys)
            if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
                raise InternalError(
                    f"batch[{number}] has no {'/'.join(self._feature_keys)} features; "
                    f"it was not preprocessed by model {self._name!r}"
                )
            firsts.append(first)
            seconds.append(second)
        if not firsts:  # no element has tokens
            width, dtype, device = self._hidden_size, self.dtype, self.device
            return [torch.empty((0, width), dtype=dtype, device=device) for _ in batch]
        with torch.inference_mode():
            rows = self._encode(firsts, seconds)
        pieces = split_embedding(rows, totals)
        if rows.shape[1] != self._hidden_size:
            raise InternalError(
                f"Encoder produced {rows.shape[1]}-wide tokens, expected {self._hidden_size}"
            )
        # Cloned outside inference mode: ordinary tensors (inference tensors refuse in-place
        # updates anywhere else), each with its own storage, so staging or freeing one
        # request's embedding neither keeps its batch-mates' memory alive nor aliases it.
        return [piece.clone(memory_format=torch.contiguous_format) for piece in pieces]

    def _encode(self, firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> torch.Tensor:
        """The ``[tokens, hidden_size]`` rows of the elements whose features are ``firsts``
        and ``seconds``, one element after the other. Runs in inference mode."""
        raise NotImplementedError

    def _image_item(self, processor: Any, item: object, index: int, budget: PixelBudget) -> Patches:
        """One image item, decoded within ``budget``, through the fast path where there is
        one, else through ``processor``. Blocks on reads, decoding and CPU work.

        :raises BadRequestError: naming ``mm_items[index]`` for an image that cannot be
            fetched or decoded, that passes the budget, or that the processor refuses (e.g.
            an aspect ratio above 200).
        """
        image = load_image(item, index, self._media, budget=budget)
        if self._pixels is not None:
            return self._fast_image(self._pixels, image, index)
        try:
            out = processor(images=[image], return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise BadRequestError(f"{item_label(index)}: cannot preprocess image: {exc}") from exc
        return out["pixel_values"], out["image_grid_thw"], None

    def _fast_image(self, pixels: FastPixels, image: Image.Image, index: int) -> Patches:
        """One image's patches on the fast path, sized by the processor's own rule; on the
        path's device. Blocks on CPU work."""
        raise NotImplementedError

    def _result(
        self,
        patches: list[Patches],
        tokens: Callable[[tuple[int, ...]], int],
        video_timing: tuple[VideoTiming, ...] | None = None,
        *,
        dim: int = 0,
    ) -> Preprocessed:
        """A preprocessed request: each item's features (joined along ``dim``) and grid
        joined, ``tokens`` of each grid row, and the cache key (over the fast path's resized
        pixels, where the fast path ran). The features stay where they were made (the
        model's device in the ``"device"`` mode). Blocks on hashing."""
        if not patches:
            return Preprocessed(token_counts=(), grid=(), features={}, cache_key=None)
        pixel_values, grids, sources = zip(*patches, strict=True)
        grid = torch.cat(grids)
        rows = tuple(tuple(int(size) for size in row) for row in grid.view(len(grids), -1).tolist())
        token_counts = tuple(tokens(row) for row in rows)
        # One item's tensor as it is: a copy of it would cost as much as making it.
        values = pixel_values[0] if len(pixel_values) == 1 else torch.cat(pixel_values, dim=dim)
        features = dict(zip(self._feature_keys, (values, grid), strict=True))
        if any(source is None for source in sources):  # the processor's path
            named = [(key, features[key]) for key in sorted(features)]
        else:
            named = [("", source) for source in sources]
        cache_key = content_key(self._identity, rows, named)
        return Preprocessed(
            token_counts=token_counts,
            grid=rows,
            features=features,
            cache_key=cache_key,
            video_timing=video_timing,
        )
