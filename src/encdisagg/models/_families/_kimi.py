"""Kimi-K2.5 vision behind the ``VisionModel`` protocol.

The embeddings a Kimi-K2.5 language model consumes are the vision tower's pooled patches
(``Kimi_K25VisionModel``: every ``merge_kernel_size`` block of patches, averaged over the
frames of a clip) passed through the multimodal projector (``Kimi_K25MultimodalProjection``),
exactly as ``Kimi_K25Model.get_image_features`` computes them; so one item of grid
``[t, h, w]`` becomes ``h*w / (merge_h*merge_w)`` tokens of the text model's width
(:func:`~encdisagg.models.kimi_grid_tokens`). Images go through
:class:`~._kimi_processor.Kimi_K25ImageProcessorPil`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import torch
from PIL import Image
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
from transformers.models.kimi_k25.modeling_kimi_k25 import (
    Kimi_K25MultimodalProjection,
    Kimi_K25PreTrainedModel,
    Kimi_K25VisionModel,
)

from ..._errors import BadRequestError, InternalError
from ..._modality import Modality
from .._grids import kimi_grid_tokens
from .._media._limits import MediaLimits
from .._media._policy import MediaPolicy
from .._protocol import Preprocessed
from ._fast_pixels import FastPixels, fast_pixels
from ._kimi_processor import Kimi_K25ImageProcessorPil, KimiResizeRule
from ._tower import (
    PROVENANCE_KEYS,
    Patches,
    PerThread,
    TowerModel,
    checked_request,
    identity_digest,
    pixel_budget,
    settings_json,
    state_digest,
)

__all__ = ["KimiK25VisionEncoder", "KimiVisionModel"]

PIXEL_VALUES: Final = "pixel_values"
GRID_THWS: Final = "grid_thws"


class KimiK25VisionEncoder(Kimi_K25PreTrainedModel):  # type: ignore[no-untyped-call]
    """The vision half of ``Kimi_K25Model``: its ``vision_tower`` and ``mm_projector``,
    under the same names, so a full checkpoint's vision weights load into it as they are.

    ``forward(pixel_values, grid_thw)`` returns ``[tokens, text_hidden_size]``: the
    projected pooled patches of every item, one item after the other. Blocks on compute.
    """

    config_class = Kimi_K25Config

    def __init__(self, config: Kimi_K25Config) -> None:
        super().__init__(config)
        # transformers' constructors are unannotated; Any keeps mypy's strict mode quiet.
        tower_class: Any = Kimi_K25VisionModel
        projector_class: Any = Kimi_K25MultimodalProjection
        self.vision_tower = tower_class._from_config(config.vision_config)
        self.mm_projector = projector_class(config)
        initialise: Any = self.post_init
        initialise()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_tower(pixel_values, grid_thw=grid_thw).pooler_output
        projected: torch.Tensor = self.mm_projector(pooled).squeeze(1)
        return projected


def _architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    # Provenance keys stripped at every level: the vision and text sub-configs carry their
    # own ``dtype``, which a save/load round trip fills in.
    return {
        key: _architecture(value) if isinstance(value, Mapping) else value
        for key, value in config.items()
        if key not in PROVENANCE_KEYS
    }


@final
class KimiVisionModel(TowerModel):
    """A Kimi-K2.5 vision tower and projector with its image processor.

    Build one with :func:`~encdisagg.models.load_model` (``"tiny-kimi-k25"`` or a
    ``kimi_k25`` checkpoint folder). ``preprocess`` is safe to call from several threads at
    once; ``forward`` must be called by one thread at a time, any thread.

    :param encoder: the vision encoder, already on its device and dtype.
    :param image_processor: the processor whose settings fix the grids.
    :param name: the model's name (a built-in name or the checkpoint folder).
    :param media: which media items may be and where they may come from.
    :param limits: the media budgets of a request whose caller passes none.
    :param preprocess: ``"fast"`` (``uint8`` resize, one normalising pass), ``"device"``
        (the same on the encoder's device) or ``"reference"`` (the image processor itself).
    :raises BadRequestError: naming ``model`` if the processor's patch or merge size does
        not match the tower's; ``preprocess`` for another mode.
    """

    _feature_keys = (PIXEL_VALUES, GRID_THWS)
    _MODALITIES = frozenset({Modality.IMAGE})

    def __init__(
        self,
        encoder: KimiK25VisionEncoder,
        image_processor: Kimi_K25ImageProcessorPil,
        *,
        name: str,
        media: MediaPolicy | None = None,
        limits: MediaLimits | None = None,
        preprocess: str = "fast",
    ) -> None:
        config: Any = encoder.config
        merge_h, merge_w = (int(size) for size in config.vision_config.merge_kernel_size)
        patch = int(config.vision_config.patch_size)
        merge = int(image_processor.merge_size)
        if int(image_processor.patch_size) != patch or merge_h != merge or merge_w != merge:
            raise BadRequestError(
                f"model: {name!r} has a processor with patch_size={image_processor.patch_size}"
                f", merge_size={merge}, but its tower has patch_size={patch}, "
                f"merge_kernel_size={[merge_h, merge_w]}"
            )
        module: torch.nn.Module = encoder
        module.train(False)  # eval mode; via the base class, whose annotations mypy sees
        self._encoder = encoder
        self._weights = encoder
        self._name = name
        self._merge_kernel = (merge_h, merge_w)
        self._hidden_size = int(config.text_config.hidden_size)
        self._media = media or MediaPolicy()
        self._limits = limits or MediaLimits()
        self._processor_config: dict[str, Any] = image_processor.to_dict()
        self._rule = KimiResizeRule(
            factor=patch * merge,
            min_pixels=1,
            max_pixels=int(image_processor.max_patches) * patch * patch,
            patch_size=patch,
            merge_size=merge,
            max_patches=int(image_processor.max_patches),
            max_side_patches=int(image_processor.size["max_height"]),
        )
        processor_config = dict(self._processor_config)
        self._processors = PerThread(
            image_processor, lambda: Kimi_K25ImageProcessorPil.from_dict(dict(processor_config))
        )
        self._pixels = fast_pixels(image_processor, preprocess, self.device)
        self._identity = identity_digest(
            "kimi_k25",
            self._pixels_identity,
            settings_json(_architecture(config.to_dict())),
            settings_json(self._processor_config),
            state_digest(encoder),
        )

    # --- identity and shape -------------------------------------------------------------

    @property
    def merge_kernel_size(self) -> tuple[int, int]:
        """Patches pooled into one token along height and width."""
        return self._merge_kernel

    @property
    def tower(self) -> KimiK25VisionEncoder:
        """The underlying vision tower and projector."""
        return self._encoder

    # --- preprocessing ------------------------------------------------------------------

    def preprocess(
        self,
        items: Sequence[object],
        modality: Modality | str,
        *,
        limits: MediaLimits | None = None,
    ) -> Preprocessed:
        """Decode and preprocess one request's images. Blocks on CPU work, file reads and
        (when enabled) media downloads.

        Each image becomes one ``(1, h, w)`` grid row (``grid_thws``, in patches) and
        ``h*w / (merge_h*merge_w)`` tokens. The budgets (``limits``, else
        :attr:`media_limits`) are checked against each item's header before it is decoded.

        :raises BadRequestError: naming ``modality`` for one this model does not encode,
            ``mm_items`` if ``items`` is not a list or has more than ``max_items``, or
            ``mm_items[i]`` for an item that cannot be fetched, decoded or preprocessed,
            or that passes a budget.
        """
        checked_request(items, modality, self.modalities, self._name)
        budget = pixel_budget(limits or self._limits, len(items), self._rule, self._rule)
        processor = self._processors.get()
        patches = [
            self._image_item(processor, item, index, budget) for index, item in enumerate(items)
        ]
        return self._result(patches, self._tokens)

    def _tokens(self, row: tuple[int, ...]) -> int:
        try:
            return kimi_grid_tokens(row, self._merge_kernel)
        except ValueError as exc:  # a processor whose padding disagrees with the tower
            raise InternalError(f"model {self._name!r}: {exc}") from exc

    def _fast_image(self, pixels: FastPixels, image: Image.Image, index: int) -> Patches:
        # The resized pixels it gives back are padded to whole merged patches.
        resized, padded = self._rule.navit(image.width, image.height)
        values, canvas = pixels.kimi_image(image, resized, padded)
        patch = self._rule.patch_size
        grid = torch.tensor([[1, padded[0] // patch, padded[1] // patch]], dtype=torch.int64)
        return values, grid, canvas

    def _encode(self, firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> torch.Tensor:
        rows: torch.Tensor = self._encoder(
            torch.cat(firsts).to(self.device, self.dtype), torch.cat(seconds).to(self.device)
        )
        return rows

    # --- checkpoints --------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write a checkpoint folder :func:`~encdisagg.models.load_model` loads back
        bit-identically: ``config.json`` (the full ``kimi_k25`` config) and
        ``model.safetensors`` (``vision_tower.*`` and ``mm_projector.*``), and
        ``preprocessor_config.json``. Blocks on disk I/O.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._encoder.save_pretrained(folder)
        Kimi_K25ImageProcessorPil.from_dict(dict(self._processor_config)).save_pretrained(folder)
